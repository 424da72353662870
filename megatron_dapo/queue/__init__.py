"""TransferQueue: a keyed, tagged sample store persisted in SQLite, and crash recovery.

Stages pass `KVBatchMeta` (partition, keys, tags) and read only the fields they need:

    q = TransferQueue("runs/exp/queue.sqlite")
    q.put("train", ["p1"], {"raw_prompt": ["1+1="]}, {"global_steps": 3})
    meta = q.claim("train", 8)                      # pending -> running, atomically
    q.put("train", ["p1_0", "p1_1"], {"responses": responses}, {"status": "done"})
"""

from megatron_dapo.queue.meta import (
    STATUSES,
    TAG_NAMES,
    KVBatchMeta,
    parse_key,
    prompt_uid_of,
    trajectory_key,
)
from megatron_dapo.queue.recovery import IN_FLIGHT_STATUSES, reissue_inflight_prompts
from megatron_dapo.queue.store import (
    DURABILITY_MODES,
    DuplicateKeyError,
    QueueKeyError,
    TransferQueue,
    UnknownPartitionError,
)

__all__ = [
    "DURABILITY_MODES",
    "IN_FLIGHT_STATUSES",
    "STATUSES",
    "TAG_NAMES",
    "DuplicateKeyError",
    "KVBatchMeta",
    "QueueKeyError",
    "TransferQueue",
    "UnknownPartitionError",
    "parse_key",
    "prompt_uid_of",
    "reissue_inflight_prompts",
    "trajectory_key",
]
