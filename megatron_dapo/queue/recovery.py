"""Crash recovery for the queue trainer: put the prompts that were in flight back in the queue.

After a restart the store still holds what was committed. A prompt whose status is `pending`
(never claimed) or `running` (claimed, generation cut short) may have some of its trajectories
written and others not. Reissuing deletes those partial trajectories and resets the prompt to
`pending` with the current `global_steps`, so each prompt ends with exactly one complete set of
trajectories: nothing lost, nothing duplicated. Prompts already `done` / `consumed` and their
trajectories are left as they are. The sync trainer keeps no state in the queue between steps,
so there is nothing to reissue in sync mode.
"""

from __future__ import annotations

import logging

from megatron_dapo.queue.meta import KVBatchMeta, check_tag
from megatron_dapo.queue.store import TransferQueue, UnknownPartitionError

logger = logging.getLogger(__name__)

IN_FLIGHT_STATUSES = ("pending", "running")


def reissue_inflight_prompts(
    queue: TransferQueue, partition: str, *, global_steps: int, sync_mode: bool
) -> tuple[int, KVBatchMeta]:
    """Reissue the in-flight prompts of `partition`; return (how many, their meta).

    One write transaction: find prompts (is_prompt=True) with status pending or running, delete
    their trajectories (`<uid>_<i>`), set them to status pending with `global_steps`. The caller
    restarts generation for the returned meta (its tags carry the new `global_steps`). A
    partition that does not exist yet (first start) has nothing in flight: (0, empty meta).
    """
    if sync_mode:
        return 0, KVBatchMeta.empty(partition)
    global_steps = check_tag("global_steps", global_steps)
    with queue.transaction():
        try:
            keys = queue.list_keys(partition, is_prompt=True, status=IN_FLIGHT_STATUSES)
        except UnknownPartitionError:
            return 0, KVBatchMeta.empty(partition)
        if not keys:
            return 0, KVBatchMeta.empty(partition)
        n_deleted = queue.delete_trajectories(partition, keys)
        queue.update_tags(partition, keys, status="pending", global_steps=global_steps)
        meta = queue.get_meta(partition, keys)
    logger.info(
        "reissued %d in-flight prompts of partition %r at global_steps=%d (deleted %d partial trajectories)",
        len(keys),
        partition,
        global_steps,
        n_deleted,
    )
    return len(keys), meta
