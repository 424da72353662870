"""Rollout producers of the queue trainer's async mode on SGLang: threads on global rank 0.

The servers do the generating; a producer only claims pending prompts, sends them to the servers
through rank 0's engine client (rollout/sglang/engine.py, which balances requests over the servers),
scores the replies (claim_reward.py) and writes each claim's groups atomically (producer.Producer). `queue.num_producers` threads keep that
many claims in flight, each with its own connection to the queue's SQLite file.

Around a weight push (queue_trainer.QueueTrainer._sync_weights) the trainer either
- pauses the servers in place (`queue.partial_rollout`): running requests keep their tokens and KV
  cache and continue under the new weights once the push is done; each sample reports the versions
  its tokens came from (Sample.first_policy_version .. policy_version), or
- drains the producers (`drain`): no new claim starts, the push waits until the running claims are
  written, so every sample comes from one weight version.

A producer thread that fails (the servers all down, a bad reply) stops; `check` raises its error in the
trainer, which stops the run (its running claims are reissued by the queue recovery at the next start).
"""

from __future__ import annotations

import logging
import threading
import time

from megatron_dapo.queue import TransferQueue
from megatron_dapo.rollout.base import RolloutEngineError, SamplingParams
from megatron_dapo.trainer.claim_reward import ClaimScorer
from megatron_dapo.trainer.producer import Producer

log = logging.getLogger(__name__)


class ProducerError(RolloutEngineError):
    """A rollout producer thread failed; the message carries its error."""


class ServerProducers:
    """`num` producer threads over one engine client (`engine`: rank 0's SGLangEngine)."""

    def __init__(self, queue_path: str, engine, *, sampling: SamplingParams, num: int, claim_size: int,
                 scorer: ClaimScorer | None = None, poll_s: float = 0.02):
        self.queue_path, self.engine, self.sampling, self.scorer = queue_path, engine, sampling, scorer
        self.num, self.claim_size, self.poll_s = num, claim_size, poll_s
        self._cond = threading.Condition()
        self._open = True  # False while drained: no thread starts a claim
        self._busy = 0  # threads inside a claim (generate + write)
        self._stop = threading.Event()
        self._errors: list[tuple[int, BaseException]] = []
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for i in range(self.num):
            t = threading.Thread(target=self._run, args=(i,), name=f"producer{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _run(self, i: int) -> None:
        queue = TransferQueue(self.queue_path)
        producer = Producer(queue, self.engine, sampling=self.sampling, producer_id=f"t{i}",
                            fault_point="producer_generation", stop=self._stop, scorer=self.scorer)
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._open or self._stop.is_set())
                    if self._stop.is_set():
                        return
                    self._busy += 1
                written, failed = 0, None
                try:
                    written = producer.run_once(self.claim_size)
                except BaseException as e:  # noqa: BLE001 - kept for the trainer (check), which raises it
                    failed = e
                with self._cond:  # the error is on record before a drain can see this claim end
                    if failed is not None and not self._stop.is_set():
                        log.error("producer thread %d failed: %s: %s", i, type(failed).__name__, failed)
                        self._errors.append((i, failed))
                    self._busy -= 1
                    self._cond.notify_all()
                if failed is not None:
                    return
                if written == 0:
                    self._stop.wait(self.poll_s)
        finally:
            queue.close()

    def drain(self) -> None:
        """Stop starting claims and wait until none is running (their groups are written)."""
        with self._cond:
            self._open = False
            self._cond.wait_for(lambda: self._busy == 0 or bool(self._errors))
        self.check()

    def resume(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def check(self) -> None:
        """Raise the first failure of a producer thread."""
        if self._errors:
            i, e = self._errors[0]
            raise ProducerError(f"rollout producer thread {i} failed: {type(e).__name__}: {e}") from e

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the threads; generation still running is aborted on the servers (its claims stay running
        and are reissued by the next start's recovery). The abort is repeated while a thread is still in a
        call: one that was just being sent when the first abort went out would otherwise run to its end."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
            busy = self._busy > 0
        deadline = time.monotonic() + timeout_s
        while busy and time.monotonic() < deadline:
            try:
                self.engine.abort()
            except Exception as e:  # noqa: BLE001 - closing: the servers may be gone already
                log.warning("aborting the producers' requests failed: %s", e)
                break
            with self._cond:
                busy = not self._cond.wait_for(lambda: self._busy == 0, timeout=0.5)
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.warning("producer thread %s did not stop within %.0f s", t.name, timeout_s)
        self._threads = []
