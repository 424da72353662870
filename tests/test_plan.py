"""The memory planner (megatron_dapo.plan): parameter shards by hand and against count_parameters,
activation formulas in closed form, the shipped recipes fit 80 GiB, an oversized config is refused
with its numbers, and the tiny actor's measured parameter / gradient / optimizer bytes equal the plan."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo import plan as plan_mod
from megatron_dapo.config import load_config
from megatron_dapo.models.arch import ModelArch, count_parameters, get_arch
from megatron_dapo.plan import (
    GIB,
    check_fits,
    count_shards,
    format_plan,
    layer_activation_bytes_per_token,
    main,
    plan_from_config,
    plan_memory,
)

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
SHIPPED = ["configs/dapo_qwen2.5_32b.yaml", "configs/dapo_wo_ds_qwen2.5_32b.yaml",
           "configs/dapo_early_qwen2.5_32b.yaml", "configs/dapo_qwen3_30b_a3b.yaml"]


def _cfg(path, *overrides):
    return load_config(str(REPO / path), list(overrides))


@pytest.mark.parametrize("name", ["tiny", "tiny_moe", "qwen2.5-32b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("variant", [{}, {"mtp_num_layers": 1}, {"untie_embeddings_and_output_weights": False}])
def test_unsharded_count_equals_arch_count_parameters(name, variant):
    arch = get_arch(name, **variant)
    (only,) = count_shards(arch)
    assert only.dense + only.expert == count_parameters(arch)["total"]


def test_qwen25_32b_shards_at_tp8_pp2_by_hand():
    # Qwen2.5-32B: h 5120, 40 heads x 128, 8 KV heads, ffn 27648, vocab 152064, QKV bias, untied.
    h, q, kv, f, v, tp = 5120, 5120, 1024, 27648, 152064, 8
    attention = (h * (q + 2 * kv) + q * h + (q + 2 * kv)) // tp          # 7,865,216
    mlp = (h * 2 * f + f * h) // tp                                       # 53,084,160
    layer = attention + mlp + 2 * h                                       # + 2 RMSNorms (replicated)
    embedding = v // tp * h
    first, last = count_shards(get_arch("qwen2.5-32b"), tp=tp, pp=2)
    assert (first.dense, first.expert) == (32 * layer + embedding, 0) == (2_048_028_672, 0)
    assert last.dense == 32 * layer + embedding + h == 2_048_033_792     # output layer + final norm
    assert first.layers == tuple(range(32)) and last.layers == tuple(range(32, 64))


def test_moe_experts_split_over_ep_and_etp_router_replicated():
    # Qwen3-30B-A3B: h 2048, 32 heads / 4 KV heads x 128, 128 experts of 768, QK-norm, vocab 151936.
    h, q, kv, e, fe, hd, v = 2048, 4096, 512, 128, 768, 128, 151936
    arch = get_arch("qwen3-30b-a3b")
    (r,) = count_shards(arch, tp=2, ep=8, etp=1)
    attention = (h * (q + 2 * kv) + q * h) // 2                           # TP-sharded
    replicated = 2 * h + 2 * hd + h * e                                   # norms, QK-norms, router
    assert r.dense == 48 * (attention + replicated) + 2 * (v // 2) * h + h
    assert r.expert == 48 * (e // 8) * 3 * h * fe                         # 16 whole experts per GPU
    (r_etp2,) = count_shards(arch, tp=2, ep=8, etp=2)
    assert r_etp2.expert * 2 == r.expert and r_etp2.dense == r.dense


def test_interleaved_stages_hold_round_robin_layers():
    assert plan_mod.layers_of_rank(8, pp=2, vpp=2, pp_rank=0) == (0, 1, 4, 5)
    assert plan_mod.layers_of_rank(8, pp=2, vpp=2, pp_rank=1) == (2, 3, 6, 7)
    with pytest.raises(ValueError, match="not divisible by PP\\*VPP"):
        plan_mod.layers_of_rank(6, pp=2, vpp=2, pp_rank=0)


SMALL = ModelArch(name="small", num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
                  num_query_groups=1, vocab_size=32, max_position_embeddings=64)


def test_activation_bytes_per_token_closed_form():
    # a = 2 B; 4h = 32 norm/linear inputs; Q+O 2q = 16, K+V 2kv = 8; LSE 4 B x 2 heads; MLP 2f + f = 48.
    assert layer_activation_bytes_per_token(SMALL, moe=False, tp=1, etp=1, sequence_parallel=False,
                                            act_bytes=2) == 2 * (32 + 24) + 8 + 2 * 48 == 216
    # TP 2 without SP: only the TP-sharded parts halve; with SP everything does.
    assert layer_activation_bytes_per_token(SMALL, moe=False, tp=2, etp=2, sequence_parallel=False,
                                            act_bytes=2) == 2 * (32 + 12) + 4 + 48 == 140
    assert layer_activation_bytes_per_token(SMALL, moe=False, tp=2, etp=2, sequence_parallel=True,
                                            act_bytes=2) == 216 / 2


def test_moe_activation_closed_form():
    moe = ModelArch(name="m", num_layers=1, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
                    num_query_groups=1, vocab_size=32, max_position_embeddings=64, num_moe_experts=4,
                    moe_router_topk=2, moe_ffn_hidden_size=4)
    # attention part 2*(32+24)+8 = 120; router fp32 logits+probs 8*E = 32; per routed copy 2*(2h + 3*fe) = 56.
    assert layer_activation_bytes_per_token(moe, moe=True, tp=1, etp=1, sequence_parallel=False,
                                            act_bytes=2) == 120 + 32 + 2 * 56


_SMALL = dict(world_size=1, params_dtype="bf16", max_tokens_per_microbatch=100, max_seq_len=50,
              use_distributed_optimizer=False, rollout_engine="sglang", rollout_tp=1,
              gpu_memory_utilization=0.5, gpu_memory=GIB, overhead=0)


def _small_plan(**kw):
    return plan_memory(SMALL, **{**_SMALL, **kw})


def test_lm_head_counts_real_tokens_and_the_kernel_scratch_never_logits():
    """The fused LM head at T = 100 tokens of h = 8 in bf16: hidden + its gradient (2 x 2 B x 8) and 24 B of
    statistics per token, plus the kernel's 256 MiB backward scratch; no [T, V] term at any vocabulary;
    under SP at TP 2 the larger of the scratch and the sequence gather."""
    from megatron_dapo.kernels.logprob_entropy import TRITON_SCRATCH_BYTES

    assert plan_mod.LM_HEAD_SCRATCH_BYTES == TRITON_SCRATCH_BYTES
    p = _small_plan()
    assert p.actor_lm_head == 100 * (2 * 2 * 8 + 24) + TRITON_SCRATCH_BYTES
    big_vocab = plan_memory(dataclasses.replace(SMALL, vocab_size=150_000), **{**_SMALL, "world_size": 1})
    assert big_vocab.actor_lm_head == p.actor_lm_head
    assert p.train_peak == p.resident_train_state + max(p.actor_activations + p.actor_lm_head, p.actor_logprobs)


def test_log_prob_buffers_follow_real_tokens_of_the_rank_and_the_batch():
    # 64 rows x 50 tokens at their worst, 3 statistics x 4 B: result + gather buffers (2 x batch) + own shard / DP
    p = _small_plan(world_size=4, logprob_rows=64, max_response_length=50)
    assert p.actor_logprobs == 12 * (2 * 64 * 50 + 64 * 50 // 4)


def test_full_recompute_keeps_layer_inputs_plus_one_layer():
    none, full = _small_plan(recompute="none"), _small_plan(recompute="full")
    assert none.actor_activations == 100 * 2 * 216
    assert full.actor_activations == 100 * (2 * 2 * 8 + 216)             # 2 layers x a*h, + 1 layer at work


def test_pipeline_ranks_hold_pp_minus_rank_microbatches_and_the_last_the_lm_head():
    arch = get_arch("tiny", vocab_size=18)
    one = plan_memory(arch, world_size=1, max_tokens_per_microbatch=64, max_seq_len=28, overhead=0)
    two = plan_memory(arch, world_size=2, pp=2, max_tokens_per_microbatch=64, max_seq_len=28, overhead=0)
    per_layer = layer_activation_bytes_per_token(arch, moe=False, tp=1, etp=1, sequence_parallel=False, act_bytes=2)
    assert one.actor_activations == math.ceil(64 * 4 * per_layer)
    assert plan_mod.in_flight_microbatches(pp=2, vpp=None, pp_rank=0) == 2.0
    # at this size the LM head's 256 MiB kernel scratch outweighs rank 0's second micro-batch in flight
    assert (two.pp_rank, two.in_flight) == (1, 1.0) and two.actor_lm_head == one.actor_lm_head > 0
    assert two.actor_activations == math.ceil(64 * 2 * per_layer * 1)   # 2 layers, 1 micro-batch in flight


def test_optimizer_bytes_per_param_and_distributed_sharding():
    bf16 = _small_plan(world_size=4, use_distributed_optimizer=True)
    n = bf16.params_per_gpu
    assert (bf16.actor_params, bf16.actor_grads) == (2 * n, 4 * n)
    assert bf16.actor_optimizer_replicated == 12 * n                    # fp32 master + m + v
    assert bf16.actor_optimizer == bf16.actor_optimizer_distributed == math.ceil(12 * n / 4)
    fp32 = _small_plan(params_dtype="fp32")
    assert fp32.actor_optimizer == 8 * n and fp32.actor_params == 4 * n  # params are the master copy


def test_colocated_kv_pool_shrinks_by_the_trainers_steady_state():
    """Colocated, the pool is planned against what the trainer keeps between steps (its state plus the
    overhead reserve: CUDA context, NCCL, allocator remainder); SGLang would size it at launch against
    less (before the first step only the fp32 master copy of the optimizer exists)."""
    colo, disagg = _small_plan(rollout_mode="colocate"), _small_plan(rollout_mode="disaggregate")
    assert colo.trainer_at_rollout == colo.resident_train_state + colo.overhead
    assert disagg.rollout_kv_cache - colo.rollout_kv_cache == colo.trainer_at_rollout
    n = colo.params_per_gpu
    assert colo.trainer_at_launch == 2 * n + 4 * n + math.ceil(colo.actor_optimizer / 3) + colo.overhead
    assert colo.rollout_kv_cache_at_launch - colo.rollout_kv_cache == colo.actor_optimizer - math.ceil(
        colo.actor_optimizer / 3)  # Adam's m and v, which come with the first optimizer step
    assert disagg.trainer_at_rollout == disagg.trainer_at_launch == 0
    # KV per token: 2 (K, V) x 2 layers x 1 KV head x head_dim 4 x 2 B = 32 B.
    assert disagg.rollout_kv_tokens == (int(0.5 * GIB) - disagg.rollout_weights) // 32
    assert colo.peak == max(colo.train_peak, colo.rollout_peak)


def test_offloaded_optimizer_leaves_the_kv_pool_while_the_servers_run():
    kept, offloaded = _small_plan(rollout_mode="colocate"), _small_plan(rollout_mode="colocate",
                                                                        offload_optimizer=True)
    # The pool is the smaller of the steady-state figure and SGLang's own sizing at launch.
    assert offloaded.rollout_kv_cache == min(kept.rollout_kv_cache + kept.actor_optimizer,
                                             kept.rollout_kv_cache_at_launch) > kept.rollout_kv_cache
    assert offloaded.train_peak == kept.train_peak  # training still holds it
    assert "optimizer on the host (offload_optimizer)" in format_plan(offloaded)


@pytest.mark.parametrize("recipe", SHIPPED)
def test_shipped_recipes_fit_80gib_h800(recipe):
    plan = plan_from_config(_cfg(recipe), gpu_memory_gib=80)
    check_fits(plan)
    assert plan.train_peak < 80 * GIB and plan.rollout_peak <= 80 * GIB
    assert plan.rollout_kv_tokens > 20 * plan.max_seq_len                # room for many full sequences
    assert "= peak per GPU" in format_plan(plan)


def test_oversized_config_is_refused_naming_components_and_numbers():
    cfg = _cfg("configs/dapo_qwen2.5_32b.yaml", "parallel.tensor_model_parallel_size=1",
               "parallel.pipeline_model_parallel_size=1", "parallel.sequence_parallel=false",
               "rollout.gpu_memory_utilization=0.3")
    plan = plan_from_config(cfg, gpu_memory_gib=80)
    with pytest.raises(ValueError) as err:
        check_fits(plan)
    msg = str(err.value)
    assert f"actor training (pipeline rank 0) needs {plan.train_peak / GIB:.2f} GiB > GPU 80.00 GiB" in msg
    assert f"params {plan.actor_params / GIB:.2f} GiB" in msg and f"grads {plan.actor_grads / GIB:.2f} GiB" in msg
    assert plan.actor_params == 2 * count_parameters(get_arch("qwen2.5-32b"))["total"]
    assert "rollout KV cache holds 0 tokens < one sequence of 22528" in msg


def test_every_plan_input_comes_from_its_config_field(monkeypatch):
    seen = {}
    monkeypatch.setattr(plan_mod.memory, "plan_memory", lambda arch, **kw: seen.update(kw) or "plan")
    cfg = _cfg("configs/dapo_qwen3_30b_a3b.yaml",
               "actor.use_distributed_optimizer=false", "actor.use_kl_loss=true",
               "rollout.mode=disaggregate", "rollout.sglang_urls=[http://10.0.1.1:30000]",
               "rollout.speculative.algorithm=EAGLE", "model.recompute=selective",
               "rollout.gpu_memory_utilization=0.7", "actor.max_tokens_per_microbatch=30000",
               "parallel.sequence_parallel=true", "actor.offload_optimizer=true", "actor.router_replay=r2")
    assert plan_from_config(cfg, arch=get_arch("qwen3-30b-a3b"), gpu_memory_gib=96, overhead_gib=2) == "plan"
    assert seen == dict(
        world_size=128, tp=2, pp=1, cp=1, ep=8, etp=1, vpp=None, sequence_parallel=True, params_dtype="bf16",
        use_distributed_optimizer=False, grad_reduce_in_fp32=True, max_tokens_per_microbatch=30000,
        recompute="selective", logprob_rows=512 * 16, max_response_length=20480, needs_reference=True,
        rollout_engine="sglang",
        rollout_mode="disaggregate", rollout_tp=4, gpu_memory_utilization=0.7, speculative=True,
        max_seq_len=2048 + 20480, rollout_sequences=1536 * 16, gpu_memory=96 * GIB, overhead=2 * GIB,
        bias_activation_fusion=True, gradient_accumulation_fusion=True,     # TE's defaults
        offload_optimizer=True, router_replay="r2")
    seen.clear()
    plan_from_config(_cfg("configs/dapo_qwen3_30b_a3b.yaml", "model.bias_activation_fusion=false"),
                     arch=get_arch("qwen3-30b-a3b"))
    assert (seen["bias_activation_fusion"], seen["gradient_accumulation_fusion"]) == (False, True)
    plan_from_config(_cfg("configs/dapo_qwen3_30b_a3b.yaml"), arch=get_arch("qwen3-30b-a3b"), backend="local")
    assert (seen["bias_activation_fusion"], seen["gradient_accumulation_fusion"]) == (False, False)


def test_unfused_swiglu_and_weight_gradients_cost_their_closed_forms():
    # SMALL: f = 16, a = 2 B; unfused SwiGLU also keeps silu(gate), f elements per token and layer.
    fused = layer_activation_bytes_per_token(SMALL, moe=False, tp=1, etp=1, sequence_parallel=False, act_bytes=2)
    assert layer_activation_bytes_per_token(SMALL, moe=False, tp=1, etp=1, sequence_parallel=False, act_bytes=2,
                                            bias_activation_fusion=False) == fused + 2 * 16
    on, off = _small_plan(), _small_plan(bias_activation_fusion=False, gradient_accumulation_fusion=False)
    assert off.actor_activations - on.actor_activations == 100 * 2 * 2 * 16       # tokens x layers x a*f
    # Largest linear weight: the output layer V*h = 32*8 and fc1 2f*h = 2*16*8, both 256 elements of 2 B.
    assert (on.actor_wgrad, off.actor_wgrad) == (0, 2 * 256)
    assert off.train_peak - on.train_peak == 100 * 2 * 2 * 16 + 2 * 256


def test_cli_exit_codes_fit_refuse_and_config_error(capsys):
    assert main(["--config", str(REPO / "configs/dapo_qwen2.5_32b.yaml")]) == 0
    out = capsys.readouterr().out
    assert "actor optimizer" in out and "rollout KV cache" in out and out.rstrip().endswith("fits")
    assert main(["--config", str(REPO / "configs/dapo_qwen2.5_32b.yaml"), "--gpu-memory-gb", "16"]) == 1
    assert "configuration does not fit: actor training" in capsys.readouterr().err
    assert main(["--config", str(REPO / "configs/tiny_cpu.yaml"), "actor.nope=1"]) == 2


# --- measured: the real Megatron actor (workers/build.py) against the plan ------------------------

MEASURE = r'''
import json, sys
import torch
import torch.distributed as dist
from megatron_dapo.config import load_config
from megatron_dapo.workers.build import build_actor
from megatron_dapo.parallel import destroy_parallel, init_parallel


def measure(overrides):
    cfg = load_config("configs/tiny_cpu.yaml", overrides)
    par = cfg.parallel
    pgs = init_parallel(tp=par.tensor_model_parallel_size, pp=par.pipeline_model_parallel_size,
                        ep=par.expert_model_parallel_size, etp=par.expert_tensor_parallel_size)
    actor = build_actor(cfg, pgs, vocab_size=18, pad_id=0)
    chunks, opt = actor.policy.chunks, actor.optimizer
    params = [p for c in chunks for p in c.parameters()]
    model_storages = {p.untyped_storage().data_ptr() for p in params}
    grads = sum(b.grad_data.numel() * b.grad_data.element_size()
                for c in chunks for b in list(c.buffers) + list(c.expert_parallel_buffers))
    ok = opt.step()[0]                       # zero grads; creates Adam's lazily built state
    adam = master = 0
    for o in opt.chained_optimizers:
        for s in o.optimizer.state.values():
            adam += sum(v.numel() * v.element_size() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
        for g in o.optimizer.param_groups:   # fp32 copies that are not the model's own tensors
            master += sum(p.numel() * p.element_size() for p in g["params"]
                          if p.untyped_storage().data_ptr() not in model_storages)
    destroy_parallel()
    return {"ok": bool(ok), "tensors": len(params), "params": sum(p.numel() for p in params),
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "grad_bytes": grads, "optimizer_bytes": adam + master}


results = [measure(c) for c in json.loads(sys.argv[1])]
if dist.is_initialized() and dist.get_world_size() > 1:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
else:
    gathered = [results]
if not dist.is_initialized() or dist.get_rank() == 0:
    print("RESULT " + json.dumps(gathered))
'''


def _measure(tmp_path, cases, nproc=1):
    script = tmp_path / "measure.py"
    script.write_text(MEASURE)
    launcher = [PYTHON] if nproc == 1 else [PYTHON, "-m", "torch.distributed.run", "--standalone",
                                             f"--nproc_per_node={nproc}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(launcher + [str(script), json.dumps(cases)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _expect(overrides):
    plan = plan_from_config(_cfg("configs/tiny_cpu.yaml", *overrides))
    return {"ok": True, "params": plan.params_per_gpu, "param_bytes": plan.actor_params,
            "grad_bytes": plan.actor_grads, "optimizer_bytes": plan.actor_optimizer}


def test_tiny_actor_measured_sizes_equal_the_plan(tmp_path):
    cases = [["model.params_dtype=bf16", "actor.use_distributed_optimizer=false"],
             ["model.params_dtype=fp32", "actor.use_distributed_optimizer=false"]]
    (measured,) = _measure(tmp_path, cases)
    for m in measured:
        m.pop("tensors")
    assert measured == [_expect(c) for c in cases]
    assert measured[0]["optimizer_bytes"] == 12 * measured[0]["params"]


@pytest.mark.multiproc
def test_two_rank_shards_measured_equal_the_plan(tmp_path):
    """TP=2 halves the sharded weights; the distributed optimizer halves the state over DP=2; EP=2
    splits the experts while their optimizer state stays whole (expert DP = 1)."""
    base = ["trainer.n_gpus_per_node=2", "model.params_dtype=bf16"]
    cases = [base + ["parallel.tensor_model_parallel_size=2", "actor.use_distributed_optimizer=false"],
             base + ["actor.use_distributed_optimizer=true"],
             base + ["model.arch=tiny_moe", "parallel.expert_model_parallel_size=2",
                     "actor.use_distributed_optimizer=true"]]
    rank0, rank1 = _measure(tmp_path, cases, nproc=2)
    assert rank0 == rank1
    for case, measured in zip(cases, rank0):
        expected = _expect(case)
        # The distributed optimizer's buffers start every parameter at a multiple of 64 elements (and
        # pad buckets to lcm(DP, 128)): fp32 grads grow by less than 64 * 4 B per tensor.
        pad = measured.pop("grad_bytes") - expected.pop("grad_bytes")
        assert 0 <= pad < 64 * 4 * measured.pop("tensors")
        assert measured == expected


def test_sequence_parallel_none_means_on_when_tp_above_one():
    for tp, resolved in ((1, False), (2, True)):
        auto = _small_plan(world_size=tp, tp=tp, sequence_parallel=None)
        assert auto == _small_plan(world_size=tp, tp=tp, sequence_parallel=resolved)


def test_weight_sync_plan_for_the_32b_recipe_by_hand():
    """TP8 x PP2, bf16: each stage is half the model; its sender holds 1/8 of the TP-sharded tensors and the
    replicated norms, so it gathers the other 7/8; each TP peer sends its 1/8; every server TP rank gets all."""
    from megatron_dapo.plan.weights import format_weight_sync, plan_weight_sync

    arch = get_arch("qwen2.5-32b")
    plan = plan_weight_sync(arch, tp=8, pp=2, dtype_bytes=2, transport="distributed", server_ranks=128)
    full = count_shards(arch, tp=1, pp=2)
    shard = count_shards(arch, tp=8, pp=2)
    assert plan.model_bytes == 2 * count_parameters(arch)["total"]
    for s, f, m in zip(plan.stages, full, shard, strict=True):
        assert s.stage_bytes == 2 * (f.dense + f.expert)
        assert s.sender_gathers == 2 * (f.dense - m.dense)
        assert s.peer_sends == s.sender_gathers // 7
        assert s.sender_gathers == pytest.approx(7 / 8 * s.stage_bytes, rel=1e-3)  # norms are replicated
    assert plan.sender_egress(0) == 128 * plan.stages[0].stage_bytes
    assert "65.53 GB per server TP rank" in format_weight_sync(plan)


def test_the_sync_line_counts_the_recipes_hf_tensors_and_prices_them():
    """18,867 HF tensors for Qwen3-30B-A3B (3 + 48 x (8 attention + router + 3 x 128 experts)), 771 for
    Qwen2.5-32B (3 + 64 x 12 with the qkv biases): the tensor count bench_weight_sync.py measures; the line
    prices them at the measured per-tensor cost plus the bytes at the assumed rate."""
    from megatron_dapo.plan.weights import (
        SYNC_ASSUMED_GBPS,
        SYNC_US_PER_TENSOR,
        format_weight_sync,
        plan_weight_sync,
        sync_tensor_count,
    )

    assert sync_tensor_count(get_arch("qwen3-30b-a3b")) == 18_867
    assert sync_tensor_count(get_arch("qwen2.5-32b")) == 771
    plan = plan_weight_sync(get_arch("qwen3-30b-a3b"), tp=4, pp=1, ep=8, dtype_bytes=2, transport="ipc",
                            server_ranks=128, nodes=16)
    want = 18_867 * SYNC_US_PER_TENSOR * 1e-6 + plan.model_bytes / (SYNC_ASSUMED_GBPS * 1e9)
    assert plan.estimated_seconds() == pytest.approx(want)
    assert f"sync: about {want:.1f} s per step = 18,867 HF tensors x " in format_weight_sync(plan)


def test_router_replay_records_per_rank_at_the_moe_recipe():
    """The MoE recipe (r2): 512 x 16 rows over DP 64, at most 2,048 + 20,480 tokens, 48 MoE layers, top-8,
    1 byte per expert id (128 experts): 1.03 GiB of host memory per rank, printed by the planner."""
    plan = plan_from_config(_cfg("configs/dapo_qwen3_30b_a3b.yaml"), arch=get_arch("qwen3-30b-a3b"))
    assert plan.dp == 64 and plan.router_replay_layers == 48
    assert plan.router_replay_host == 128 * 22_528 * 48 * 8
    assert "host: routing             1.03" in format_plan(plan)
    off = plan_from_config(_cfg("configs/dapo_qwen3_30b_a3b.yaml", "actor.router_replay=off"),
                           arch=get_arch("qwen3-30b-a3b"))
    assert off.router_replay_host == 0 and "host: routing" not in format_plan(off)
    r3 = plan_from_config(_cfg("configs/dapo_qwen3_30b_a3b.yaml", "actor.router_replay=r3"),
                          arch=get_arch("qwen3-30b-a3b"))
    # rank 0 keeps the routing of the rows one step trains: 512 x 16 rows x 22,528 tokens x 48 layers x 8
    assert r3.router_replay_rank0 == 512 * 16 * 22_528 * 48 * 8 and plan.router_replay_rank0 == 0
    # a replica's first rank receives its 128 rows with every MoE layer at the step (PP 1: all its layers too)
    assert r3.router_replay_received == 128 * 22_528 * 48 * 8 and plan.router_replay_received == 0
    assert "host: r3 at rank 0       66.00" in format_plan(r3)


def test_the_queue_trainers_r3_routing_files_are_planned_on_rank_0s_disk():
    """The MoE recipe on the queue trainer's async mode with R3: the spool holds the routing of at most
    (max_staleness + 1) x parameter_sync_step generation batches of 1,536 x 16 rows, each (2,048 + L - 1) tokens
    x 48 layers x top-8 x 1 B; the planner prints it as a `disk:` line (none without R3 or the queue)."""
    from megatron_dapo.plan import format_host, plan_host

    arch = get_arch("qwen3-30b-a3b")
    queue = ["queue.enable=true", "queue.max_staleness=1", "rollout.mode=disaggregate",
             "rollout.sglang_urls=[http://10.0.0.1:30000]", "actor.router_replay=r3"]
    cfg = _cfg("configs/dapo_qwen3_30b_a3b.yaml", *queue)
    host = plan_host(cfg, memory_plan=plan_from_config(cfg, arch=arch), response_tokens=6000)
    assert host.spool_rows == 2 * 1536 * 16 and host.spool == 2 * 1536 * 16 * (2048 + 6000 - 1) * 48 * 8
    assert f"disk: rank 0's node {host.spool / 2**30:.1f} GiB: the queue's R3 routing files" in format_host(host)
    for off in (queue[:4], queue[1:]):  # r2 on the queue; R3 on the sync trainer (routing in memory only)
        cfg = _cfg("configs/dapo_qwen3_30b_a3b.yaml", *off)
        host = plan_host(cfg, memory_plan=plan_from_config(cfg, arch=arch), response_tokens=6000)
        assert host.spool == 0 and "disk:" not in format_host(host)


def test_host_data_path_terms_by_hand():
    from megatron_dapo.plan.host import (
        JSON_PARSE_BYTES_PER_TOKEN,
        R3_REPLY_BYTES_PER_ID,
        REPLIES_HELD,
        REPLY_BYTES_PER_TOKEN,
        data_path,
    )
    from megatron_dapo.rollout.sglang.client import REPLIES_AT_ONCE

    assert REPLIES_HELD == REPLIES_AT_ONCE  # the planner counts the engine's bound on replies in parse

    rank0, other = data_path(rows=64, n=16, train_rows=32, response_tokens=100, max_response_length=200,
                             max_prompt_length=10, world=4, text_bytes_per_token=2, step_tensors=1)
    dense = 32 * 200 * 8 + 32 * 10 * 4 + 1 * 32 * 200 * 4  # log-probs + mask dense, prompt ids ragged int32
    assert rank0 == {"generation batch": 64 * 100 * 8 * 2, "replies in parse":
                     REPLIES_HELD * 16 * 100 * REPLY_BYTES_PER_TOKEN + 16 * 100 * JSON_PARSE_BYTES_PER_TOKEN,
                     "texts": 64 * 100 * 2, "kept rows": 32 * 100 * 8 * 2, "training batch": dense}
    assert other == {"its rows": 16 * 100 * (8 + 2), "kept rows": 32 * 100 * 8, "training batch": dense}
    # R3 at 6 layers x top-2 (12 ids a token) of 300 experts (int16): rows of 10 + 100 - 1 routed tokens
    r3, r3_other = data_path(rows=64, n=16, train_rows=32, response_tokens=100, max_response_length=200,
                             max_prompt_length=10, world=4, text_bytes_per_token=2, step_tensors=1,
                             routing_ids_per_token=12, routing_id_bytes=2)
    assert r3 == {**rank0, "r3 routing": 32 * 109 * 12 * 2,  # the train rows only (StopWhenFull's release)
                  "r3 replies in parse": REPLIES_HELD * 16 * 109 * 12 * R3_REPLY_BYTES_PER_ID}
    assert r3_other == other


def test_host_plan_of_the_32b_recipe_and_a_node_too_small_for_r3_is_refused_naming_the_key():
    from megatron_dapo.plan.host import check_host, plan_host

    cfg = _cfg("configs/dapo_qwen2.5_32b.yaml")
    plan = plan_from_config(cfg, gpu_memory_gib=80)
    host = plan_host(cfg, memory_plan=plan)
    assert host.rows == 1536 * 16 and host.train_rows == 512 * 16 and host.response_tokens == 20480
    assert host.rank0["generation batch"] == 24576 * 20480 * 16 and check_host(host) is None
    assert host.node0_total == host.rank0_total + 7 * host.other_total
    check_fits(plan, host=host)
    moe = _cfg("configs/dapo_qwen3_30b_a3b.yaml", "actor.router_replay=r3", "trainer.host_memory_gib_per_node=128")
    moe_plan = plan_from_config(moe, gpu_memory_gib=80)
    small = plan_host(moe, memory_plan=moe_plan)
    assert small.rank0["r3 routing"] == moe_plan.router_replay_rank0
    with pytest.raises(ValueError, match=r"host memory of rank 0's node: \d+\.\d GiB > "
                                         r"trainer.host_memory_gib_per_node=128 GiB \(rank 0 \d+\.\d GiB, largest: "
                                         r"r3 routing 66\.0 GiB"):
        check_fits(moe_plan, host=small)
    typical = plan_host(moe, memory_plan=moe_plan, response_tokens=6000)
    assert typical.rank0["generation batch"] == 24576 * 6000 * 16


def test_the_planner_prints_host_lines_and_refuses_a_small_node():
    run = lambda *a: subprocess.run([sys.executable, "-m", "megatron_dapo.plan", "--config",  # noqa: E731
                                     "configs/dapo_qwen2.5_32b.yaml", *a], cwd=REPO, capture_output=True, text=True)
    ok = run()
    assert ok.returncode == 0 and "host: rank 0 " in ok.stdout and "host: rank 0's node " in ok.stdout
    small = run("trainer.host_memory_gib_per_node=64")
    assert small.returncode == 1 and "trainer.host_memory_gib_per_node=64 GiB" in small.stderr
