"""Stage timers and the timing / throughput metrics derived from them.

The trainer runs every stage under a named timer and reports once per step:

    timer = StageTimer()
    with timer("step"):
        with timer("gen"):
            batch = engine.generate(prompts)
        ...
    metrics.update(compute_timing_metrics(timings_s=timer.timings_s, ...))

Seconds accumulate per name: dynamic sampling calls `gen` several times in one step and the
dashboard wants the total. Times are wall clock (`time.perf_counter`). GPU work is asynchronous,
so a stage that ends without a host sync would be under-timed; pass `synchronize=
torch.cuda.synchronize` to make each timer wait for the device before it reads the clock.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import time
from collections.abc import Callable, Iterator, Mapping

__all__ = [
    "StageTimer",
    "compute_throughout_metrics",
    "compute_throughput_metrics",
    "compute_timing_metrics",
    "timer",
]

# The one stage normalised by response tokens only: generation cost scales with what is decoded,
# every other stage (log-prob forward, update, ...) runs over prompt + response.
_RESPONSE_ONLY_STAGES = frozenset({"gen"})


@contextlib.contextmanager
def timer(
    name: str,
    timings: dict[str, float],
    *,
    synchronize: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[None]:
    """Add the wall-clock seconds spent in the block to `timings[name]` (created at 0.0).

    The time is recorded even when the block raises, so a failed step still shows where it spent
    its time. `clock` returns seconds (tests pass a fake one).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"timer name: expected a non-empty str, got {name!r}")
    if synchronize is not None:
        synchronize()
    start = clock()
    try:
        yield
    finally:
        if synchronize is not None:
            synchronize()
        timings[name] = timings.get(name, 0.0) + (clock() - start)


class StageTimer:
    """Accumulates seconds per stage name across `with stage_timer("name"):` blocks.

    `timings_s` is a copy of the totals so far; `reset()` returns them and starts from zero (call
    it once per step after the metrics are computed).
    """

    def __init__(
        self,
        *,
        synchronize: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._synchronize = synchronize
        self._clock = clock
        self._timings: dict[str, float] = {}

    def __call__(self, name: str) -> contextlib.AbstractContextManager[None]:
        return timer(name, self._timings, synchronize=self._synchronize, clock=self._clock)

    @property
    def timings_s(self) -> dict[str, float]:
        return dict(self._timings)

    def reset(self) -> dict[str, float]:
        out, self._timings = self._timings, {}
        return out


def compute_timing_metrics(
    *, timings_s: Mapping[str, float], num_prompt_tokens: int, num_response_tokens: int
) -> dict[str, float]:
    """`timing_s/<stage>` (seconds) and `timing_per_token_ms/<stage>` for every stage given.

    Per-token time is `seconds * 1000 / tokens`, where tokens is `num_response_tokens` for
    `gen` and `num_prompt_tokens + num_response_tokens` for every other stage (`step`
    included). A per-token entry whose token count is 0 is left out rather than reported as inf.
    """
    for name, count in (
        ("num_prompt_tokens", num_prompt_tokens),
        ("num_response_tokens", num_response_tokens),
    ):
        if not _is_int(count) or count < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {count!r}")
    total_tokens = int(num_prompt_tokens) + int(num_response_tokens)
    metrics: dict[str, float] = {}
    for stage, seconds in timings_s.items():
        seconds = _check_seconds(f"timings_s[{stage!r}]", seconds)
        metrics[f"timing_s/{stage}"] = seconds
        tokens = int(num_response_tokens) if stage in _RESPONSE_ONLY_STAGES else total_tokens
        if tokens > 0:
            metrics[f"timing_per_token_ms/{stage}"] = seconds * 1000.0 / tokens
    return metrics


def compute_throughout_metrics(
    *, total_num_tokens: int, time_per_step_s: float, num_devices: int
) -> dict[str, float]:
    """`perf/total_num_tokens`, `perf/time_per_step` (s) and `perf/throughput`.

    `perf/throughput = total_num_tokens / (time_per_step_s * num_devices)`: tokens per second per
    device, comparable across cluster sizes. (The misspelled name is the DAPO reference's;
    `compute_throughput_metrics` is the same function.)
    """
    if not _is_int(total_num_tokens) or total_num_tokens < 0:
        raise ValueError(f"total_num_tokens: expected an int >= 0, got {total_num_tokens!r}")
    seconds = _check_seconds("time_per_step_s", time_per_step_s)
    if seconds == 0.0:
        raise ValueError("time_per_step_s: expected > 0 (throughput divides by it), got 0.0")
    if not _is_int(num_devices) or num_devices < 1:
        raise ValueError(f"num_devices: expected an int >= 1, got {num_devices!r}")
    return {
        "perf/total_num_tokens": float(total_num_tokens),
        "perf/time_per_step": seconds,
        "perf/throughput": int(total_num_tokens) / (seconds * int(num_devices)),
    }


compute_throughput_metrics = compute_throughout_metrics


def _is_int(value: object) -> bool:
    # numbers.Integral admits numpy integers; bool is an int subclass but never a count.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_seconds(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{name}: expected a finite number of seconds >= 0, got {value!r}")
    return float(value)
