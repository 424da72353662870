"""rollout.speculative.auto, its parts: the on / off decision, the throughput meter, and the order in which
the trainer-side wrapper measures, relaunches and syncs (with stand-in parts; the trainer against real
stand-in servers is tests/trainer/test_sglang_autospec.py)."""

import types

import pytest
import torch

from megatron_dapo.rollout.base import PromptInput, RolloutEngineError, SamplingParams
from megatron_dapo.rollout.sglang.autospec import (
    AutoSpeculation,
    SpeculationProbe,
    ThroughputMeter,
    same_sampling,
)

TRAIN = SamplingParams(max_new_tokens=6, n=2, temperature=1.0)


def ticking_clock(step_s: float = 1.0):
    """A clock that advances `step_s` per reading: every generate_batch call lasts step_s (no wall time)."""
    now = [0.0]

    def clock():
        now[0] += step_s
        return now[0]
    return clock


@pytest.mark.parametrize("on, off, kept", [(300.0, 100.0, True), (100.0, 300.0, False), (100.0, 100.0, False)])
def test_the_probe_measures_each_mode_then_keeps_the_faster(on, off, kept):
    probe = SpeculationProbe(steps=2, start_step=3)
    for step in (1, 2):  # before auto_start_step: servers stay as launched, nothing measured
        assert probe.after_step(step, 1000, 1.0) == (None, {"spec_decode/auto/speculative": 1.0})
    assert probe.after_step(3, int(on * 2), 2.0) == (None, {"spec_decode/auto/speculative": 1.0,
                                                            "spec_decode/auto/tokens_per_s": on})
    assert probe.after_step(4, 0, 0.0) == (None, {"spec_decode/auto/speculative": 1.0})  # no rollout: not counted
    assert probe.after_step(5, int(on), 1.0)[0] is False  # two steps with speculation: relaunch without
    assert probe.after_step(6, int(off), 1.0) == (None, {"spec_decode/auto/speculative": 0.0,
                                                         "spec_decode/auto/tokens_per_s": off})
    relaunch, metrics = probe.after_step(7, int(off), 1.0)
    assert relaunch is (True if kept else None) and probe.decided is kept and probe.speculative is kept
    assert metrics == {"spec_decode/auto/speculative": 0.0, "spec_decode/auto/tokens_per_s": off,
                       "spec_decode/auto/tokens_per_s_on": on, "spec_decode/auto/tokens_per_s_off": off,
                       "spec_decode/auto/speedup": on / off, "spec_decode/auto/chosen": float(kept)}
    assert probe.after_step(8, 10, 1.0) == (None, {"spec_decode/auto/speculative": float(kept)})  # decided


class _Engine:
    """generate_batch returns `lengths` responses; everything else is a plain attribute."""

    sglang_version = "0.5.23"

    def __init__(self, lengths):
        self.lengths, self.closed = lengths, False

    def generate_batch(self, prompts, sampling, **kw):
        return types.SimpleNamespace(response_length=torch.tensor(self.lengths))

    def close(self):
        self.closed = True


def test_the_meter_counts_only_the_training_generation_and_forwards_the_rest():
    meter = ThroughputMeter(_Engine([3, 4]), same_sampling(TRAIN), ticking_clock())
    prompt = [PromptInput("p", (1, 2))]
    meter.generate_batch(prompt, SamplingParams(max_new_tokens=6, n=2, seed=9), pad_id=0, max_response_length=6)
    meter.generate_batch(prompt, SamplingParams(max_new_tokens=6, n=4, top_p=0.7), pad_id=0, max_response_length=6)
    tokens, seconds = meter.take()
    assert (tokens, seconds) == (7, 1.0) and meter.take() == (0, 0.0)  # the validation-like call is not counted
    assert meter.sglang_version == "0.5.23"


def test_the_wrapper_syncs_measures_relaunches_and_syncs_again_in_that_order():
    calls = []

    class Rank0:
        engine, servers = _Engine([5, 5]), []

        def resume_memory(self, tags=None):
            calls.append("resume_memory")

    def make_push(on):
        def push(version):
            calls.append(f"push {'on' if on else 'off'} v{version}")
        push.sync = types.SimpleNamespace(close=lambda: calls.append(f"close {'on' if on else 'off'}"))
        calls.append(f"setup {'on' if on else 'off'}")
        return push

    def relaunch(on):
        calls.append(f"relaunch {'on' if on else 'off'}")
        return _Engine([5, 5] if on else [1, 1])  # the speculative servers make more tokens in the same time

    rank0 = Rank0()
    old = rank0.engine
    auto = AutoSpeculation(SpeculationProbe(steps=1), pgs=types.SimpleNamespace(rank=0, world_size=1), engine=rank0,
                           counted=same_sampling(TRAIN), make_push=make_push, relaunch=relaunch, clock=ticking_clock())
    prompt, gen = [PromptInput("p", (1,))], dict(pad_id=0, max_response_length=6)
    assert auto(0) == {}  # the sync at start: nothing measured
    for step in (1, 2, 3):
        rank0.engine.generate_batch(prompt, TRAIN, **gen)
        metrics = auto(step)
        assert metrics["spec_decode/auto/speculative"] == (0.0 if step == 2 else 1.0), step
        if step < 3:  # 10 tokens per second with speculation, 2 without
            assert metrics["spec_decode/auto/tokens_per_s"] == (2.0 if step == 2 else 10.0)
    # Step 1 ran with speculation: the servers are relaunched without it before its sync; step 2 ran
    # without and was slower (2 tokens against 10): relaunched with it before its sync; step 3 keeps them.
    assert calls == ["setup on", "push on v0",
                     "resume_memory", "close on", "relaunch off", "setup off", "push off v1",
                     "resume_memory", "close off", "relaunch on", "setup on", "push on v2",
                     "push on v3"]
    assert old.closed and auto.probe.decided is True and auto.sync is not None


def test_a_failed_relaunch_is_a_named_error():
    class Rank0:
        engine, servers = _Engine([5]), []

        def resume_memory(self, tags=None):
            pass

    def make_push(on):
        push = lambda version: None  # noqa: E731
        push.sync = types.SimpleNamespace(close=lambda: None)
        return push

    def relaunch(on):
        raise RuntimeError("SGLang server for http://x exited with code 1")

    rank0 = Rank0()
    auto = AutoSpeculation(SpeculationProbe(steps=1), pgs=types.SimpleNamespace(rank=0, world_size=1), engine=rank0,
                           counted=same_sampling(TRAIN), make_push=make_push, relaunch=relaunch)
    auto(0)
    rank0.engine.generate_batch([PromptInput("p", (1,))], TRAIN, pad_id=0, max_response_length=6)
    with pytest.raises(RolloutEngineError, match=r"relaunching the SGLang servers without speculation failed on rank "
                                                 r"0: RuntimeError: SGLang server for http://x exited"):
        auto(1)
