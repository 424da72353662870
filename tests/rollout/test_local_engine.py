"""The local rollout engine: the actor's Megatron model sampling with a KV cache.

Invariants: rollout log-probs equal the actor's recomputed log-probs (the trainer's first-step
ppo_kl = 0), cached == uncached generation, seeded samples independent of batching, EOS / stop /
max_new_tokens / abort semantics, the ordering contract, weight updates, TP=2 == TP=1.

Also a torchrun script: `python -m torch.distributed.run --nproc_per_node 2 <this file> OUT_DIR`
runs the TP=2 half of test_tp2_ranks_agree_and_equal_tp1.
"""

import dataclasses
import os
import pathlib
import subprocess
import sys
import threading

import pytest
import torch

from megatron_dapo.config import load_config
from megatron_dapo.rollout.base import (
    PromptInput,
    RolloutEngineError,
    SamplingParams,
    check_generate_output,
    samples_to_batch,
)
from megatron_dapo.rollout.local_engine import LocalEngine
from megatron_dapo.rollout.sampling import filter_logits, sample_next_tokens
from tests.standin import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
VOCAB, PAD, EOS = 16, 0, 1
# Two prompt lengths interleaved (3, 5, 3, 2, 5): several buckets, order kept in the output.
PROMPTS = [PromptInput("a", (3, 4, 5)), PromptInput("b", (6, 7, 8, 9, 10)), PromptInput("c", (2, 3, 4)),
           PromptInput("d", (5, 6)), PromptInput("e", (11, 12, 13, 14, 15))]
TP_SAMPLING = SamplingParams(max_new_tokens=6, n=2, temperature=1.0, seed=4)


def config_overrides(**extra) -> list[str]:
    base = {"actor.ppo_mini_batch_size": 2, "rollout.n": 2, "data.train_batch_size": 4, "data.gen_batch_size": 4}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def make_actor(pgs, **extra):
    from megatron_dapo.workers.build import build_actor

    return build_actor(load_config("configs/tiny_cpu.yaml", config_overrides(**extra)), pgs,
                       vocab_size=VOCAB, pad_id=PAD)


@pytest.fixture(scope="module")
def pgs():
    from megatron_dapo.parallel import init_parallel

    return init_parallel()


@pytest.fixture(scope="module")
def actor(pgs):
    return make_actor(pgs)


def bare(actor):
    from megatron_dapo.models.forward import unwrap_model

    return unwrap_model(actor.policy.chunks[0])


def engine(model, pgs, **kw):
    kw.setdefault("eos_token_id", EOS)
    return LocalEngine(model, pgs=pgs, pad_token_id=PAD, **kw)


def actor_log_probs(actor, samples, width):
    batch = samples_to_batch(samples, pad_id=PAD, max_response_length=width)
    lp = actor.policy.compute_log_prob(batch.prompt_ids, batch.prompt_length, batch.responses,
                                       batch.response_length).log_probs
    return batch, lp * batch.response_mask


def by_key(samples):
    return {(s.prompt_id, s.sample_index): s for s in samples}


# ------------------------------------------------------------------------------ the invariants


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("use_kv_cache", [True, False])
def test_rollout_log_probs_equal_actor_log_probs(pgs, temperature, use_kv_cache):
    """fp32, same weights, temperature T, top_p 1: the engine's log-probs are the actor's (atol 1e-5)."""
    actor = make_actor(pgs, **{"rollout.temperature": temperature})
    sampling = SamplingParams(max_new_tokens=6, n=2, temperature=temperature, seed=11)
    samples = engine(bare(actor), pgs, use_kv_cache=use_kv_cache).generate(PROMPTS, sampling)
    batch, ref = actor_log_probs(actor, samples, 6)
    assert int(batch.response_length.max()) > 1 and len(set(batch.prompt_length.tolist())) == 3
    torch.testing.assert_close(batch.rollout_log_probs, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", [{"model.mtp_num_layers": 1}, {"model.arch": "tiny_moe"}],
                         ids=["mtp", "moe"])
def test_mtp_and_moe_models_sample_with_the_main_head_at_actor_log_probs(pgs, variant):
    """MTP heads are off while sampling (restored after); MoE routing runs in the cached decode."""
    actor = make_actor(pgs, **variant)
    sampling = SamplingParams(max_new_tokens=5, n=2, temperature=1.0, seed=2)
    samples = engine(bare(actor), pgs).generate(PROMPTS, sampling)
    assert bare(actor).config.mtp_num_layers == variant.get("model.mtp_num_layers")
    batch, ref = actor_log_probs(actor, samples, 5)  # the actor's MTP forward needs mtp_num_layers back
    torch.testing.assert_close(batch.rollout_log_probs, ref, atol=1e-5, rtol=0)
    full = engine(bare(actor), pgs, use_kv_cache=False).generate(PROMPTS, sampling)
    assert [s.response_token_ids for s in full] == [s.response_token_ids for s in samples]


def test_long_generations_keep_actor_log_probs_and_megatron_s_own_cache(pgs, actor, monkeypatch):
    """Past SMALL_KEYS cached keys (48 new tokens): the log-probs are still the actor's, and the keys
    cached after their rotary (_RotatedKeyCache) give the tokens and log-probs of Megatron's own
    cache of un-rotated keys, rotated whole in every step."""
    from megatron_dapo.rollout import generation_attention

    sampling = SamplingParams(max_new_tokens=48, n=2, temperature=1.0, seed=13)
    calls = []
    original = generation_attention._RotatedKeyCache.__call__
    monkeypatch.setattr(generation_attention._RotatedKeyCache, "__call__",
                        lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    samples = engine(bare(actor), pgs, eos_token_id=None).generate(PROMPTS, sampling)
    layers = bare(actor).config.num_layers
    assert len(calls) == layers * (1 + (5 - 2) + 48 - 1)  # every layer in every forward: one batch, prompts of 2-5
    batch, ref = actor_log_probs(actor, samples, 48)
    assert int(batch.response_length.min()) == 48
    torch.testing.assert_close(batch.rollout_log_probs, ref, atol=1e-5, rtol=0)

    monkeypatch.setattr(generation_attention._RotatedKeyCache, "can_wrap", staticmethod(lambda attention: False))
    megatron = engine(bare(actor), pgs, eos_token_id=None).generate(PROMPTS, sampling)
    assert [s.response_token_ids for s in megatron] == [s.response_token_ids for s in samples]
    torch.testing.assert_close(torch.tensor([s.rollout_log_probs for s in megatron]),
                               torch.tensor([s.rollout_log_probs for s in samples]), atol=1e-5, rtol=0)


def test_the_rotated_key_cache_holds_the_keys_rotary_gives_each_position(pgs, actor):
    """After a prefill and three decode steps, layer 0's cache holds rotary(key) at each position:
    recomputed here from the layer's own QKV projection of its inputs and Megatron's apply_rotary_pos_emb."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    model = bare(actor)
    eng = engine(model, pgs, eos_token_id=None)
    layer = model.decoder.layers[0]
    seen = {}
    hook = layer.self_attention.register_forward_pre_hook(
        lambda m, args, kwargs: seen.setdefault("x", []).append(args[0].detach().clone()), with_kwargs=True)
    try:
        prompt = torch.tensor([[3, 4, 5, 6, 7]])
        with eng._generation_mode():
            ctx = StaticInferenceContext(max_batch_size=1, max_sequence_length=9)
            model(prompt, eng._positions(0, 1, 5), None, inference_context=ctx, runtime_gather_output=True)
            ctx.increment_sequence_len_offset(5)
            ctx.enable_decode_mode()
            for t in (8, 9, 10):
                model(torch.tensor([[t]]), eng._positions(ctx.sequence_len_offset, 1, 1), None,
                      inference_context=ctx, runtime_gather_output=True)
                ctx.increment_sequence_len_offset(1)
            x = torch.cat(seen["x"])                               # [8, 1, hidden]: layer 0's input
            _, key, _ = layer.self_attention.get_query_key_value_tensors(x)
            freqs = model.rotary_pos_emb(9)[:8]
            want = apply_rotary_pos_emb(key, freqs, config=model.config)
    finally:
        hook.remove()
    cached = ctx.key_value_memory_dict[layer.self_attention.layer_number][0][:8]
    torch.testing.assert_close(cached, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(cached, key, atol=1e-3)  # the rotation did move the keys


@pytest.mark.parametrize("sq,sk", [(1, 7), (1, 40), (6, 6), (36, 36)])
def test_generation_attention_paths_equal_megatron_core_attention(pgs, actor, sq, sk):
    """Both paths of the generation's core attention (two matmuls per group for a decode step at any
    number of keys and for forwards up to SMALL_KEYS positions, SDPA for longer forwards) against
    Megatron's own DotProductAttention: a decode step (sq = 1) and a causal forward."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dapo.rollout.generation_attention import _SdpaCoreAttention

    core = bare(actor).decoder.layers[0].self_attention.core_attention
    heads, groups, hn = core.num_attention_heads_per_partition, core.num_query_groups_per_partition, core.hidden_size_per_attention_head
    assert heads > groups  # GQA: a group's heads share one K/V
    g = torch.Generator().manual_seed(sq * 100 + sk)
    b = 3
    q, k, v = (torch.randn(n, b, h, hn, generator=g) for n, h in ((sq, heads), (sk, groups), (sk, groups)))
    mask = None if sq == 1 else torch.ones(1, 1, sq, sk, dtype=torch.bool).triu(1)  # True = masked
    with torch.no_grad():
        want = core(q, k, v, mask, attn_mask_type=AttnMaskType.no_mask if sq == 1 else AttnMaskType.causal)
        got = _SdpaCoreAttention(core)(q, k, v, None)
    assert got.shape == (sq, b, heads * hn)
    torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-5, atol=1e-5)


def test_kv_cache_and_full_forward_sample_identical_tokens(pgs, actor):
    for sampling in (SamplingParams(max_new_tokens=8, n=1, temperature=0.0),
                     SamplingParams(max_new_tokens=8, n=3, temperature=1.0, top_k=5, top_p=0.9, seed=3)):
        cached = engine(bare(actor), pgs).generate(PROMPTS, sampling)
        full = engine(bare(actor), pgs, use_kv_cache=False).generate(PROMPTS, sampling)
        assert [s.response_token_ids for s in cached] == [s.response_token_ids for s in full]
        assert [s.finish_reason for s in cached] == [s.finish_reason for s in full]
        for c, f in zip(cached, full):
            torch.testing.assert_close(torch.tensor(c.rollout_log_probs), torch.tensor(f.rollout_log_probs),
                                       atol=1e-5, rtol=0)


def test_prefill_runs_once_per_distinct_prefix_and_copies_the_cache_rows(pgs, actor):
    """Rows whose prefill tokens agree (a prompt's n samples) share one prefill row: every row's cache and
    last-position logits equal those of a prefill of that row alone, and the forward saw 3 rows, not 5."""
    from megatron_dapo.rollout.local_engine import _CachedStepper

    e = engine(bare(actor), pgs)
    prompt = torch.tensor([[3, 4, 5], [6, 7, 8], [3, 4, 5], [3, 4, 5], [2, 9, 9]])
    rows_seen = []
    hook = e.inner.register_forward_pre_hook(lambda module, args: rows_seen.append(args[0].shape[0]))
    try:
        with e._generation_mode():
            shared = _CachedStepper(e, prompt, 4)
            got = shared.prefill()
            alone = [_CachedStepper(e, row[None], 4) for row in prompt]
            want = torch.cat([stepper.prefill() for stepper in alone])
    finally:
        hook.remove()
    assert rows_seen == [3, 1, 1, 1, 1, 1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert len(shared.ctx.key_value_memory_dict) == len(bare(actor).decoder.layers)
    for layer, cache in shared.ctx.key_value_memory_dict.items():
        for i, stepper in enumerate(alone):
            for t, ref in zip(cache, stepper.ctx.key_value_memory_dict[layer], strict=True):
                torch.testing.assert_close(t[:3, i], ref[:3, 0], atol=1e-5, rtol=0)


def test_seeded_samples_do_not_depend_on_batching_or_prompt_order(pgs, actor):
    sampling = SamplingParams(max_new_tokens=6, n=3, temperature=1.0, seed=5)
    wide = engine(bare(actor), pgs).generate(PROMPTS, sampling)
    narrow = engine(bare(actor), pgs, max_batch_size=1).generate(PROMPTS[::-1], sampling)
    again = engine(bare(actor), pgs).generate(PROMPTS, sampling)
    assert wide == again  # same seed, same batching: bit-identical samples
    narrow_by_key = by_key(narrow)
    for s in wide:
        other = narrow_by_key[(s.prompt_id, s.sample_index)]
        assert s.response_token_ids == other.response_token_ids
        torch.testing.assert_close(torch.tensor(s.rollout_log_probs), torch.tensor(other.rollout_log_probs),
                                   atol=1e-5, rtol=0)
    # The n samples of a prompt use different seeds, and another base seed gives other samples.
    assert len({s.response_token_ids for s in wide}) > len(PROMPTS)
    reseeded = engine(bare(actor), pgs).generate(PROMPTS, dataclasses.replace(sampling, seed=6))
    assert [s.response_token_ids for s in reseeded] != [s.response_token_ids for s in wide]


def test_generation_on_the_ddp_model_restores_train_mode_and_sequence_settings(pgs, actor):
    ddp = actor.policy.chunks[0]
    ddp.train()
    config = bare(actor).config
    before = (config.sequence_parallel, config.mtp_num_layers)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    out = engine(ddp, pgs).generate(PROMPTS, greedy)
    assert all(m.training for m in ddp.modules())
    assert (config.sequence_parallel, config.mtp_num_layers) == before
    assert out == engine(bare(actor), pgs).generate(PROMPTS, greedy)


# ------------------------------------------------------------------- stop, length, ordering


def greedy_reference(pgs, actor, max_new=8):
    sampling = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    return [s.response_token_ids for s in engine(bare(actor), pgs, eos_token_id=None).generate(PROMPTS, sampling)]


def test_max_new_tokens_gives_finish_reason_length_and_a_greedy_prefix(pgs, actor):
    ref = greedy_reference(pgs, actor, max_new=8)
    short = engine(bare(actor), pgs, eos_token_id=None).generate(PROMPTS, SamplingParams(max_new_tokens=5,
                                                                                         temperature=0.0))
    assert [s.finish_reason for s in short] == ["length"] * len(PROMPTS)
    assert [s.response_token_ids for s in short] == [r[:5] for r in ref]


def test_stop_token_and_eos_end_the_response_inclusively(pgs, actor):
    ref = greedy_reference(pgs, actor)
    stop = ref[0][3]  # a token prompt "a" produces greedily at step 3 (or earlier)

    def expected(r):
        return (r[:r.index(stop) + 1], "stop") if stop in r else (r, "length")

    want = [expected(r) for r in ref]
    assert want[0][1] == "stop" and any(len(w[0]) < 8 for w in want)
    via_stop_ids = engine(bare(actor), pgs, eos_token_id=None).generate(
        PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(stop,)))
    via_eos = engine(bare(actor), pgs, eos_token_id=stop).generate(PROMPTS, SamplingParams(max_new_tokens=8,
                                                                                           temperature=0.0))
    for got in (via_stop_ids, via_eos):
        assert [(s.response_token_ids, s.finish_reason) for s in got] == want


def test_min_new_tokens_masks_eos_and_stop_tokens_until_then_and_keeps_actor_log_probs(pgs, actor):
    """Four of the 16 tokens stop a response (EOS and three stop ids): unmasked, most rows stop in
    their first 4 tokens; with min_new_tokens=5 no row stops before token 5, many stop right after,
    and the rollout log-probs are still the actor's unmasked ones."""
    stops = (2, 3, 4)
    sp = SamplingParams(max_new_tokens=8, n=8, temperature=1.0, seed=7, stop_token_ids=stops)
    eng = engine(bare(actor), pgs)
    free = eng.generate(PROMPTS, sp)
    held = eng.generate(PROMPTS, dataclasses.replace(sp, min_new_tokens=5))
    check_generate_output(PROMPTS, sp, held)
    stop_set = {EOS, *stops}
    assert sum(len(s.response_token_ids) < 5 and s.finish_reason == "stop" for s in free) > len(free) // 2
    for s in held:
        assert not stop_set & set(s.response_token_ids[:5])
        assert (s.finish_reason == "stop") == (s.response_token_ids[-1] in stop_set)
    assert sum(s.finish_reason == "stop" for s in held) >= len(held) // 4
    batch, lp = actor_log_probs(actor, held, 8)
    got = torch.zeros_like(lp)
    for i, s in enumerate(held):
        got[i, :len(s.rollout_log_probs)] = torch.tensor(s.rollout_log_probs)
    torch.testing.assert_close(got, lp, atol=1e-4, rtol=1e-4)  # fp32: the same function, other batching


def test_output_follows_the_ordering_contract(pgs, actor):
    sampling = SamplingParams(max_new_tokens=3, n=3, temperature=1.0, seed=0)
    eng = engine(bare(actor), pgs, max_batch_size=4, policy_version=7)
    samples = eng.generate(PROMPTS, sampling)
    check_generate_output(PROMPTS, sampling, samples)
    assert [s.prompt_token_ids for s in samples] == [p.token_ids for p in PROMPTS for _ in range(3)]
    assert {s.policy_version for s in samples} == {7}
    assert eng.generate([], sampling) == []


# -------------------------------------------------------------------------------- control


def test_abort_from_another_thread_returns_partial_abort_samples(pgs, actor):
    """Abort lands while the 3rd forward runs: generation stops after it, with the tokens sampled so far.

    Lengths 3, 3, 2 share one batch: the prefill covers 2 positions, so after 3 forwards "d" has
    sampled 3 tokens and "a", "c" (fed their 3rd prompt token by the 2nd forward) 2 each.

    The generating thread never entered CudaToCpuMode: the engine handles the thread-local mode itself."""
    eng = engine(bare(actor), pgs, eos_token_id=None)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]  # lengths 3, 3, 2
    sampling = SamplingParams(max_new_tokens=40, temperature=0.0)
    ref = {s.prompt_id: s.response_token_ids for s in eng.generate(prompts, sampling)}
    calls, reached, resume = [0], threading.Event(), threading.Event()

    def hook(module, args, output):
        calls[0] += 1
        if calls[0] == 3:
            reached.set()
            assert resume.wait(30)

    handle = eng.inner.register_forward_hook(hook)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("samples", eng.generate(prompts, sampling)))
    try:
        worker.start()
        assert reached.wait(30)
        eng.abort()
        resume.set()
        worker.join(30)
    finally:
        handle.remove()
    samples = result["samples"]
    assert [s.finish_reason for s in samples] == ["abort"] * 3
    assert [s.response_token_ids for s in samples] == [ref["a"][:2], ref["c"][:2], ref["d"][:3]]
    after = eng.generate(prompts, sampling)  # abort hits only the calls in flight
    assert [s.finish_reason for s in after] == ["length"] * 3


def test_streaming_reports_each_group_once_when_complete_and_stops_when_told(pgs, actor):
    """Groups reach the callback when their last sample ends, each once, with the samples plain generate gives
    (same seeds); after the callback says stop, every group not yet complete comes back "abort" (rows of the
    batches not run yet empty), and a callback that never stops changes nothing. Batches of 4 rows with n=2
    over 5 prompts: groups of different lengths run in different batches."""
    sampling = SamplingParams(max_new_tokens=6, n=2, temperature=1.0, seed=3)
    eng = engine(bare(actor), pgs, max_batch_size=4)
    ref = eng.generate(PROMPTS, sampling)
    seen: list[list] = []
    never = eng.generate_streaming(PROMPTS, sampling, on_groups_done=lambda groups: seen.extend(groups) and False)
    assert never == ref
    assert sorted(g[0].prompt_id for g in seen) == sorted(p.prompt_id for p in PROMPTS)
    assert all([s.sample_index for s in g] == [0, 1] and len({s.prompt_id for s in g}) == 1 for g in seen)
    assert all(s.finish_reason in ("stop", "length") for g in seen for s in g)

    first: list[list] = []
    out = eng.generate_streaming(PROMPTS, sampling, on_groups_done=lambda groups: first.extend(groups) or True)
    done = {g[0].prompt_id for g in first}
    assert done and len(done) < len(PROMPTS)
    ref_by_key, out_by_key = by_key(ref), by_key(out)
    for key, s in out_by_key.items():
        if key[0] in done:
            assert s == ref_by_key[key]
    for pid in {p.prompt_id for p in PROMPTS} - done:
        group = [out_by_key[(pid, j)] for j in range(2)]
        assert any(s.finish_reason == "abort" for s in group), pid
        for s in group:  # a sample that ended before the stop is the reference one; the others a prefix of it
            r = ref_by_key[(pid, s.sample_index)]
            assert s == r if s.finish_reason != "abort" else r.response_token_ids[:len(s.response_token_ids)] == \
                s.response_token_ids
    check_generate_output(PROMPTS, sampling, out)
    # The 5-token prompts sort last into a batch of their own, which never ran.
    assert [out_by_key[(pid, j)].response_token_ids for pid in "be" for j in range(2)] == [()] * 4


def test_a_streaming_callback_error_propagates(pgs, actor):
    def boom(groups):
        raise KeyError("reward")

    with pytest.raises(KeyError, match="reward"):
        engine(bare(actor), pgs).generate_streaming(PROMPTS, SamplingParams(max_new_tokens=4, n=2),
                                                    on_groups_done=boom)


@pytest.mark.slow  # two torchrun processes: about 50 s on the shared 2-core machine
def test_the_streaming_stop_is_decided_on_rank_0_and_reaches_every_rank(tmp_path):
    """2 gloo ranks in lockstep (decision_group): both get rank 0's answers, only rank 0 runs the callback, and
    rank 0's callback error reaches rank 1 as a named error."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(ROOT / "tests/rollout/_mp_stream_decide.py"),
           str(tmp_path)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    d0, d1 = ((tmp_path / f"decide{k}.txt").read_text().splitlines() for k in (0, 1))
    assert d0[:2] == ["[False, True]", "2"] and d1[:2] == ["[False, True]", "0"]
    assert d0[2] == "KeyError: 'reward down'"
    assert d1[2] == "RolloutEngineError: the streaming stop callback failed on the deciding rank"


def test_update_weights_copies_by_name_and_sets_the_version(pgs, actor):
    from megatron_dapo.models.builder import build_gpt_model
    from megatron_dapo.workers.build import model_arch

    arch = model_arch(load_config("configs/tiny_cpu.yaml", config_overrides()), vocab_size=VOCAB)
    target, source = build_gpt_model(arch, pgs=pgs, seed=1), build_gpt_model(arch, pgs=pgs, seed=2)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    want = [s.response_token_ids for s in engine(source, pgs).generate(PROMPTS, greedy)]
    eng = engine(target, pgs)
    assert [s.response_token_ids for s in eng.generate(PROMPTS, greedy)] != want

    name, param = next(iter(target.named_parameters()))
    before = param.detach().clone()
    with pytest.raises(ValueError, match="'nope' is not a parameter"):
        eng.update_weights([(name, param + 1), ("nope", param)], policy_version=1)
    with pytest.raises(ValueError, match=f"{name!r} has shape"):
        eng.update_weights([(name, param[:1])], policy_version=1)
    assert torch.equal(param, before) and eng.policy_version == 0  # nothing applied on error

    eng.update_weights(list(source.named_parameters()), policy_version=3, bucket_mb=64)
    out = eng.generate(PROMPTS, greedy)
    assert [s.response_token_ids for s in out] == want and {s.policy_version for s in out} == {3}
    eng.update_weights(None, policy_version=4)
    assert eng.policy_version == 4 and eng.health()["policy_version"] == 4
    assert eng.generate(PROMPTS[:1], greedy)[0].policy_version == 4
    with pytest.raises(ValueError, match="policy_version must be an int >= 4"):
        eng.update_weights(None, policy_version=2)
    with pytest.raises(TypeError, match="model_path"):
        eng.update_weights(None, policy_version=5, model_path="/x")


def test_pipeline_parallel_is_rejected_with_the_config_key(pgs, actor):
    with pytest.raises(ValueError, match=r"parallel\.pipeline_model_parallel_size=2.*rollout\.engine=sglang"):
        engine(bare(actor), dataclasses.replace(pgs, pp_size=2))


def test_bad_inputs_and_states_are_named_errors(pgs, actor):
    eng = engine(bare(actor), pgs)
    sampling = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt 'x': token id 16 is outside the model's vocabulary \[0, 16\)"):
        eng.generate([PromptInput("x", (1, 16))], sampling)
    with pytest.raises(ValueError, match="prompt 'y': 3 prompt tokens \\+ max_new_tokens=1022 = 1025 > the model's "
                                         "max_sequence_length=1024"):
        eng.generate([PromptInput("y", (1, 2, 3))], SamplingParams(max_new_tokens=1022))
    with pytest.raises(ValueError, match=r"eos_token_id must be an int in \[0, 15\], got 16"):
        engine(bare(actor), pgs, eos_token_id=16)
    with pytest.raises(ValueError, match="max_batch_size must be an int >= 1"):
        engine(bare(actor), pgs, max_batch_size=0)
    eng.release_memory()
    assert eng.health()["memory_released"] is True
    with pytest.raises(RolloutEngineError, match="resume_memory"):
        eng.generate(PROMPTS, sampling)
    eng.resume_memory()
    assert len(eng.generate(PROMPTS, sampling)) == len(PROMPTS)
    eng.close()
    assert eng.health()["healthy"] is False
    with pytest.raises(RolloutEngineError, match="closed"):
        eng.generate(PROMPTS, sampling)


# ------------------------------------------------------------------------------- sampling math


def test_filter_logits_keeps_top_k_then_the_top_p_nucleus():
    z = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).log()  # probabilities 0.5, 0.3, 0.2, 0
    inf = float("-inf")
    assert filter_logits(z, top_k=2, top_p=1.0).exp()[0].tolist() == pytest.approx([0.5, 0.3, 0.0, 0.0])
    # mass before each token: 0, 0.5, 0.8 -> top_p 0.6 removes the token after 0.8 > 0.6
    assert filter_logits(z, top_k=-1, top_p=0.6).isinf().tolist() == [[False, False, True, True]]
    # top_p 0.4 < 0.5: only the most likely token stays
    assert filter_logits(z, top_k=-1, top_p=0.4).tolist()[0][1:] == [inf, inf, inf]


def test_greedy_picks_argmax_and_reports_the_temperature_1_log_prob():
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]])
    tokens, lp = sample_next_tokens(logits, temperature=0.0)
    assert tokens.tolist() == [1, 2]
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[[0, 1], [1, 2]])


def test_banned_tokens_are_never_drawn_in_the_banned_rows_and_keep_the_unmasked_log_prob():
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.5, 1.0], [0.0, 4.0, 1.0]])
    ban, rows = torch.tensor([1, 2]), torch.tensor([True, False, True])
    tokens, lp = sample_next_tokens(logits, temperature=0.0, banned_ids=ban, banned_rows=rows)
    assert tokens.tolist() == [0, 2, 0]  # row 1 is not banned: its argmax stays
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[[0, 1, 2], [0, 2, 0]])
    gens = [torch.Generator().manual_seed(i) for i in range(300)]
    drawn, lp = sample_next_tokens(logits.repeat(100, 1), temperature=1.0, banned_ids=ban,
                                   banned_rows=rows.repeat(100), generators=gens)
    assert set(drawn[0::3].tolist()) == {0} and set(drawn[2::3].tolist()) == {0}
    assert set(drawn[1::3].tolist()) == {0, 1, 2}  # the unbanned row still draws from everything
    torch.testing.assert_close(lp, torch.log_softmax(logits.repeat(100, 1), -1).gather(-1, drawn[:, None])[:, 0])


def test_sampling_frequencies_match_the_filtered_distribution_and_log_probs_the_unfiltered_one():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(4000, 4)
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    tokens, lp = sample_next_tokens(logits, temperature=1.0, top_p=0.75, generators=gens)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    # nucleus {0, 1} renormalised to 0.625 / 0.375; the 3-sigma binomial band is about +-0.023
    assert freq.tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0], abs=0.025)
    torch.testing.assert_close(lp, torch.tensor([0.5, 0.3, 0.15, 0.05]).log()[tokens])
    tokens_k1, _ = sample_next_tokens(logits[:50], temperature=2.0, top_k=1, generators=gens[:50])
    assert tokens_k1.tolist() == [0] * 50
    again, _ = sample_next_tokens(logits[:50], temperature=1.0,
                                  generators=[torch.Generator().manual_seed(i) for i in range(50)])
    first, _ = sample_next_tokens(logits[:50], temperature=1.0,
                                  generators=[torch.Generator().manual_seed(i) for i in range(50)])
    assert torch.equal(again, first)


# ------------------------------------------------------------------------------ tensor parallel


@pytest.mark.multiproc
def test_tp2_ranks_agree_and_equal_tp1(pgs, tmp_path):
    """TP=2 (sequence parallel on): both ranks return the same samples, equal to TP=1's, and their
    log-probs equal the TP=2 actor's."""
    actor = make_actor(pgs)
    ref = engine(bare(actor), pgs).generate(PROMPTS, TP_SAMPLING)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), __file__, str(tmp_path)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"tp2_rank{i}.pt", weights_only=False) for i in (0, 1)]
    assert ranks[0]["samples"] == ranks[1]["samples"]
    assert [s.response_token_ids for s in ranks[0]["samples"]] == [s.response_token_ids for s in ref]
    for got, want in zip(ranks[0]["samples"], ref):
        torch.testing.assert_close(torch.tensor(got.rollout_log_probs), torch.tensor(want.rollout_log_probs),
                                   atol=1e-5, rtol=0)
    for rank in ranks:
        assert rank["sequence_parallel_restored"]
        torch.testing.assert_close(rank["engine_log_probs"], rank["actor_log_probs"], atol=1e-5, rtol=0)


def _tp2_worker(out_dir: str) -> None:
    from megatron_dapo.parallel import destroy_parallel, init_parallel

    pgs = init_parallel(tp=2)
    actor = make_actor(pgs, **{"trainer.n_gpus_per_node": 2, "parallel.tensor_model_parallel_size": 2})
    model = bare(actor)
    sp_before = model.config.sequence_parallel
    assert sp_before  # the builder turns SP on for TP > 1: the engine must switch it off and back
    samples = engine(actor.policy.chunks[0], pgs).generate(PROMPTS, TP_SAMPLING)
    restored = model.config.sequence_parallel and model.decoder.layers[0].mlp.linear_fc1.sequence_parallel
    batch, ref = actor_log_probs(actor, samples, TP_SAMPLING.max_new_tokens)
    torch.save({"samples": samples, "engine_log_probs": batch.rollout_log_probs, "actor_log_probs": ref,
                "sequence_parallel_restored": bool(restored)}, f"{out_dir}/tp2_rank{pgs.rank}.pt")
    destroy_parallel(destroy_world=True)


if __name__ == "__main__":
    _tp2_worker(sys.argv[1])
