"""Versioned actor -> engine weight sync (in process, the local engine on its own model).

Invariants: after one DAPO update and a sync in several buckets, the engine holds the actor's
weights bit for bit and its rollout log-probs equal the actor's recomputed log-probs (fp32, atol
1e-5); samples carry the new version; the version moves only with the last bucket; versions that
are not strictly newer are refused before any tensor moves.
"""

import pytest
import torch

from megatron_dapo.config import load_config
from megatron_dapo.rollout.base import PromptInput, RolloutEngine, SamplingParams, samples_to_batch
from megatron_dapo.rollout.local_engine import LocalEngine
from megatron_dapo.rollout.sglang.weights import MIB
from megatron_dapo.rollout.weight_sync import WeightSyncer, named_weights, sync_weights

VOCAB, PAD, EOS = 16, 0, 1
PROBE = [PromptInput("p0", (3, 4, 5)), PromptInput("p1", (6, 7, 8, 9)), PromptInput("p2", (2, 9, 4))]
SAMPLING = SamplingParams(max_new_tokens=6, n=2, temperature=1.0, top_p=1.0, seed=5)
BUCKET_MB = 0.25  # the tiny model is ~2 MiB of fp32: several buckets


def cfg():
    overrides = {"actor.ppo_mini_batch_size": 2, "rollout.n": 2, "data.train_batch_size": 2,
                 "data.gen_batch_size": 2, "actor.lr": 1e-2, "actor.lr_warmup_steps": 0}
    return load_config("configs/tiny_cpu.yaml", [f"{k}={v}" for k, v in overrides.items()])


@pytest.fixture(scope="module")
def pgs():
    from megatron_dapo.parallel import init_parallel

    return init_parallel()


def build_engine_model(pgs, seed: int):
    from megatron_dapo.models.builder import build_gpt_model
    from megatron_dapo.models.config_arch import model_arch

    return build_gpt_model(model_arch(cfg(), vocab_size=VOCAB), pgs=pgs, seed=seed)


@pytest.fixture(scope="module")
def updated_actor(pgs):
    """A tiny actor after one DAPO update on a fixed batch (its weights differ from any fresh build)."""
    from megatron_dapo.workers.batch import PolicyBatch
    from megatron_dapo.workers.build import build_actor

    actor = build_actor(cfg(), pgs, vocab_size=VOCAB, pad_id=PAD)
    g = torch.Generator().manual_seed(0)
    B, P, T = 4, 5, 6
    prompt_ids, responses = torch.randint(2, VOCAB, (B, P), generator=g), torch.randint(2, VOCAB, (B, T), generator=g)
    prompt_length, response_length = torch.tensor([5, 3, 4, 5]), torch.tensor([6, 2, 4, 5])
    mask = (torch.arange(T)[None] < response_length[:, None]).float()
    old = actor.compute_log_prob(prompt_ids, prompt_length, responses, response_length).log_probs * mask
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * mask
    actor.update_policy(PolicyBatch(prompt_ids=prompt_ids, prompt_length=prompt_length, responses=responses,
                                    response_length=response_length, response_mask=mask, old_log_probs=old,
                                    advantages=adv, rollout_log_probs=old, index=["a", "a", "b", "b"]))
    return actor


def actor_log_probs(actor, samples):
    batch = samples_to_batch(samples, pad_id=PAD, max_response_length=SAMPLING.max_new_tokens)
    lp = actor.compute_log_prob(batch.prompt_ids, batch.prompt_length, batch.responses, batch.response_length)
    return batch, lp.log_probs * batch.response_mask


class RecordingEngine(RolloutEngine):
    """A LocalEngine whose update_weights calls are recorded (names, version) before being applied."""

    def __init__(self, inner: LocalEngine):
        self.inner, self.calls = inner, []

    def update_weights(self, named_tensors=None, *, policy_version, **kwargs):
        bucket = None if named_tensors is None else list(named_tensors)
        self.calls.append(([n for n, _ in bucket or []], sum(t.numel() * t.element_size() for _, t in bucket or []),
                           policy_version))
        self.inner.update_weights(bucket, policy_version=policy_version, **kwargs)

    def generate(self, prompts, sampling):
        return self.inner.generate(prompts, sampling)

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


def test_synced_engine_holds_actor_weights_and_samples_at_actor_log_probs(pgs, updated_actor):
    engine = LocalEngine(build_engine_model(pgs, seed=777), pgs=pgs, eos_token_id=EOS, pad_token_id=PAD)
    before = engine.generate(PROBE, SAMPLING)
    _, ref_before = actor_log_probs(updated_actor, before)
    gap = (samples_to_batch(before, pad_id=PAD, max_response_length=6).rollout_log_probs - ref_before).abs().max()
    assert gap > 1e-2, "the engine must start from different weights, or the test proves nothing"

    stats = WeightSyncer().sync(updated_actor.policy.chunks, [engine], policy_version=1, bucket_mb=BUCKET_MB)

    actor_weights = dict(named_weights(updated_actor.policy.chunks))
    engine_weights = dict(named_weights(engine.model))
    assert actor_weights.keys() == engine_weights.keys()
    for name, t in actor_weights.items():
        assert torch.equal(engine_weights[name], t), name
    assert stats.num_tensors == len(actor_weights) and stats.policy_version == 1
    assert stats.num_bytes == sum(t.numel() * t.element_size() for t in actor_weights.values())
    assert stats.num_buckets >= stats.num_bytes // int(BUCKET_MB * MIB) > 1

    samples = engine.generate(PROBE, SAMPLING)
    assert {s.policy_version for s in samples} == {1}
    batch, ref = actor_log_probs(updated_actor, samples)
    assert int(batch.response_length.sum()) > len(samples)
    torch.testing.assert_close(batch.rollout_log_probs, ref, atol=1e-5, rtol=0)


def test_version_moves_only_with_the_last_bucket_and_every_tensor_travels_once(pgs, updated_actor):
    engine = RecordingEngine(LocalEngine(build_engine_model(pgs, seed=3), pgs=pgs, eos_token_id=EOS,
                                         pad_token_id=PAD, policy_version=4))
    sync_weights(updated_actor.policy.chunks, [engine], policy_version=9, bucket_mb=BUCKET_MB)
    versions = [v for _, _, v in engine.calls]
    assert len(versions) > 2 and versions[:-1] == [4] * (len(versions) - 1) and versions[-1] == 9
    names = [n for bucket, _, _ in engine.calls for n in bucket]
    assert sorted(names) == sorted(dict(named_weights(updated_actor.policy.chunks)))
    for bucket, nbytes, _ in engine.calls:  # bounded buckets; a bigger tensor travels alone
        assert nbytes <= BUCKET_MB * MIB or len(bucket) == 1
    assert engine.policy_version == 9


def test_stale_or_repeated_versions_are_refused_before_any_tensor_moves(pgs, updated_actor):
    engine = RecordingEngine(LocalEngine(build_engine_model(pgs, seed=3), pgs=pgs, eos_token_id=EOS,
                                         pad_token_id=PAD))
    syncer = WeightSyncer()
    syncer.sync(updated_actor.policy.chunks, [engine], policy_version=2, bucket_mb=64)
    assert [v for _, _, v in engine.calls] == [2]  # one bucket of 64 MiB holds the whole tiny model
    engine.calls.clear()
    for stale in (2, 1, 0):
        with pytest.raises(ValueError, match=r"policy_version must be an int >= 3 .*last synced version is 2"):
            syncer.sync(updated_actor.policy.chunks, [engine], policy_version=stale, bucket_mb=64)
    ahead = RecordingEngine(LocalEngine(build_engine_model(pgs, seed=3), pgs=pgs, eos_token_id=EOS,
                                        pad_token_id=PAD, policy_version=7))
    with pytest.raises(ValueError, match=r"engines\[1\] is at policy_version 7, ahead of .*policy_version=3"):
        syncer.sync(updated_actor.policy.chunks, [engine, ahead], policy_version=3, bucket_mb=64)
    assert engine.calls == [] and ahead.calls == [] and syncer.policy_version == 2
    # the engine itself also refuses to go back
    with pytest.raises(ValueError, match=r"policy_version must be an int >= 2"):
        engine.inner.update_weights(None, policy_version=1)


def test_bad_sync_arguments_are_named(pgs, updated_actor):
    engine = LocalEngine(build_engine_model(pgs, seed=3), pgs=pgs, eos_token_id=EOS, pad_token_id=PAD)
    chunks = updated_actor.policy.chunks
    for bad in (0, -1.0, True):
        with pytest.raises(ValueError, match="bucket_mb must be a number > 0"):
            sync_weights(chunks, [engine], policy_version=1, bucket_mb=bad)
    with pytest.raises(ValueError, match="engines is empty"):
        sync_weights(chunks, [], policy_version=1, bucket_mb=1)
    with pytest.raises(TypeError, match=r"engines\[0\] is a str"):
        sync_weights(chunks, ["x"], policy_version=1, bucket_mb=1)
    with pytest.raises(ValueError, match="takes one model chunk, got 2"):
        sync_weights([chunks[0], chunks[0]], [engine], policy_version=1, bucket_mb=1)
    with pytest.raises(ValueError, match="policy_version must be an int >= 0"):
        WeightSyncer(policy_version=-1)
    assert engine.policy_version == 0
