"""Reward manager: score a batch of responses, add DAPO's overlong penalty, contain failures.

Shapes: B = responses in the batch. ``RewardOutput.reward`` and ``.score`` are ``[B]`` float32.

A reward function is ``score_fn(solution_str, ground_truth) -> dict`` with at least ``"score"``
(a finite real number); ``"acc"`` (bool) and ``"pred"`` are used when present (``acc`` defaults
to ``score > 0``, ``pred`` to None). Its other keys (verl's ``reward_extra_info``) are kept per row in
``extra["reward_extra"]``: the trainer logs the numeric ones as ``reward_extra/<key>/mean`` and dumps
them with the rollouts.

Failure handling. Any of these counts as a failed call for a row: the function raises, returns
something without a ``"score"`` key, returns a score that is not a finite real number, runs
longer than ``timeout_s``, or kills its worker process. ``on_error="raise"`` raises
``RewardError`` naming the row, its ground truth and what went wrong; ``on_error="penalize"``
gives that row ``error_score`` (default -1.0, math_dapo's "wrong" score), counts it in
``num_errors`` and logs it. A NaN never reaches the output.

Execution. With ``timeout_s > 0`` every call runs in one of ``num_workers`` persistent worker
processes; a call that overruns has its worker killed and replaced, so one hanging call stalls a
batch by about ``timeout_s`` (a batch where every call hangs takes ``ceil(B / num_workers) *
timeout_s``). Rows are sent ahead, up to 32 (and 32 KB of text) per worker, answered in order: the
pipe round trip is paid per window, not per row (384 arithmetic rows in one worker: 43.6 -> 7.6 ms,
``python benchmarks/bench_reward.py``). Workers start on the first ``score`` call and live until ``close()`` (or the end
of a ``with`` block). The default start method is "forkserver": workers fork from a clean
server process that has this module (and torch) imported once, so a replacement worker costs
milliseconds and never inherits the trainer's CUDA context or threads. ``score_fn`` is pickled
to the workers, so it must be a module-level function (or a ``functools.partial`` of one).
With ``timeout_s <= 0`` calls run inline in this process: no pickling and no process overhead,
but a hanging function hangs the step.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import multiprocessing
import numbers
import pickle
import signal
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for_connections

import torch

from megatron_dapo.algos.overlong import overlong_penalty
from megatron_dapo.rewards import arithmetic, math_dapo, math_dapo_plus, math_verify

logger = logging.getLogger(__name__)

ScoreFn = Callable[..., Mapping]

_ON_ERROR_MODES = ("raise", "penalize")
_START_METHODS = ("forkserver", "spawn", "fork")
# How many failure messages a RewardOutput keeps and the log spells out per batch.
_MAX_ERROR_MESSAGES = 8
# A worker's start-up (forkserver launch, importing torch and score_fn's module) is not call time.
_WORKER_START_TIMEOUT_S = 120.0
_WINDOW = 32  # rows sent ahead to one worker (their answers stay far below a pipe's buffer)
_WINDOW_CHARS = 32768  # and at most this many characters of them (a socket pair buffers about 200 KB)
_ROW_OVERHEAD_CHARS = 256  # a row's ground truth and pickling, counted generously


class RewardError(RuntimeError):
    """A reward function failed on a row and ``on_error="raise"``."""


@dataclass(frozen=True)
class RewardOutput:
    """Rewards of one batch of B responses.

    reward:  [B] float32, score + overlong penalty (the penalty is 0 when shaping is off).
    score:   [B] float32, the reward function's score (``error_score`` on failed rows).
    extra:   per-row lists of length B: "score", "acc", "pred", "overlong_reward",
             "overlong" (the response reached max_response_length), "error" (the call failed),
             "reward_extra" (a dict per row: the other keys the function returned, {} when none),
             and "data_source" when data sources were given.
    num_errors: rows whose reward call failed (only nonzero with on_error="penalize").
    error_messages: the first few failure messages.
    """

    reward: torch.Tensor
    score: torch.Tensor
    extra: dict[str, list]
    num_errors: int
    error_messages: list[str]


# ---------------------------------------------------------------------------------------------
# Registry of reward functions (resolved once, when the trainer is built).

_REWARD_FNS: dict[str, ScoreFn] = {}


def register_reward_fn(name: str) -> Callable[[ScoreFn], ScoreFn]:
    """Decorator registering a module-level reward function under ``name``."""

    def decorator(fn: ScoreFn) -> ScoreFn:
        if name in _REWARD_FNS:
            raise ValueError(f"reward function {name!r} is already registered")
        _REWARD_FNS[name] = fn
        return fn

    return decorator


register_reward_fn("math_dapo")(math_dapo.compute_score)
register_reward_fn("math_dapo_plus")(math_dapo_plus.compute_score)
register_reward_fn("math_verify")(math_verify.compute_score)
register_reward_fn("arithmetic")(arithmetic.compute_score)


def get_reward_fn(name: str) -> ScoreFn:
    """The reward function registered as ``name``; unknown names raise ValueError listing the known."""
    if name not in _REWARD_FNS:
        raise ValueError(f"unknown reward function {name!r}; known: {sorted(_REWARD_FNS)}")
    return _REWARD_FNS[name]


def make_reward_fn(name: str, *, strict_box_verify: bool = False) -> ScoreFn:
    """The reward function ``name`` with the ``reward.*`` options it takes bound by keyword.

    Resolved once, when the trainer is built. ``strict_box_verify`` is bound for functions that
    have that parameter (math_dapo, math_dapo_plus); setting it for one that does not is a
    ValueError naming ``reward.strict_box_verify``, never a silently ignored option.
    """
    fn = get_reward_fn(name)
    if "strict_box_verify" in inspect.signature(fn).parameters:
        return functools.partial(fn, strict_box_verify=bool(strict_box_verify))
    if strict_box_verify:
        takers = sorted(n for n, f in _REWARD_FNS.items() if "strict_box_verify" in inspect.signature(f).parameters)
        raise ValueError(
            f"strict_box_verify=True (reward.strict_box_verify) has no meaning for reward function "
            f"{name!r}; it applies to {takers}"
        )
    return fn


# ---------------------------------------------------------------------------------------------
# Checking what a reward function returned (shared by the inline and the worker paths).


@dataclass(frozen=True)
class _Outcome:
    """One row's result: either a checked (score, acc, pred) or a failure message."""

    score: float = 0.0
    acc: bool = False
    pred: object = None
    extra: dict | None = None  # the returned dict's other keys
    failure: str | None = None
    detail: str = ""  # traceback text of a raised exception, for the log and RewardError


def _check_result(result: object) -> _Outcome:
    if not isinstance(result, Mapping):
        return _Outcome(failure=f"returned {type(result).__name__}, expected a dict with a 'score' key")
    if "score" not in result:
        return _Outcome(failure=f"returned a dict without a 'score' key (keys: {sorted(map(str, result))})")
    score = result["score"]
    if isinstance(score, torch.Tensor) and score.numel() == 1:
        score = score.item()
    if isinstance(score, bool) or not isinstance(score, numbers.Real):
        return _Outcome(failure=f"returned a non-numeric score {score!r} ({type(score).__name__})")
    score = float(score)
    if not math.isfinite(score):
        return _Outcome(failure=f"returned a non-finite score {score}")
    acc = result.get("acc", score > 0)
    if isinstance(acc, torch.Tensor) or type(acc).__module__ == "numpy":
        try:
            acc = acc.item()  # a torch or numpy scalar (np.bool_ included); an array stays and is refused below
        except (ValueError, RuntimeError):
            pass
    if not isinstance(acc, (bool, int)) or (isinstance(acc, int) and acc not in (0, 1)):
        return _Outcome(failure=f"returned acc={acc!r} ({type(acc).__name__}), expected a bool")  # NaN would count as correct
    extra = {str(k): _plain(v) for k, v in result.items() if k not in ("score", "acc", "pred")}
    return _Outcome(score=score, acc=bool(acc), pred=result.get("pred"), extra=extra or None)


def _plain(value):
    """A torch or numpy scalar as the Python number it holds (logged and dumped as one); a string, number, bool
    or None as is; anything else as its text (the in-flight checkpoint stores only plain values)."""
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy":
        try:
            value = value.item()
        except (ValueError, RuntimeError, AttributeError):
            pass
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def _call_checked(score_fn: ScoreFn, solution: str, ground_truth: object, row_info: dict | None = None) -> _Outcome:
    """`row_info` (data_source, extra_info) goes to functions that take it (`takes_row_info`)."""
    try:
        result = score_fn(solution, ground_truth) if row_info is None else score_fn(solution, ground_truth, **row_info)
    except Exception as exc:
        return _Outcome(failure=f"raised {type(exc).__name__}: {exc}", detail=traceback.format_exc())
    return _check_result(result)


# ---------------------------------------------------------------------------------------------
# Worker processes.


def _worker_main(conn, score_fn: ScoreFn) -> None:
    """Worker loop: receive (row, solution, ground_truth, row_info), send back (row, _Outcome); None stops it."""
    # Ctrl-C goes to the whole process group; the parent decides, the workers must not die noisily.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn.send("ready")  # score_fn is unpickled (its module imported): the call clock may start
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        row, solution, ground_truth, row_info = task
        outcome = _call_checked(score_fn, solution, ground_truth, row_info)
        try:
            conn.send((row, outcome))
        except Exception as exc:  # e.g. a pred that cannot be pickled
            conn.send(
                (row, _Outcome(failure=f"returned an unpicklable result ({type(exc).__name__}: {exc})"))
            )


class _Worker:
    def __init__(self, ctx, score_fn: ScoreFn):
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker_main, args=(child_conn, score_fn), daemon=True, name="reward-worker"
        )
        self.process.start()
        child_conn.close()

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the worker has imported score_fn, so start-up never counts as call time."""
        try:
            if self.conn.poll(timeout_s) and self.conn.recv() == "ready":
                return
            problem = f"did not start within {timeout_s:g} s"
        except (EOFError, OSError):
            self.process.join(timeout=5.0)
            problem = (
                f"exited during start-up (exit code {self.process.exitcode}); "
                "can the score_fn's module be imported in a fresh process?"
            )
        self.kill()
        raise RuntimeError(f"reward worker process {problem}")

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5.0)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(timeout=1.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5.0)
        self.conn.close()


def _stop_workers(workers: list[_Worker | None]) -> None:
    for i, worker in enumerate(workers):
        if worker is not None:
            worker.stop()
            workers[i] = None


# ---------------------------------------------------------------------------------------------


class RewardManager:
    """Scores batches with ``score_fn`` (see the module docstring for failures and execution).

    Overlong shaping (DAPO): when ``overlong_buffer_enable``, every row's reward gets
    ``overlong_penalty(L, max_response_length, overlong_buffer_len, overlong_penalty_factor)``,
    which falls linearly from 0 at ``L = max - buffer`` to ``-factor`` at ``L = max``.
    """

    def __init__(
        self,
        score_fn: ScoreFn,
        *,
        max_response_length: int,
        overlong_buffer_enable: bool = False,
        overlong_buffer_len: int = 0,
        overlong_penalty_factor: float = 1.0,
        on_error: str = "raise",
        error_score: float = -1.0,
        timeout_s: float = 10.0,
        num_workers: int = 1,
        start_method: str = "forkserver",
    ):
        if not callable(score_fn):
            raise TypeError(f"score_fn must be callable, got {type(score_fn).__name__}")
        if isinstance(max_response_length, bool) or not isinstance(max_response_length, int):
            raise TypeError(f"max_response_length must be an int, got {max_response_length!r}")
        if max_response_length <= 0:
            raise ValueError(f"max_response_length must be > 0, got {max_response_length}")
        if overlong_buffer_enable and not (
            isinstance(overlong_buffer_len, int) and 0 < overlong_buffer_len <= max_response_length
        ):
            raise ValueError(
                f"overlong_buffer_len must be an int in (0, max_response_length={max_response_length}] "
                f"when overlong_buffer_enable is set, got {overlong_buffer_len!r}"
            )
        if not (math.isfinite(overlong_penalty_factor) and overlong_penalty_factor >= 0):
            raise ValueError(
                f"overlong_penalty_factor must be finite and >= 0, got {overlong_penalty_factor}"
            )
        if on_error not in _ON_ERROR_MODES:
            raise ValueError(f"on_error must be one of {list(_ON_ERROR_MODES)}, got {on_error!r}")
        if not math.isfinite(error_score):
            raise ValueError(f"error_score must be finite, got {error_score}")
        if not math.isfinite(timeout_s):
            raise ValueError(f"timeout_s must be finite (<= 0 runs inline), got {timeout_s}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if start_method not in _START_METHODS or start_method not in multiprocessing.get_all_start_methods():
            raise ValueError(
                f"start_method must be one of {multiprocessing.get_all_start_methods()}, got {start_method!r}"
            )
        if timeout_s > 0:
            try:
                pickle.dumps(score_fn)
            except Exception as exc:
                raise TypeError(
                    f"score_fn {getattr(score_fn, '__qualname__', score_fn)!r} cannot be pickled "
                    f"({type(exc).__name__}: {exc}); with timeout_s > 0 it runs in worker processes, so "
                    "it must be a module-level function or a functools.partial of one "
                    "(or pass timeout_s=0 to run it inline, without a timeout)"
                ) from exc

        self.score_fn = score_fn
        self.max_response_length = max_response_length
        self.overlong_buffer_enable = bool(overlong_buffer_enable)
        self.overlong_buffer_len = overlong_buffer_len
        self.overlong_penalty_factor = float(overlong_penalty_factor)
        self.on_error = on_error
        self.error_score = float(error_score)
        self.timeout_s = float(timeout_s)
        self.num_workers = num_workers
        self.start_method = start_method
        self._closed = False
        self._ctx = None
        # Slots of the worker pool (None: not started, or killed and not yet replaced). The
        # finalizer holds the same list, so workers are stopped even if close() is never called.
        self._workers: list[_Worker | None] = [None] * num_workers
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the worker processes. Idempotent; the manager cannot score afterwards."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- scoring ---------------------------------------------------------------------------------

    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence,
        response_lengths: Sequence[int] | torch.Tensor,
        *,
        data_sources: Sequence[str] | None = None,
        extra_infos: Sequence[Mapping] | None = None,
    ) -> RewardOutput:
        """Score B decoded responses; ``response_lengths`` are their lengths in tokens. A function that
        takes them (``takes_row_info``, e.g. a custom one) also gets each row's data_source and extra_info."""
        if self._closed:
            raise RuntimeError("RewardManager.score called after close()")
        batch = len(responses)
        if len(ground_truths) != batch:
            raise ValueError(f"ground_truths has {len(ground_truths)} entries, responses has {batch}")
        if data_sources is not None and len(data_sources) != batch:
            raise ValueError(f"data_sources has {len(data_sources)} entries, responses has {batch}")
        for row, response in enumerate(responses):
            if not isinstance(response, str):
                raise TypeError(f"responses[{row}] must be a str, got {type(response).__name__}")
        if extra_infos is not None and len(extra_infos) != batch:
            raise ValueError(f"extra_infos has {len(extra_infos)} entries, responses has {batch}")
        lengths = self._checked_lengths(response_lengths, batch)
        row_infos = [None] * batch
        if getattr(self.score_fn, "takes_row_info", False):
            row_infos = [{"data_source": data_sources[row] if data_sources is not None else None,
                          "extra_info": dict(extra_infos[row]) if extra_infos is not None else {}}
                         for row in range(batch)]

        if self.timeout_s > 0:
            outcomes = self._score_in_workers(responses, ground_truths, row_infos)
        else:
            outcomes = [
                self._settle(row, truth, _call_checked(self.score_fn, response, truth, info))
                for row, (response, truth, info) in enumerate(zip(responses, ground_truths, row_infos, strict=True))
            ]

        failed = [row for row, outcome in enumerate(outcomes) if outcome.failure is not None]
        messages = [self._failure_message(row, ground_truths[row], outcomes[row]) for row in failed]
        for message in messages[:_MAX_ERROR_MESSAGES]:
            logger.warning("%s; scored %s", message, self.error_score)
        if len(messages) > _MAX_ERROR_MESSAGES:
            logger.warning(
                "%d more reward failures in this batch not shown", len(messages) - _MAX_ERROR_MESSAGES
            )

        scores = [self.error_score if o.failure is not None else o.score for o in outcomes]
        score_t = torch.tensor(scores, dtype=torch.float32)
        lengths_t = torch.tensor(lengths, dtype=torch.int64)
        if self.overlong_buffer_enable:
            overlong_t = overlong_penalty(
                lengths_t,
                max_response_length=self.max_response_length,
                overlong_buffer_len=self.overlong_buffer_len,
                penalty_factor=self.overlong_penalty_factor,
            ).to(torch.float32)
        else:
            overlong_t = torch.zeros(batch, dtype=torch.float32)
        reward_t = score_t + overlong_t
        if not torch.isfinite(reward_t).all():  # cannot happen after the checks; never pass a NaN on
            raise RewardError(f"non-finite rewards {reward_t.tolist()} after scoring")

        extra: dict[str, list] = {
            "score": scores,
            "acc": [o.failure is None and o.acc for o in outcomes],
            "pred": [o.pred for o in outcomes],
            "overlong_reward": overlong_t.tolist(),
            "overlong": [length >= self.max_response_length for length in lengths],
            "error": [o.failure is not None for o in outcomes],
            "reward_extra": [dict(o.extra or {}) for o in outcomes],
        }
        if data_sources is not None:
            extra["data_source"] = list(data_sources)
        return RewardOutput(
            reward=reward_t,
            score=score_t,
            extra=extra,
            num_errors=len(failed),
            error_messages=messages[:_MAX_ERROR_MESSAGES],
        )

    def _checked_lengths(self, response_lengths, batch: int) -> list[int]:
        if isinstance(response_lengths, torch.Tensor):
            if response_lengths.dim() != 1 or response_lengths.is_floating_point():
                raise ValueError(
                    f"response_lengths must be a 1-D integer tensor, got shape {tuple(response_lengths.shape)} "
                    f"dtype {response_lengths.dtype}"
                )
            response_lengths = response_lengths.tolist()
        if len(response_lengths) != batch:
            raise ValueError(f"response_lengths has {len(response_lengths)} entries, responses has {batch}")
        for row, length in enumerate(response_lengths):
            if isinstance(length, bool) or not isinstance(length, numbers.Integral):
                raise TypeError(f"response_lengths[{row}] must be an int, got {length!r}")
            if not 0 <= length <= self.max_response_length:
                raise ValueError(
                    f"response_lengths[{row}] = {length} is outside [0, max_response_length="
                    f"{self.max_response_length}]"
                )
        return [int(length) for length in response_lengths]

    def _failure_message(self, row: int, ground_truth: object, outcome: _Outcome) -> str:
        return f"reward function failed on row {row} (ground truth {ground_truth!r}): it {outcome.failure}"

    def _settle(self, row: int, ground_truth: object, outcome: _Outcome) -> _Outcome:
        """Apply on_error="raise" to one finished call (penalize is applied on the whole batch)."""
        if outcome.failure is not None and self.on_error == "raise":
            message = self._failure_message(row, ground_truth, outcome)
            if outcome.detail:
                message += "\n" + outcome.detail.rstrip()
            raise RewardError(message)
        return outcome

    # -- the worker pool ---------------------------------------------------------------------------

    def _context(self):
        if self._ctx is None:
            self._ctx = multiprocessing.get_context(self.start_method)
            if self.start_method == "forkserver":
                # Only takes effect if the server is not running yet: it then imports torch and
                # this module once, and every worker forks from it ready to go.
                self._ctx.set_forkserver_preload([__name__])
        return self._ctx

    def _ensure_workers(self, slots) -> None:
        """Fill the given empty slots and replace their dead workers, starting them in parallel."""
        started = []
        for slot in slots:
            worker = self._workers[slot]
            if worker is not None and not worker.process.is_alive():
                self._kill_slot(slot)
            if self._workers[slot] is None:
                self._workers[slot] = _Worker(self._context(), self.score_fn)
                started.append(slot)
        try:
            for slot in started:
                self._workers[slot].wait_ready(_WORKER_START_TIMEOUT_S)
        except RuntimeError:
            for slot in started:
                self._kill_slot(slot)
            raise

    def _kill_slot(self, slot: int) -> None:
        worker = self._workers[slot]
        if worker is not None:
            worker.kill()
            self._workers[slot] = None

    @staticmethod
    def _has_room(rows: deque, row: int, sizes: Sequence[int]) -> bool:
        """Whether `row` may join a worker's queue: always when it is empty, else while the queue stays
        within _WINDOW rows and _WINDOW_CHARS characters (the bytes sent ahead must fit the pipe's buffer,
        or a send would block the loop that enforces the timeouts). sizes: each row's characters."""
        if not rows:
            return True
        return len(rows) < _WINDOW and sum(sizes[r] for r in rows) + sizes[row] <= _WINDOW_CHARS

    def _score_in_workers(self, responses: Sequence[str], ground_truths: Sequence,
                          row_infos: Sequence[dict | None]) -> list[_Outcome]:
        """Each worker holds up to _WINDOW rows at a time, sent ahead and answered in order, so a batch
        costs one pipe round trip per window rather than per row. The clock of a worker's head row
        starts when the row before it answered (or when it was sent): a call that overruns timeout_s
        has its worker killed, and the rows queued behind it (never started) go back to the front."""
        outcomes: list[_Outcome | None] = [None] * len(responses)
        sizes = [len(text) + _ROW_OVERHEAD_CHARS + (len(repr(info)) if info else 0)
                 for text, info in zip(responses, row_infos, strict=True)]
        pending = deque(range(len(responses)))
        flight: dict[int, deque] = {slot: deque() for slot in range(self.num_workers)}  # rows sent, in order
        clock: dict[int, float] = {}  # slot -> when its head row's call started (monotonic)

        def requeue(slot: int) -> None:  # the rows behind a failed head never started: back to the front
            flight[slot].popleft()
            pending.extendleft(reversed(flight[slot]))
            flight[slot].clear()
            self._kill_slot(slot)

        try:
            while pending or any(flight.values()):
                if pending:
                    self._ensure_workers([slot for slot in flight if not flight[slot]])
                sent = True
                while pending and sent:  # one row per worker in turn: small batches still spread over workers
                    sent = False
                    for slot, rows in flight.items():
                        if pending and self._has_room(rows, pending[0], sizes):
                            row = pending.popleft()
                            self._workers[slot].conn.send((row, responses[row], ground_truths[row], row_infos[row]))
                            if not rows:
                                clock[slot] = time.monotonic()
                            rows.append(row)
                            sent = True
                busy = [slot for slot in flight if flight[slot]]
                next_deadline = min(clock[slot] for slot in busy) + self.timeout_s
                conns = {self._workers[slot].conn: slot for slot in busy}
                ready = wait_for_connections(list(conns), timeout=max(0.0, next_deadline - time.monotonic()))
                for conn in ready:
                    slot = conns[conn]
                    while flight[slot] and conn.poll(0):
                        row = flight[slot][0]
                        try:
                            reply_row, outcome = conn.recv()
                        except (EOFError, OSError):
                            process = self._workers[slot].process
                            process.join(timeout=5.0)  # the pipe closes a moment before the exit is reaped
                            exitcode = process.exitcode
                            requeue(slot)
                            outcomes[row] = self._settle(row, ground_truths[row], _Outcome(
                                failure=f"killed its worker process (exit code {exitcode})"))
                            break
                        if reply_row != row:  # a worker answers in the order it was sent: a mismatch is a bug
                            raise RuntimeError(f"reward worker answered row {reply_row} while row {row} was due")
                        flight[slot].popleft()
                        clock[slot] = time.monotonic()
                        outcomes[row] = self._settle(row, ground_truths[row], outcome)
                now = time.monotonic()
                expired = [slot for slot in flight if flight[slot] and clock[slot] + self.timeout_s <= now]
                for slot in sorted(expired, key=clock.__getitem__):  # the call that overran first, first
                    row = flight[slot][0]
                    requeue(slot)
                    outcomes[row] = self._settle(row, ground_truths[row],
                                                 _Outcome(failure=f"timed out after {self.timeout_s:g} s"))
        except BaseException:
            # Raising mid-batch (RewardError, Ctrl-C): calls still running would answer into the
            # next batch, so their workers go; the slots are refilled on the next call.
            for slot in flight:
                if flight[slot]:
                    self._kill_slot(slot)
            raise
        return outcomes
