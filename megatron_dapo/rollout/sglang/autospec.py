"""`rollout.speculative.auto`: measure rollout speed with and without speculative decoding on the first
steps and keep the faster, because speculation can lose (verl measured -50% rollout throughput with
SGLang MTP on H20; others report +1.6x to +1.8x): its gain depends on the acceptance of the drafter,
the batch size per server and the GPU.

SGLang cannot switch speculation on a running server in any supported release: speculation is a launch
setting (--speculative-algorithm builds a draft worker and its KV cache), requests carry no speculative
field, and /set_internal_state accepts only a few scheduler settings (accept thresholds, pp micro-batch
size; read in the 0.5.8-0.5.23 wheels). So the comparison runs the whole fleet one way, then the other:

    steps [start, start + k)        servers as launched (speculative): measure
    after step start + k - 1        relaunch the servers without speculation
    steps [start + k, start + 2k)   measure
    after step start + 2k - 1       keep the faster; relaunch with speculation if that is it

(k = rollout.speculative.auto_steps, start = auto_start_step.) Each mode is measured on real training
steps at the production batch size (speculation typically wins at small batches and loses at large
ones, so halving the fleet per mode would measure the wrong thing), and the measurement is the
training generation only: response tokens over wall seconds of rank 0's generate_batch calls whose
sampling is the training sampling (validation with other settings is left out). Cost: one relaunch when
speculation loses, two when it wins; a relaunch is a server start (weights from disk, CUDA graphs,
the drafter) plus a weight-update group set-up and one sync. Set auto_start_step past the first steps
when the drafter starts fresh (a checkpoint without MTP weights drafts poorly until the actor has
trained its MTP layer; the layer trains in every step whatever the servers run).

`SpeculationProbe` is the decision (pure); `AutoSpeculation` is the weight sync the trainer calls
(`push(version) -> metrics`) wrapping the plain one, relaunching between steps. Metrics, every step:
`spec_decode/auto/speculative` (1 when this step's rollout ran with speculation); probe steps:
`spec_decode/auto/tokens_per_s`; the deciding step: `spec_decode/auto/tokens_per_s_on`,
`spec_decode/auto/tokens_per_s_off` (means over each mode's steps), `spec_decode/auto/speedup` (on / off)
and `spec_decode/auto/chosen` (1 = speculation kept).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from megatron_dapo.rollout.base import PromptInput, RolloutEngineError, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class SpeculationProbe:
    """The on / off comparison (module docstring); the servers start in the speculative mode."""

    steps: int
    """Steps measured in each mode (rollout.speculative.auto_steps)."""
    start_step: int = 1
    """First measured step (rollout.speculative.auto_start_step)."""
    speculative: bool = True
    """The mode the servers run now."""
    decided: bool | None = None
    """None while probing, then the kept mode."""
    on: list[float] = field(default_factory=list)
    off: list[float] = field(default_factory=list)

    def __post_init__(self):
        if self.steps < 1 or self.start_step < 1:
            raise ValueError(f"SpeculationProbe: steps and start_step must be >= 1, got {self.steps}, {self.start_step}")

    def after_step(self, step: int, tokens: int, seconds: float) -> tuple[bool | None, dict[str, float]]:
        """Record step `step`'s rollout (response tokens generated in `seconds`, in the current mode).
        Returns (the mode to relaunch the servers in before the next step, None to keep them; metrics)."""
        metrics = {"spec_decode/auto/speculative": float(self.speculative)}
        if self.decided is not None or step < self.start_step or tokens <= 0 or seconds <= 0:
            return None, metrics  # decided, not started, or no training generation measured this step
        tps = tokens / seconds
        metrics["spec_decode/auto/tokens_per_s"] = tps
        (self.on if self.speculative else self.off).append(tps)
        if self.speculative and len(self.on) == self.steps:
            self.speculative = False
            return False, metrics
        if not self.speculative and len(self.off) == self.steps:
            on, off = sum(self.on) / len(self.on), sum(self.off) / len(self.off)
            self.decided = on > off
            metrics.update({"spec_decode/auto/tokens_per_s_on": on, "spec_decode/auto/tokens_per_s_off": off,
                            "spec_decode/auto/speedup": on / off, "spec_decode/auto/chosen": float(self.decided)})
            log.info("rollout.speculative.auto: %.1f tokens/s with speculation, %.1f without (x%.2f): %s", on, off,
                     on / off, "keeping speculation" if self.decided else "rollout continues without speculation")
            if self.decided:
                self.speculative = True
                return True, metrics
        return None, metrics


class ThroughputMeter:
    """Wraps rank 0's engine: response tokens and wall seconds (`clock`) of the generate_batch and
    generate_batch_streaming calls `counted(sampling)` accepts, until `take()`. Everything else is the
    wrapped engine's."""

    def __init__(self, engine, counted: Callable[[SamplingParams], bool],
                 clock: Callable[[], float] = time.perf_counter):
        self.engine, self.counted, self.clock = engine, counted, clock
        self._lock = threading.Lock()
        self._tokens, self._seconds = 0, 0.0

    def generate_batch(self, prompts: Sequence[PromptInput], sampling: SamplingParams, **kw):
        return self._timed(self.engine.generate_batch, prompts, sampling, **kw)

    def generate_batch_streaming(self, prompts: Sequence[PromptInput], sampling: SamplingParams, **kw):
        return self._timed(self.engine.generate_batch_streaming, prompts, sampling, **kw)

    def _timed(self, call, prompts: Sequence[PromptInput], sampling: SamplingParams, **kw):
        t0 = self.clock()
        batch = call(prompts, sampling, **kw)
        if self.counted(sampling):
            with self._lock:
                self._tokens += int(batch.response_length.sum())
                self._seconds += self.clock() - t0
        return batch

    def take(self) -> tuple[int, float]:
        with self._lock:
            out, self._tokens, self._seconds = (self._tokens, self._seconds), 0, 0.0
        return out

    def __getattr__(self, name: str) -> Any:  # urls, tp_size, sglang_version, weight_update_session, ...
        return getattr(self.engine, name)


def same_sampling(want: SamplingParams) -> Callable[[SamplingParams], bool]:
    """Counts calls sampled as `want` (seeds and stop tokens aside): the training generation."""
    key = (want.n, want.max_new_tokens, want.temperature, want.top_p, want.top_k, want.min_new_tokens)
    return lambda s: (s.n, s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.min_new_tokens) == key


class AutoSpeculation:
    """The trainer's weight sync under rollout.speculative.auto: `self(version)` pushes the weights (the
    plain sync of the current mode) and returns the step's `spec_decode/auto/*` metrics, relaunching the
    servers first when the probe says so. A collective of every trainer rank, like the plain sync.

    make_push(speculative): the plain sync for servers of that mode (a collective: it sets up the
    weight-update groups); relaunch(speculative): on rank 0, stop the servers and start them in that
    mode, returning the new engine (to be wrapped by the meter). engine: the trainer's RankZeroEngine."""

    def __init__(self, probe: SpeculationProbe, *, pgs, engine, counted: Callable[[SamplingParams], bool],
                 make_push: Callable[[bool], Callable[[int], None]], relaunch: Callable[[bool], Any],
                 clock: Callable[[], float] = time.perf_counter):
        self.probe, self.pgs, self.engine, self.counted, self.clock = probe, pgs, engine, counted, clock
        self.make_push, self.relaunch = make_push, relaunch
        if pgs.rank == 0:
            engine.engine = ThroughputMeter(engine.engine, counted, clock)
        self._push = make_push(True)
        self._first = True

    @property
    def sync(self):
        """The current plain sync's SGLangWeightSync (closed by the trainer at the end)."""
        return self._push.sync

    def __call__(self, version: int) -> dict[str, float]:
        if self._first:  # the sync at start (fit's _resume): no rollout to measure yet
            self._first = False
            self._push(version)
            if self.pgs.rank == 0:
                self.engine.engine.take()
            return {}
        decision, metrics = self._decide(version)
        if decision is not None:
            self._switch(decision)
        self._push(version)
        return metrics

    def _decide(self, step: int):
        out = [None]
        if self.pgs.rank == 0:
            out = [self.probe.after_step(step, *self.engine.engine.take())]
        if self.pgs.world_size > 1:  # decided once, on rank 0
            dist.broadcast_object_list(out, src=0, group=self.pgs.ctrl)
        if self.pgs.rank != 0:  # the other ranks' probes follow rank 0's mode
            self.probe.speculative = bool(out[0][1]["spec_decode/auto/speculative"])
        return out[0]

    def _switch(self, speculative: bool) -> None:
        """Servers in the other mode: take their memory back (so the trainer's record of released memory
        holds no stale tags), leave the weight-update groups, relaunch on rank 0, set the sync up again."""
        self.engine.resume_memory()
        self._push.sync.close()
        error = [None]
        if self.pgs.rank == 0:
            try:
                self.engine.engine.engine.close()
                self.engine.engine = ThroughputMeter(self.relaunch(speculative), self.counted, self.clock)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                error = [f"{type(e).__name__}: {e}"]
        if self.pgs.world_size > 1:
            dist.broadcast_object_list(error, src=0, group=self.pgs.ctrl)
        if error[0] is not None:
            raise RolloutEngineError(f"rollout.speculative.auto: relaunching the SGLang servers "
                                     f"{'with' if speculative else 'without'} speculation failed on rank 0: {error[0]}")
        self._push = self.make_push(speculative)
        self.probe.speculative = speculative
