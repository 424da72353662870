"""Rollout producers of the queue trainer's async mode on SGLang: a process of their own beside global
rank 0 (`ProducerProcess`), running `queue.num_producers` producer threads (`ServerProducers`).

The servers do the generating; a producer thread only claims pending prompts, sends them to the servers
through the process's engine client (a follower of rank 0's engine, rollout/sglang/follower.py, which
balances requests over the servers), scores the replies (claim_reward.py) and writes each claim's groups
atomically (producer.Producer), each thread with its own connection to the queue's SQLite file. Reply
parsing, reward and queue writes therefore run beside the training process, never on its GIL; rank 0's
engine keeps the servers' lifecycle (health, restarts, pauses, weight pushes) and tells the process the
servers' states as they change.

Around a weight push (queue_trainer.QueueTrainer._sync_weights) the trainer either
- pauses the servers in place (`queue.partial_rollout`): running requests keep their tokens and KV
  cache and continue under the new weights once the push is done; each sample reports the versions
  its tokens came from (Sample.first_policy_version .. policy_version), or
- drains the producers (`drain`): no new claim starts, the push waits until the running claims are
  written, so every sample comes from one weight version.

A producer thread that fails (the servers all down, a bad reply) stops; `check` raises its error in the
trainer, which stops the run (its running claims are reissued by the queue recovery at the next start).
A producer process that dies is restarted by `check`, its running claims reissued first.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from megatron_dapo.queue import TransferQueue
from megatron_dapo.rollout.base import RolloutEngineError, SamplingParams
from megatron_dapo.trainer.claim_reward import ClaimScorer
from megatron_dapo.trainer.producer import Producer, as_own_world, reissue_claims

log = logging.getLogger(__name__)


class ProducerError(RolloutEngineError):
    """A rollout producer thread failed; the message carries its error."""


class ServerProducers:
    """`num` producer threads over one engine client (in the producer process: a follower engine)."""

    def __init__(self, queue_path: str, engine, *, sampling: SamplingParams, num: int, claim_size: int,
                 scorer: ClaimScorer | None = None, poll_s: float = 0.02,
                 on_error: Callable[[int, BaseException], None] | None = None):
        """on_error(thread, error): called when a thread fails, besides keeping the error for `check`. Each
        claim's routing (R3) is written with its rows when the engine asks the servers for it."""
        self.queue_path, self.engine, self.sampling, self.scorer = queue_path, engine, sampling, scorer
        self.routing = getattr(engine, "routing", None) is not None
        self.num, self.claim_size, self.poll_s, self.on_error = num, claim_size, poll_s, on_error
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
                            fault_point="producer_generation", stop=self._stop, scorer=self.scorer,
                            routing=self.routing)
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
                        if self.on_error is not None:
                            self.on_error(i, failed)
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


# ------------------------------------------------------------------------------------ the process


@dataclass(frozen=True)
class ProcessSpec:
    """What the producer process is started with (picklable)."""

    queue_path: str
    engine: dict  # rollout/sglang/follower.follower_spec of rank 0's engine
    sampling: SamplingParams
    num: int
    claim_size: int
    poll_s: float
    cfg: object | None  # the run's Config: the reward stage is built from it; None writes claims unscored
    parent_pid: int


class ProducerProcess:
    """The SGLang producers in a process of their own, beside global rank 0 (spawned by it): `num` threads
    there (ServerProducers) over a follower of rank 0's engine (rollout/sglang/follower.py), with their own
    reward stage (built from `cfg`) and their own connections to the queue. So reply parsing, reward and the
    queue writes never take the training process's GIL; rank 0 keeps two threads here, one that sends the
    process the servers' states whenever they change (a pause, a server lost or back, a new weight
    version) and one that reads what it reports (a server it lost, a failed thread, a drain done).

    The trainer's interface is the threads' one: start, drain, resume, check, close. A process that dies (a
    crash, the OOM killer) is restarted by `check` (at most `max_restarts` times), its running claims
    reissued first (their prompts pending again, tagged `global_steps()`); a thread that fails stops the
    run (`check` raises ProducerError). A trainer that dies takes the process with it (PR_SET_PDEATHSIG)."""

    def __init__(self, queue: TransferQueue, engine, *, sampling: SamplingParams, num: int, claim_size: int,
                 global_steps: Callable[[], int], cfg=None, poll_s: float = 0.02, max_restarts: int = 3,
                 close_timeout_s: float = 60.0, prestarted: Prestarted | None = None):
        """prestarted: a process `prestart` spawned early (its reward stage built while the trainer built
        its model); the first start uses it, a restart spawns afresh."""
        import multiprocessing as mp

        from megatron_dapo.rollout.sglang.follower import follower_spec

        self._ctx = mp.get_context("spawn")
        self._prestarted = prestarted
        self.queue, self.engine, self.global_steps = queue, engine, global_steps
        self.spec = ProcessSpec(str(queue.path), follower_spec(engine), sampling, num, claim_size, poll_s, cfg,
                                os.getpid())
        self.max_restarts, self.close_timeout_s, self.restarts = max_restarts, close_timeout_s, 0
        self.process = None
        self._conn = None
        self._send_lock = threading.Lock()
        self._drained = threading.Event()
        self._errors: list[str] = []
        self._open = True
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._spawn()
        sender = threading.Thread(target=self._send_states, name="producer-states", daemon=True)
        sender.start()
        self._threads.append(sender)
        atexit.register(self.close)  # before multiprocessing joins its children at exit (atexit runs LIFO)

    def _spawn(self) -> None:
        pre, self._prestarted = self._prestarted, None
        if pre is not None and pre.process.is_alive():
            self.process, conn = pre.process, pre.conn
            conn.send(("spec", self.spec))
        else:
            if pre is not None:
                pre.close()
            conn, child = self._ctx.Pipe()
            self.process = self._ctx.Process(target=producer_process_main, args=(self.spec, child),
                                             name="sglang-producers")
            self.process.start()
            child.close()
        with self._send_lock:
            self._conn, self._last_states = conn, None
        reader = threading.Thread(target=self._read, args=(conn,), name="producer-reports", daemon=True)
        reader.start()
        self._threads.append(reader)
        self._push_states()
        log.info("SGLang producer process %d started: %d producer threads, claims of %d prompts",
                 self.process.pid, self.spec.num, self.spec.claim_size)

    def close(self) -> None:
        """Stop the process: its running requests are aborted on the servers, their claims stay running
        (reissued by the next start's recovery)."""
        atexit.unregister(self.close)
        self._stop.set()
        if self._prestarted is not None:
            self._prestarted.close()
            self._prestarted = None
        if self.process is None:
            return
        self._send(("close",))
        self.process.join(self.close_timeout_s)
        if self.process.is_alive():
            log.warning("the SGLang producer process did not stop within %.0f s; killing it", self.close_timeout_s)
            self.process.kill()
            self.process.join()
        for t in self._threads:
            t.join(5.0)
        self._threads, self.process = [], None

    # -- the trainer's calls -----------------------------------------------------------------
    def drain(self) -> None:
        """No claim starts; returns once the running claims are written (or the process died: its claims
        are reissued at `resume`)."""
        self._open = False
        self._drained.clear()
        self._send(("drain",))
        while not self._drained.wait(0.05) and not self._errors and self.process.is_alive():
            pass
        self._raise_errors()

    def resume(self) -> None:
        self._open = True
        if not self.process.is_alive():
            self._revive()
        else:
            self._send(("resume",))

    def check(self) -> None:
        """Raise a failed producer thread's error; restart a dead process (its running claims reissued)."""
        self._raise_errors()
        if self._open and not self.process.is_alive():
            self._revive()

    def _raise_errors(self) -> None:
        if self._errors:
            raise ProducerError(f"rollout producer {self._errors[0]}")

    def _revive(self) -> None:
        code, pid = self.process.exitcode, self.process.pid
        keys = [k for i in range(self.spec.num)
                for k in reissue_claims(self.queue, f"t{i}.{pid}.", global_steps=self.global_steps())]
        self.restarts += 1
        if self.restarts > self.max_restarts:
            raise ProducerError(f"the SGLang producer process died {self.restarts} times (last exit code {code}); "
                                "see its log lines above")
        log.warning("the SGLang producer process died (exit code %s); reissued its %d running prompts, restarting "
                    "it (%d/%d)", code, len(keys), self.restarts, self.max_restarts)
        self._spawn()

    # -- the channel -------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._send_locked(message)

    def _send_locked(self, message: tuple) -> None:
        try:
            self._conn.send(message)
        except (BrokenPipeError, ConnectionError, OSError):  # the process is gone: check() sees it
            pass

    def _push_states(self) -> None:
        """Send the servers' states if they changed since the last sent (read and sent under one lock, so
        the process never receives an older state after a newer one)."""
        from megatron_dapo.rollout.sglang.follower import leader_states

        with self._send_lock:
            states = leader_states(self.engine)
            if states != self._last_states:
                self._last_states = states
                self._send_locked(("states", *states))

    def _send_states(self) -> None:
        """The servers' states and weight version to the process whenever they change: the pool's condition
        is notified at every change (and at each request of rank 0's own)."""
        cond = self.engine.pool.cond
        while not self._stop.is_set():
            with cond:
                cond.wait(0.25)
            self._push_states()

    def _read(self, conn) -> None:
        while True:
            try:
                kind, *args = conn.recv()
            except (EOFError, OSError):
                return
            if kind == "drained":
                self._drained.set()
            elif kind == "error":
                log.error("SGLang producer thread %s failed: %s", *args)
                self._errors.append(f"thread {args[0]} failed: {args[1]}")
            elif kind == "down":
                self.engine.pool.mark_down(args[0], f"a producer's request: {args[1]}")
            elif kind == "reissue":
                self.engine.pool.note_reissue(*args)


@dataclass
class Prestarted:
    """A producer process spawned before the trainer's model is built (`prestart`): it imports what it
    runs and builds its reward stage meanwhile, then waits for its ProcessSpec (ProducerProcess's first
    start). Spawning a process and loading torch, the tokenizer and the reward manager takes seconds that
    would otherwise come after the model build, at every start of the run."""

    process: object
    conn: object

    def close(self, timeout_s: float = 10.0) -> None:
        """A prestarted process never given its spec (the run failed or ended first): stop it."""
        try:
            self.conn.send(("close",))
        except (BrokenPipeError, ConnectionError, OSError):
            pass
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def prestart(cfg) -> Prestarted:
    """Spawn the producer process early (global rank 0, async mode on SGLang): see Prestarted."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=producer_process_main, args=(None, child, cfg), name="sglang-producers")
    process.start()
    child.close()
    return Prestarted(process, conn)


def _claim_scorer(cfg, stack: contextlib.ExitStack) -> ClaimScorer | None:
    if cfg is None:
        return None
    from megatron_dapo.data.tokenizer import load_tokenizer
    from megatron_dapo.rewards.build import build_reward_manager

    return ClaimScorer(load_tokenizer(cfg.data.tokenizer), stack.enter_context(build_reward_manager(cfg)))


def producer_process_main(spec: ProcessSpec | None, conn, cfg=None) -> None:
    """Body of the producer process (ProducerProcess): the threads, a follower engine, the reward stage.
    spec None (`prestart`): the reward stage is built from `cfg`, then the spec awaited on `conn`."""
    as_own_world()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s sglang-producers %(levelname)s %(message)s")
    from megatron_dapo.rollout.sglang.follower import follower_engine

    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:
            try:
                conn.send(message)
            except (BrokenPipeError, ConnectionError, OSError):
                pass

    with contextlib.ExitStack() as stack:
        scorer = _claim_scorer(cfg if spec is None else spec.cfg, stack)
        if spec is None:  # prestarted: the trainer sends the spec once its engine is connected
            try:
                kind, *args = conn.recv()
            except (EOFError, OSError):  # the trainer is gone
                return
            if kind != "spec":  # closed before its start
                return
            spec = args[0]
        engine = follower_engine(spec.engine, leader=lambda *report: send(report))
        stack.callback(engine.close)
        producers = ServerProducers(spec.queue_path, engine, sampling=spec.sampling, num=spec.num,
                                    claim_size=spec.claim_size, scorer=scorer, poll_s=spec.poll_s,
                                    on_error=lambda i, e: send(("error", i, f"{type(e).__name__}: {e}")))
        stack.callback(producers.close)

        def drain() -> None:
            try:
                producers.drain()
            except ProducerError:
                pass  # the thread's error went to the trainer as it happened
            send(("drained",))

        producers.start()
        while True:
            try:
                if not conn.poll(1.0):
                    if os.getppid() != spec.parent_pid:  # the trainer is gone
                        return
                    continue
                kind, *args = conn.recv()
            except (EOFError, OSError):  # the trainer is gone
                return
            if kind == "states":
                engine.follow(*args)
            elif kind == "drain":
                threading.Thread(target=drain, name="drain", daemon=True).start()
            elif kind == "resume":
                producers.resume()
            elif kind == "close":
                return
