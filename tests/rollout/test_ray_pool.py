"""The engine pool on Ray: order, least-outstanding dispatch, restarts, exactly-once answers.

Invariants:
- the pool keeps the RolloutEngine ordering contract and returns exactly the samples one engine
  would (samples are seeded per sample, so which engine answered does not matter);
- an engine killed mid-generation is restarted (weights and version replayed) and its unfinished
  requests are answered once by the live engines; past max_restarts the pool goes on without it,
  and with no engine left it raises;
- bad input fails before any request is dispatched; an engine that raises fails the call by name.

Two kinds of engines: `ToyEngine`, a model-free deterministic engine (sample = function of its
derived seed) that makes the pool's bookkeeping cheap to test, and the real LocalEngine on a tiny
Megatron model built inside each actor (`LocalEngineFactory`).
"""

import os
import threading
import time
from dataclasses import dataclass

import pytest
import torch

ray = pytest.importorskip("ray")

from megatron_dapo.rollout.base import (  # noqa: E402
    PromptInput,
    RolloutEngine,
    RolloutEngineError,
    Sample,
    SamplingParams,
    check_generate_inputs,
    derive_sample_seed,
)
from megatron_dapo.rollout.ray_pool import EnginePool, LocalEngineFactory, pick_engine  # noqa: E402

VOCAB, PAD, EOS = 16, 0, 1


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance. Its 2 GPUs are logical: the placement-group path runs here with toy
    engines, which never touch CUDA."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def prompts(count: int, length: int = 3) -> list[PromptInput]:
    return [PromptInput(f"q{i}", tuple(2 + (i + k) % (VOCAB - 2) for k in range(length))) for i in range(count)]


def wait_for(condition, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.01)


def kill_mid_call(pool: EnginePool, engine: int, batch, sampling) -> list[Sample]:
    """Run pool.generate in a thread; once requests flow and `engine` holds two requests (one
    running, one queued behind it for at least the engine's delay), kill its actor."""
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("samples", pool.generate(batch, sampling)))
    worker.start()
    wait_for(lambda: sum(pool.stats.requests_answered) >= 1 and pool.outstanding()[engine] == 2)
    ray.kill(pool.actor(engine))
    worker.join()
    return result["samples"]


# ----------------------------------------------------------------------------- the toy engine


def toy_sample(p: PromptInput, j: int, sampling: SamplingParams, version: int, aborted: bool = False) -> Sample:
    """Sample j of p: a pure function of derive_sample_seed (what a seeded engine guarantees)."""
    if aborted:
        return Sample(prompt_id=p.prompt_id, sample_index=j, prompt_token_ids=p.token_ids, response_token_ids=(),
                      rollout_log_probs=(), finish_reason="abort", policy_version=version)
    seed = derive_sample_seed(sampling.seed, p.prompt_id, j)
    n = 1 + seed % sampling.max_new_tokens
    return Sample(prompt_id=p.prompt_id, sample_index=j, prompt_token_ids=p.token_ids,
                  response_token_ids=tuple(2 + (seed >> (3 * k)) % 13 for k in range(n)),
                  rollout_log_probs=tuple(-0.1 * (k + 1) for k in range(n)),
                  finish_reason="length" if n == sampling.max_new_tokens else "stop", policy_version=version)


class ToyEngine(RolloutEngine):
    """Model-free: `delay_s` per call, 30 s for prompts named "slow*" (an abort cuts either short),
    one call at a time; update_weights keeps the sum of each tensor by name."""

    max_sequence_length = 16
    vocab_size = VOCAB

    def __init__(self, delay_s: float):
        self.delay_s, self.version, self.weights = delay_s, 0, {}
        self._lock, self._abort = threading.Lock(), threading.Event()

    def generate(self, prompts, sampling):
        check_generate_inputs(prompts, sampling)
        if any(p.prompt_id == "boom" for p in prompts):
            raise ValueError("toy engine: prompt 'boom' is poisoned")
        aborted = self._abort
        with self._lock:
            aborted.wait(30.0 if any(p.prompt_id.startswith("slow") for p in prompts) else self.delay_s)
            return [toy_sample(p, j, sampling, self.version, aborted.is_set()) for p in prompts for j in range(sampling.n)]

    def update_weights(self, named_tensors=None, *, policy_version, **kwargs):
        if policy_version < self.version:
            raise ValueError(f"policy_version {policy_version} < {self.version}")
        for name, t in named_tensors or []:
            self.weights[name] = float(t.sum())
        self.version = policy_version

    @property
    def policy_version(self):
        return self.version

    def abort(self):
        old, self._abort = self._abort, threading.Event()
        old.set()

    def release_memory(self):
        pass

    def resume_memory(self):
        pass

    def health(self):
        return {"healthy": True, "policy_version": self.version, "weights": dict(self.weights), "pid": os.getpid()}


@dataclass(frozen=True)
class ToyFactory:
    delay_s: float = 0.0

    def __call__(self):
        return ToyEngine(self.delay_s)


def toy_pool(**kwargs) -> EnginePool:
    kwargs.setdefault("num_cpus_per_engine", 0.5)
    return EnginePool(ToyFactory(kwargs.pop("delay_s", 0.0)), num_engines=kwargs.pop("num_engines", 2), **kwargs)


# ------------------------------------------------------------------------------------- tests


def test_pick_engine_takes_the_least_outstanding_available_engine_below_the_cap():
    assert pick_engine([2, 0, 1], [True, True, True], max_inflight=4) == 1
    assert pick_engine([1, 1, 1], [True, True, True], max_inflight=4) == 0  # ties: lowest index
    assert pick_engine([3, 0, 1], [True, False, True], max_inflight=4) == 2  # dead / warming skipped
    assert pick_engine([2, 2], [True, True], max_inflight=2) is None  # every engine at the cap
    assert pick_engine([0, 0], [False, False], max_inflight=2) is None


@pytest.fixture(scope="module")
def shared_toy_pool(ray_cluster):
    """Two toy engines, two prompts per request, one request in flight per engine."""
    pool = toy_pool(delay_s=0.05, prompts_per_request=2, max_inflight_per_engine=1)
    yield pool
    pool.close()


def test_pool_returns_the_contract_order_and_the_single_engine_samples(shared_toy_pool):
    pool = shared_toy_pool
    sent, answered = pool.stats.requests_sent, pool.stats.requests_answered
    batch, sampling = prompts(9), SamplingParams(max_new_tokens=5, n=3, seed=7)
    samples = pool.generate(batch, sampling)
    assert samples == [toy_sample(p, j, sampling, 0) for p in batch for j in range(3)]
    stats = pool.stats
    assert stats.requests_sent - sent == 5 and sum(stats.requests_answered) - sum(answered) == 5  # ceil(9 / 2)
    assert all(now > before for now, before in zip(stats.requests_answered, answered))  # both engines worked
    assert stats.resubmitted == 0 and stats.restarts == (0, 0)
    assert pool.generate([], sampling) == []
    health = pool.health()
    assert health["healthy"] and len({e["pid"] for e in health["engines"]}) == 2


def test_bad_input_and_engine_errors_fail_before_dispatch_or_by_name(shared_toy_pool):
    pool = shared_toy_pool
    sent = pool.stats.requests_sent
    sampling = SamplingParams(max_new_tokens=4, seed=1)
    with pytest.raises(ValueError, match=r"prompt 'long': 13 prompt tokens \+ max_new_tokens=4 = 17 > the "
                                         r"engines' max_sequence_length=16"):
        pool.generate([PromptInput("ok", (2,)), PromptInput("long", (3,) * 13)], sampling)
    with pytest.raises(ValueError, match=rf"prompt 'v': token id {VOCAB} is outside the engines' vocabulary"):
        pool.generate([PromptInput("v", (2, VOCAB))], sampling)
    with pytest.raises(ValueError, match=r"prompts\[1\]\.prompt_id 'a' is repeated"):
        pool.generate([PromptInput("a", (2,)), PromptInput("a", (3,))], sampling)
    with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
        pool.generate(prompts(1), {"max_new_tokens": 4})
    assert pool.stats.requests_sent == sent
    with pytest.raises(RolloutEngineError, match=r"failed request 1 \(prompts \['boom', 'x'\]\): "
                                                 r"ValueError: toy engine: prompt 'boom' is poisoned"):
        pool.generate([PromptInput("fine", (2,)), PromptInput("ok", (2,)), PromptInput("boom", (2,)),
                       PromptInput("x", (2,))], sampling)
    with pytest.raises(ValueError, match="policy_version must be an int >= 0"):
        pool.update_weights(None, policy_version=-1)
    with pytest.raises(ValueError, match="one factory needs num_engines"):
        EnginePool(ToyFactory())
    with pytest.raises(ValueError, match="max_restarts must be an int >= 0"):
        EnginePool(ToyFactory(), num_engines=1, max_restarts=-1)


def test_abort_answers_every_row_and_unfinished_ones_as_abort(shared_toy_pool):
    pool = shared_toy_pool
    batch, sampling = [PromptInput(f"slow{i}", (2, 3)) for i in range(5)], SamplingParams(max_new_tokens=4, n=2)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("samples", pool.generate(batch, sampling)))
    worker.start()
    wait_for(lambda: pool.outstanding() == [1, 1])
    start = time.monotonic()
    pool.abort()
    worker.join()
    assert time.monotonic() - start < 10  # far below the 30 s a slow request takes
    samples = result["samples"]
    assert [(s.prompt_id, s.sample_index) for s in samples] == [(p.prompt_id, j) for p in batch for j in range(2)]
    assert {s.finish_reason for s in samples} == {"abort"} and all(not s.response_token_ids for s in samples)
    # the pool works normally after an abort
    assert pool.generate(prompts(2), SamplingParams(max_new_tokens=3, seed=2))[0].finish_reason != "abort"


@pytest.mark.slow
def test_killed_toy_engine_restarts_in_its_bundle_with_replayed_weights_and_answers_once(ray_cluster):
    if ray.cluster_resources().get("GPU", 0) < 2:
        pytest.skip("needs a Ray instance with 2 (logical) GPUs")
    pool = toy_pool(delay_s=0.3, max_inflight_per_engine=2, max_restarts=1, use_gpu=True, num_gpus_per_engine=1,
                    start_timeout_s=60)
    try:
        gpus = [e["gpu_ids"] for e in pool.health()["engines"]]
        assert all(len(g) == 1 for g in gpus) and gpus[0] != gpus[1]  # one bundle (GPU) per engine
        # Two buckets; the second supersedes "a", so the replay must apply them in order.
        pool.update_weights([("a", torch.ones(3)), ("b", torch.full((2,), 2.0))], policy_version=1)
        pool.update_weights([("a", torch.full((3,), 5.0))], policy_version=2)
        batch, sampling = prompts(10), SamplingParams(max_new_tokens=6, n=2, seed=9)
        samples = kill_mid_call(pool, 0, batch, sampling)
        assert samples == [toy_sample(p, j, sampling, 2) for p in batch for j in range(2)]
        stats = pool.stats
        assert stats.restarts == (1, 0) and stats.resubmitted >= 1
        assert sum(stats.requests_answered) == 10 and stats.requests_sent == 10 + stats.resubmitted
        pool.wait_ready()
        restarted = pool.health()["engines"][0]
        assert restarted["healthy"] and restarted["policy_version"] == 2 and restarted["gpu_ids"] == gpus[0]
        assert restarted["weights"] == {"a": 15.0, "b": 4.0}
    finally:
        pool.close()


@pytest.mark.slow
def test_engines_past_max_restarts_are_given_up_and_no_engine_left_raises(ray_cluster):
    pool = toy_pool(delay_s=0.3, max_inflight_per_engine=2, max_restarts=0)
    try:
        batch, sampling = prompts(10), SamplingParams(max_new_tokens=6, n=2, seed=9)
        samples = kill_mid_call(pool, 0, batch, sampling)  # engine 1 answers everything
        assert samples == [toy_sample(p, j, sampling, 0) for p in batch for j in range(2)]
        assert pool.stats.dead == (True, False) and pool.stats.restarts == (0, 0)
        assert not pool.health()["healthy"]
        ray.kill(pool.actor(1))
        with pytest.raises(RolloutEngineError, match=r"no engine left .*restarts per engine: \[0, 0\]"):
            pool.generate(batch, sampling)
        assert pool.stats.dead == (True, True)
    finally:
        pool.close()


# ---------------------------------------------------------------------- the real local engine


class DelayedEngine(RolloutEngine):
    """A LocalEngine whose calls take at least `delay_s` (one at a time), so a kill can land mid-call."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s, self._lock = inner, delay_s, threading.Lock()
        self.max_sequence_length, self.vocab_size = inner.max_sequence_length, inner.vocab_size

    def generate(self, prompts, sampling):
        with self._lock:
            time.sleep(self.delay_s)
            return self.inner.generate(prompts, sampling)

    def update_weights(self, named_tensors=None, *, policy_version, **kwargs):
        self.inner.update_weights(named_tensors, policy_version=policy_version, **kwargs)

    @property
    def policy_version(self):
        return self.inner.policy_version

    def abort(self):
        self.inner.abort()

    def release_memory(self):
        self.inner.release_memory()

    def resume_memory(self):
        self.inner.resume_memory()

    def health(self):
        return self.inner.health()


@dataclass(frozen=True)
class DelayedLocalFactory:
    inner: LocalEngineFactory
    delay_s: float

    def __call__(self):
        return DelayedEngine(self.inner(), self.delay_s)


def tiny_factory(seed: int) -> LocalEngineFactory:
    from megatron_dapo.models.arch import get_arch

    return LocalEngineFactory(get_arch("tiny", vocab_size=VOCAB, max_position_embeddings=64), seed=seed,
                              eos_token_id=EOS, pad_token_id=PAD)


def one_by_one(engine, batch, sampling) -> list[Sample]:
    """The reference: one engine, one prompt per call (the batch shapes the pool's requests have)."""
    return [s for p in batch for s in engine.generate([p], sampling)]


def assert_same_samples(got: list[Sample], want: list[Sample]) -> None:
    assert [(s.prompt_id, s.sample_index, s.response_token_ids, s.finish_reason, s.policy_version) for s in got] == \
           [(s.prompt_id, s.sample_index, s.response_token_ids, s.finish_reason, s.policy_version) for s in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g.rollout_log_probs), torch.tensor(w.rollout_log_probs),
                                   atol=1e-5, rtol=0)


def test_local_engine_killed_mid_generation_every_request_answered_once(ray_cluster):
    """Two LocalEngine actors with identical weights; engine 0 is killed while it holds requests.
    The answers equal one uninterrupted engine's, and the pool restarted engine 0 once."""
    factory = tiny_factory(seed=5)
    pool = EnginePool(DelayedLocalFactory(factory, delay_s=0.5), num_engines=2, num_cpus_per_engine=0.5,
                      max_inflight_per_engine=2)
    try:
        batch, sampling = prompts(8), SamplingParams(max_new_tokens=8, n=2, temperature=1.0, seed=21)
        samples = kill_mid_call(pool, 0, batch, sampling)
        assert_same_samples(samples, one_by_one(factory(), batch, sampling))
        stats = pool.stats
        assert stats.restarts == (1, 0) and stats.resubmitted >= 1 and sum(stats.requests_answered) == 8
        assert sum(len(s.response_token_ids) for s in samples) > len(samples)  # real generations
    finally:
        pool.close()


@pytest.mark.slow
def test_weights_synced_into_the_pool_survive_a_restart(ray_cluster):
    """A sync (several buckets, version 1) from an in-process model with other weights: the pool then
    samples what that model samples, and so does an engine restarted after the sync (replay)."""
    from megatron_dapo.rollout.weight_sync import WeightSyncer

    source = tiny_factory(seed=99)()
    pool = EnginePool(DelayedLocalFactory(tiny_factory(seed=5), delay_s=0.2), num_engines=2,
                      num_cpus_per_engine=0.5, max_inflight_per_engine=1)
    try:
        batch, sampling = prompts(6), SamplingParams(max_new_tokens=6, n=2, temperature=1.0, seed=4)
        stats = WeightSyncer().sync(source.model, [pool], policy_version=1, bucket_mb=0.25)
        assert stats.num_buckets > 1
        source.update_weights(None, policy_version=1)
        want = one_by_one(source, batch, sampling)
        assert_same_samples(pool.generate(batch, sampling), want)
        ray.kill(pool.actor(1))
        assert_same_samples(pool.generate(batch, sampling), want)  # engine 0 answers while 1 restarts
        pool.wait_ready()
        answered_before = pool.stats.requests_answered[1]
        assert_same_samples(pool.generate(batch, sampling), want)
        assert pool.stats.restarts == (0, 1) and pool.stats.requests_answered[1] > answered_before
    finally:
        pool.close()
