"""Memory planner: per-GPU memory of the actor, the reference and the rollout engine for a config.

    python -m megatron_dapo.plan --config configs/dapo_qwen2.5_32b.yaml [key=value ...] [--gpu-memory-gb 80]

prints a table and exits 1 when the configuration cannot fit (2 for an invalid config). In code:
`check_fits(plan_from_config(cfg))` raises a ValueError naming each component that does not fit.
All sizes are bytes; GiB = 2**30 bytes (`--gpu-memory-gb` is in GiB too).

Parameters (exact, from the architecture; `count_shards`), per GPU of pipeline rank r:
  attention = QKV h*(q + 2kv) + O q*h (+ QKV bias q + 2kv)          sharded by TP
  dense MLP = fc1 h*2f (SwiGLU: gate and up) + fc2 f*h                sharded by TP
  expert    = the same with the expert size, E/EP experts per GPU     sharded by ETP
  router h*E, norms, QK-norms                                          replicated
  embedding V*h on the first stage, output layer V*h (+ final norm, MTP layers) on the last  / TP
q = heads*head_dim, kv = kv_heads*head_dim. Layers: L/PP per rank (interleaved: L/(PP*VPP) per
virtual stage, round robin). At TP = PP = EP = 1 the sum equals `models.arch.count_parameters`.

Actor state per GPU (as `workers/build.py` builds it):
  params      param bytes (2 bf16, 4 fp32) per parameter
  grads       4 B per parameter (Megatron DDP grad buffer with grad_reduce_in_fp32=True; with the
              distributed optimizer the buffer also pads each tensor to 64 elements, not counted)
  optimizer   Adam m + v in fp32 (8 B), plus an fp32 master copy for bf16 params (12 B in all);
              the distributed optimizer shards it over DP x CP (dense) / expert-DP (experts);
              both figures are reported, the configured one counts.
  activations per micro-batch of T tokens (actor.max_tokens_per_microbatch / CP), per layer and
              token, in activation bytes a (= param bytes), following the accounting of Korthikanti
              et al. 2022 (arXiv 2205.05198, Table 2) adapted to flash attention (no s^2 softmax
              term), no dropout, GQA and SwiGLU:
                a * (4h / sp + (2q + 2kv [+ q + kv QK-norm inputs]) / tp) + 4 B * heads / tp (LSE)
                dense MLP:  a * (2f + f) / tp
                MoE MLP:    (8 B * E + topk * a * (2h + 3 f_e / etp) [+ shared 3 f_s a / tp]) / sp
              with model.bias_activation_fusion (on with TE): the fused SwiGLU keeps only its input
              (the 2f above); unfused, torch also keeps silu(gate) for the product's backward, + a*f/tp
              per dense MLP and + topk*a*f_e/etp per routed token (no change for GeLU).
              where sp = TP with sequence parallelism, else 1 (4h: the two norm inputs and the two
              linear inputs that TP replicates without SP). Full recomputation stores only each
              layer's input, a*h/sp per token, plus one layer's full set while it is recomputed;
              selective recomputation equals none here (flash attention already recomputes softmax).
              1F1B keeps PP - r micro-batches in flight on rank r; interleaving multiplies that by
              Megatron's 1 + (PP-1)/(PP*VPP).
  wgrad       without model.gradient_accumulation_fusion (on with TE): each linear's weight gradient
              is a param-dtype tensor until DDP's hook adds it into the fp32 grad buffer, so the largest
              linear weight of the GPU (often the output layer's V*h/TP) is held once more at the peak.
              With the fusion the GEMM accumulates into the buffer directly (0). The other fusions
              (RoPE, bias-dropout-add with dropout 0 and no bias, masked softmax: TE's attention never
              stores the softmax) do not change what is stored.
  LM head     (last stage) log-probs, entropy and sum p^2 come from `kernels.fused_logprob_stats` at the
              real response tokens of a micro-batch only, N <= T (its token budget bounds them), and
              never as [N, V/TP] logits: the hidden states at those tokens, a * h each, kept for
              backward, their gradient, a * h, and 24 B of fp32 statistics per token, plus the
              kernel's backward scratch (TRITON_SCRATCH_BYTES, 256 MiB) or, under sequence parallelism,
              the gather of the micro-batch's sequence over TP (a * h per token), the larger of the two.
  log-probs   after a compute_log_prob pass (activations freed): this rank's statistics at its real
              tokens, the DP all-gather buffers and the gathered result, 4 B x K statistics (3: log-prob,
              entropy, sum p^2) x (2 x batch tokens + this rank's tokens), batch tokens at their worst:
              train_batch_size x n rows x max_response_length. The peak is the larger of this and the
              training working set (activations + LM head).
  reference   params only, when a KL term is used (cfg.needs_reference).
  overhead    a fixed reserve for the CUDA context, NCCL buffers and allocator fragmentation
              (`--overhead-gb`, default 4 GiB: a rule of thumb, not a measurement).

Rollout engine:
  sglang      weights 2 B * params / rollout TP (bf16); SGLang sizes its KV pool so that the GPU's
              used memory reaches gpu_memory_utilization x GPU: KV = frac*GPU - weights - what else
              is resident. Colocated, the trainer's steady state stays resident during rollout, so it
              comes out of the KV pool: params, grads, optimizer (unless actor.offload_optimizer moves
              it to the host while the servers run), reference, and the overhead reserve (the trainer's
              CUDA context, NCCL buffers and what its allocator cannot return after the
              gc.collect + empty_cache that precede every resume). SGLang measures free memory once,
              at launch, before the first optimizer step: the trainer then holds params, grads, the
              fp32 master copy (4 of the 12 B of a bf16 parameter's optimizer state; Adam's moments
              come with the first step) and the overhead, so an unplanned pool would be larger by the
              moments (and the optimizer, when offloaded, is not subtracted either), and that much
              would come out of SGLang's runtime reserve once training runs. The launch therefore
              caps the pool at the steady-state figure (--max-total-tokens, rollout.server_max_total_tokens
              when null); a cap only lowers SGLang's own sizing, so the pool is the smaller of the two. SGLang releases its memory during training, so the peak is max(training,
              rollout), not the sum. KV capacity in
              tokens = KV / (2 * layers * ceil(kv_heads / rollout TP) * head_dim * 2 B), layers
              including the MTP layers when speculative decoding is on. It must hold at least one
              full sequence (max_prompt_length + max_response_length).
  local       the actor's own model samples with a KV cache for gen_batch_size * n sequences of
              full length, at the actor's TP and activation bytes, on top of the training state.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

from megatron_dapo.models.arch import ModelArch, expert_id_dtype
from megatron_dapo.plan.host import HostPlan, check_host, format_host, plan_host
from megatron_dapo.plan.params import RankParams, count_shards

GIB = 1024**3
LM_HEAD_SCRATCH_BYTES = 256 << 20
"""kernels.logprob_entropy.TRITON_SCRATCH_BYTES: the fused kernel's backward [C, V/TP] buffer (tested equal)."""
LM_HEAD_STATS_BYTES = 24
"""fp32 per-token statistics of the fused kernel: log-prob, entropy, lse, Ez and their two gradients."""
LOGPROB_STATS = 3
"""Statistics compute_log_prob may return per token: log-prob, entropy, sum p^2."""


# --- activations -------------------------------------------------------------------------------

def layer_activation_bytes_per_token(arch: ModelArch, *, moe: bool, tp: int, etp: int,
                                     sequence_parallel: bool, act_bytes: int,
                                     bias_activation_fusion: bool = True) -> float:
    """Bytes one decoder layer keeps for backward per token of the micro-batch (no recomputation)."""
    h, hd = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * hd, arch.num_query_groups * hd
    sp = tp if sequence_parallel else 1
    attention = 2 * q + 2 * kv + ((q + kv) if arch.qk_layernorm else 0)
    total = act_bytes * (4 * h / sp + attention / tp) + 4 * arch.num_attention_heads / tp

    def mlp(f: int) -> int:     # fc1 output (the activation's input) + fc2 input [+ silu(gate), unfused]
        return (2 * f if arch.swiglu else f) + f + (f if arch.swiglu and not bias_activation_fusion else 0)

    if not moe:
        return total + act_bytes * mlp(arch.ffn_hidden_size) / tp
    fe = arch.moe_ffn_hidden_size
    per_local_token = 8 * arch.num_moe_experts + arch.moe_router_topk * act_bytes * (2 * h + mlp(fe) / etp)
    if arch.moe_shared_expert_intermediate_size:
        per_local_token += act_bytes * mlp(arch.moe_shared_expert_intermediate_size) / tp * sp
    return total + per_local_token / sp


def largest_linear_weight(arch: ModelArch, *, tp: int, etp: int, last_stage: bool) -> int:
    """Elements of the largest linear weight one GPU holds (its weight gradient is the unfused transient)."""
    h, hd = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * hd, arch.num_query_groups * hd
    n_in = 2 if arch.swiglu else 1
    sizes = [h * (q + 2 * kv) // tp, q * h // tp]
    if arch.is_moe:
        sizes += [n_in * arch.moe_ffn_hidden_size * h // etp]
        if arch.moe_shared_expert_intermediate_size:
            sizes += [n_in * arch.moe_shared_expert_intermediate_size * h // tp]
    if not arch.is_moe or arch.moe_layer_pattern().count(0):
        sizes += [n_in * arch.ffn_hidden_size * h // tp]
    if last_stage and arch.untie_embeddings_and_output_weights:
        sizes += [math.ceil(arch.vocab_size / tp) * h]
    return max(sizes)


def in_flight_microbatches(*, pp: int, vpp: int | None, pp_rank: int) -> float:
    """Micro-batches whose activations rank pp_rank holds at once under 1F1B (interleaved: times
    Megatron's penalty 1 + (PP-1)/(PP*VPP), an upper bound for ranks other than 0)."""
    base = pp - pp_rank
    return base * (1 + (pp - 1) / (pp * vpp)) if vpp else float(base)


# --- the plan ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU memory in bytes; the actor figures are those of the busiest pipeline rank."""

    arch_name: str
    params_total: int
    world_size: int
    tp: int
    pp: int
    cp: int
    dp: int
    ep: int
    etp: int
    expert_dp: int
    gpu_memory: int
    overhead: int
    pp_rank: int
    """The pipeline rank whose training peak is largest (the one shown)."""
    params_per_gpu: int
    params_dtype: str
    actor_params: int
    actor_grads: int
    actor_optimizer: int
    actor_optimizer_distributed: int
    actor_optimizer_replicated: int
    use_distributed_optimizer: bool
    actor_activations: int
    actor_wgrad: int
    """The unfused weight-gradient transient (0 with gradient_accumulation_fusion)."""
    actor_lm_head: int
    """The fused LM head's working memory at a micro-batch's real response tokens (last stage)."""
    actor_logprobs: int
    """compute_log_prob's gathered statistics after its pass, worst case (last stage)."""
    reference_params: int
    train_peak: int
    rollout_engine: str
    rollout_mode: str
    rollout_tp: int
    rollout_weights: int
    rollout_kv_cache: int
    """The KV pool planned against the trainer's steady state (trainer_at_rollout)."""
    rollout_kv_tokens: int
    rollout_kv_cache_at_launch: int
    """The pool SGLang would size itself at launch (against trainer_at_launch), without the cap."""
    rollout_kv_tokens_at_launch: int
    trainer_at_rollout: int
    """Colocated: what the trainer keeps on the GPU while the servers run (steady state); else 0."""
    trainer_at_launch: int
    """Colocated: what the trainer holds when the servers launch (before the first optimizer step); else 0."""
    offload_optimizer: bool
    rollout_reserved: int
    """SGLang: gpu_memory_utilization x GPU; local engine: 0."""
    rollout_peak: int
    max_seq_len: int
    micro_batch_tokens: int
    recompute: str
    in_flight: float
    router_replay_host: int = 0
    """Host memory per rank of the routing records (actor.router_replay): this DP rank's rows at the longest
    sequence x its stage's MoE layers x top-k, 1 B per id (2 above 256 experts); 0 when off."""
    router_replay_layers: int = 0
    router_replay_rank0: int = 0
    """r3: host memory of rank 0, which receives every generated row's routing from the engine and keeps that
    of the rows one step trains: train_batch_size x n rows at the longest sequence x the MoE layers x top-k.
    A bound, not an estimate: rank 0 scores each group as it completes, a group dynamic sampling drops
    releases its routing then, and an informative group with train_batch_size informative groups before it
    in the batch's order (the step takes those) releases its own, so the groups holding routing are at most
    the first train_batch_size informative ones (trainer.dynamic_sampling.StopWhenFull); without dynamic
    sampling every generated row is trained."""
    router_replay_received: int = 0
    """r3: at the step, the first rank of each data-parallel replica receives its replica's rows with every MoE
    layer (to forward each peer its layers, trainer/replay.py) and holds them while its records are made:
    rows / DP at the longest sequence x the MoE layers x top-k."""

    @property
    def resident_train_state(self) -> int:
        """What training keeps on the GPU between steps: params, grads, optimizer, reference."""
        return self.actor_params + self.actor_grads + self.actor_optimizer + self.reference_params

    @property
    def peak(self) -> int:
        """Colocated: training and rollout take turns (max); disaggregated: the larger of two GPU kinds."""
        return max(self.train_peak, self.rollout_peak)


def plan_memory(arch: ModelArch, *, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                etp: int | None = None, vpp: int | None = None, sequence_parallel: bool | None = None,
                params_dtype: str = "bf16", use_distributed_optimizer: bool = True,
                grad_reduce_in_fp32: bool = True, max_tokens_per_microbatch: int, recompute: str = "none",
                logprob_rows: int = 1, max_response_length: int = 0, needs_reference: bool = False,
                rollout_engine: str = "sglang",
                rollout_mode: str = "colocate", rollout_tp: int = 1, gpu_memory_utilization: float = 0.85,
                speculative: bool = False, max_seq_len: int, rollout_sequences: int = 1,
                gpu_memory: int = 80 * GIB, overhead: int = 4 * GIB, bias_activation_fusion: bool = True,
                gradient_accumulation_fusion: bool = True, offload_optimizer: bool = False,
                router_replay: str = "off") -> MemoryPlan:
    """The memory plan (module docstring for every formula). Sizes in bytes.

    sequence_parallel None means on whenever TP > 1, as models/builder.py resolves it. The two fusion
    flags default to what Transformer Engine runs (`models.fusions.resolve_fusions("te", ...)`).
    """
    etp = etp or tp
    if sequence_parallel is None:
        sequence_parallel = tp > 1
    if world_size % (tp * pp * cp) or world_size % (ep * etp * pp):
        raise ValueError(f"world_size={world_size} is not divisible by TP*PP*CP = {tp * pp * cp} "
                         f"and EP*ETP*PP = {ep * etp * pp}")
    if params_dtype not in ("bf16", "fp32"):
        raise ValueError(f"params_dtype must be 'bf16' or 'fp32', got {params_dtype!r}")
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    if rollout_engine not in ("sglang", "local") or rollout_mode not in ("colocate", "disaggregate"):
        raise ValueError(f"unknown rollout engine/mode {rollout_engine!r}/{rollout_mode!r}")
    dp, expert_dp = world_size // (tp * pp * cp), world_size // (ep * etp * pp)
    p_bytes = 2 if params_dtype == "bf16" else 4
    g_bytes = 4 if (grad_reduce_in_fp32 or params_dtype == "fp32") else 2
    opt_bytes = 8 if params_dtype == "fp32" else 12         # m + v (+ fp32 master copy of bf16 params)
    tokens = math.ceil(max_tokens_per_microbatch / cp)
    pattern = arch.moe_layer_pattern()
    h = arch.hidden_size
    lm_head = tokens * (2 * p_bytes * h + LM_HEAD_STATS_BYTES) + max(
        LM_HEAD_SCRATCH_BYTES, tokens * p_bytes * h if sequence_parallel and tp > 1 else 0)
    batch_tokens = logprob_rows * max_response_length
    logprobs = 4 * LOGPROB_STATS * (2 * batch_tokens + math.ceil(batch_tokens / dp))

    def per_layer(i: int) -> float:
        return layer_activation_bytes_per_token(arch, moe=bool(pattern[i]), tp=tp, etp=etp,
                                                sequence_parallel=sequence_parallel, act_bytes=p_bytes,
                                                bias_activation_fusion=bias_activation_fusion)

    def train_memory(rank: RankParams) -> dict:
        n = rank.dense + rank.expert
        layer_ids = list(rank.layers) + [arch.num_layers - 1] * rank.mtp_layers   # MTP ~ a last layer
        full = [per_layer(i) for i in layer_ids]
        if recompute == "full":     # each layer's input, plus one layer's full set while recomputed
            stored = len(full) * p_bytes * arch.hidden_size / (tp if sequence_parallel else 1)
            working = max(full, default=0.0)
        else:
            stored, working = sum(full), 0.0
        flight = in_flight_microbatches(pp=pp, vpp=vpp, pp_rank=rank.pp_rank)
        opt_dist = (math.ceil(rank.dense * opt_bytes / (dp * cp))
                    + math.ceil(rank.expert * opt_bytes / expert_dp))
        last = rank.pp_rank == pp - 1
        m = dict(rank=rank, n=n, params=n * p_bytes, grads=n * g_bytes, opt_dist=opt_dist,
                 opt_repl=n * opt_bytes, optimizer=opt_dist if use_distributed_optimizer else n * opt_bytes,
                 reference=n * p_bytes if needs_reference else 0, flight=flight,
                 activations=math.ceil(tokens * (stored * flight + working)),
                 lm_head=lm_head if last else 0, logprobs=logprobs if last else 0,
                 wgrad=0 if gradient_accumulation_fusion else p_bytes * largest_linear_weight(
                     arch, tp=tp, etp=etp, last_stage=last))
        m["resident"] = m["params"] + m["grads"] + m["optimizer"] + m["reference"]
        # The unfused weight gradient is a backward transient, alive with the activations.
        m["peak"] = m["resident"] + max(m["activations"] + m["lm_head"] + m["wgrad"], m["logprobs"]) + overhead
        return m

    ranks = [train_memory(r) for r in count_shards(arch, tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp)]
    # routing records (router replay): the pipeline stage with the most MoE layers
    replay_layers = max(sum(bool(pattern[i]) for i in m["rank"].layers) for m in ranks)
    id_bytes = expert_id_dtype(arch.num_moe_experts or 0).itemsize
    busiest = max(ranks, key=lambda m: m["peak"])
    colocated = rollout_engine == "sglang" and rollout_mode == "colocate"
    master = 4 / opt_bytes if params_dtype == "bf16" else 0.0      # the fp32 master copy's share of the optimizer
    # The KV pool is smallest where most stays resident.
    at_rollout = max(m["params"] + m["grads"] + (0 if offload_optimizer else m["optimizer"]) + m["reference"]
                     for m in ranks) + overhead if colocated else 0
    at_launch = max(m["params"] + m["grads"] + math.ceil(m["optimizer"] * master) + m["reference"]
                    for m in ranks) + overhead if colocated else 0

    total = sum(r.dense for r in count_shards(arch)) + sum(r.expert for r in count_shards(arch))
    kv_layers = arch.num_layers + (arch.mtp_num_layers if speculative else 0)
    if rollout_engine == "sglang":
        weights = math.ceil(2 * total / rollout_tp)
        per_token = 2 * kv_layers * math.ceil(arch.num_query_groups / rollout_tp) * arch.head_dim * 2
        reserved = int(gpu_memory_utilization * gpu_memory)
        kv_at_launch = reserved - weights - at_launch
        # The cap only lowers SGLang's own sizing (an offloaded optimizer cannot raise the pool above it).
        kv = min(reserved - weights - at_rollout, kv_at_launch)
        rollout_peak = max(reserved, weights + at_rollout)
        rollout_tp_used = rollout_tp
    else:   # the actor's model samples: no second copy of the weights, a KV cache for every sequence
        weights, reserved, rollout_tp_used = 0, 0, tp
        per_token = 2 * kv_layers * math.ceil(arch.num_query_groups / tp) * arch.head_dim * p_bytes
        kv = kv_at_launch = rollout_sequences * max_seq_len * per_token
        rollout_peak = max(m["resident"] for m in ranks) + kv + overhead
    return MemoryPlan(
        arch_name=arch.name, params_total=total, world_size=world_size, tp=tp, pp=pp, cp=cp, dp=dp, ep=ep,
        etp=etp, expert_dp=expert_dp, gpu_memory=gpu_memory, overhead=overhead,
        pp_rank=busiest["rank"].pp_rank, params_per_gpu=busiest["n"], params_dtype=params_dtype,
        actor_params=busiest["params"], actor_grads=busiest["grads"], actor_optimizer=busiest["optimizer"],
        actor_optimizer_distributed=busiest["opt_dist"], actor_optimizer_replicated=busiest["opt_repl"],
        use_distributed_optimizer=use_distributed_optimizer, actor_activations=busiest["activations"],
        actor_lm_head=busiest["lm_head"], actor_logprobs=busiest["logprobs"], actor_wgrad=busiest["wgrad"],
        reference_params=busiest["reference"], train_peak=busiest["peak"],
        rollout_engine=rollout_engine, rollout_mode=rollout_mode, rollout_tp=rollout_tp_used,
        rollout_weights=weights, rollout_kv_cache=kv, rollout_kv_tokens=max(kv, 0) // per_token,
        rollout_kv_cache_at_launch=kv_at_launch, rollout_kv_tokens_at_launch=max(kv_at_launch, 0) // per_token,
        trainer_at_rollout=at_rollout, trainer_at_launch=at_launch, offload_optimizer=offload_optimizer,
        rollout_reserved=reserved, rollout_peak=rollout_peak, max_seq_len=max_seq_len,
        micro_batch_tokens=tokens, recompute=recompute, in_flight=busiest["flight"],
        router_replay_host=replay_layers * math.ceil(logprob_rows / dp) * max_seq_len * (arch.moe_router_topk or 0)
        * id_bytes if router_replay != "off" else 0,
        router_replay_layers=replay_layers if router_replay != "off" else 0,
        router_replay_rank0=sum(pattern) * logprob_rows * max_seq_len * (arch.moe_router_topk or 0)
        * id_bytes if router_replay == "r3" else 0,
        router_replay_received=sum(pattern) * math.ceil(logprob_rows / dp) * max_seq_len
        * (arch.moe_router_topk or 0) * id_bytes if router_replay == "r3" else 0)


def plan_from_config(cfg, *, arch: ModelArch | None = None, gpu_memory_gib: float = 80.0,
                     overhead_gib: float = 4.0, backend: str = "te") -> MemoryPlan:
    """The plan of a resolved Config (every field the plan reads is passed by keyword here).

    arch: the model the trainer built (`models.config_arch.model_arch`); None resolves it the same way,
    with the tokenizer's vocabulary for the tiny presets. backend: the layer spec the GPUs run ("te"
    with Transformer Engine), which sets the fusions the model.* keys leave at null.
    """
    from megatron_dapo.models.fusions import FUSIONS, resolve_fusions

    if arch is None:
        from megatron_dapo.data.tokenizer import load_tokenizer
        from megatron_dapo.models.config_arch import model_arch

        vocab = load_tokenizer(cfg.data.tokenizer).vocab_size if cfg.model.arch in ("tiny", "tiny_moe") else 0
        arch = model_arch(cfg, vocab_size=vocab)
    fusions = resolve_fusions(backend, arch=arch, main_grad=True, **{k: getattr(cfg.model, k) for k in FUSIONS})
    par = cfg.parallel
    return plan_memory(
        arch, world_size=cfg.trainer.world_size, tp=par.tensor_model_parallel_size,
        pp=par.pipeline_model_parallel_size, cp=par.context_parallel_size, ep=par.expert_model_parallel_size,
        etp=par.expert_tensor_parallel_size, vpp=par.virtual_pipeline_model_parallel_size,
        sequence_parallel=par.sequence_parallel, params_dtype=cfg.model.params_dtype,
        # None = the CUDA default of workers/build.py (on); this plan is for GPUs.
        use_distributed_optimizer=cfg.actor.use_distributed_optimizer is not False,
        grad_reduce_in_fp32=True,                      # workers/build.py: DistributedDataParallelConfig
        max_tokens_per_microbatch=cfg.actor.max_tokens_per_microbatch, recompute=cfg.model.recompute,
        logprob_rows=cfg.data.train_batch_size * cfg.rollout.n, max_response_length=cfg.data.max_response_length,
        needs_reference=cfg.needs_reference,
        rollout_engine=cfg.rollout.engine, rollout_mode=cfg.rollout.mode,
        rollout_tp=cfg.rollout.tensor_model_parallel_size,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        speculative=cfg.rollout.speculative.algorithm is not None,
        max_seq_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
        rollout_sequences=cfg.data.effective_gen_batch_size * cfg.rollout.n,
        gpu_memory=int(gpu_memory_gib * GIB), overhead=int(overhead_gib * GIB),
        bias_activation_fusion=fusions["bias_activation_fusion"],
        gradient_accumulation_fusion=fusions["gradient_accumulation_fusion"],
        offload_optimizer=cfg.actor.offload_optimizer, router_replay=cfg.actor.router_replay)


# --- verdict and table -------------------------------------------------------------------------

def _g(x: float) -> str:
    return f"{x / GIB:.2f} GiB"


def check_fits(plan: MemoryPlan, *, host: HostPlan | None = None) -> None:
    """Raise ValueError naming every component that does not fit, with its numbers (host: the host memory
    plan of rank 0's node, plan/host.py, checked too when given)."""
    problems = []
    if host is not None and (problem := check_host(host)):
        problems.append(problem)
    if plan.train_peak > plan.gpu_memory:
        problems.append(
            f"actor training (pipeline rank {plan.pp_rank}) needs {_g(plan.train_peak)} > GPU "
            f"{_g(plan.gpu_memory)}: params {_g(plan.actor_params)} + grads {_g(plan.actor_grads)} + "
            f"optimizer {_g(plan.actor_optimizer)} + reference {_g(plan.reference_params)} + max(activations "
            f"{_g(plan.actor_activations)} + LM head {_g(plan.actor_lm_head)} + wgrad {_g(plan.actor_wgrad)}, "
            f"log-probs {_g(plan.actor_logprobs)}) + "
            f"overhead {_g(plan.overhead)}")
    if plan.rollout_engine == "sglang":
        if plan.rollout_kv_tokens < plan.max_seq_len:
            problems.append(
                f"rollout KV cache holds {plan.rollout_kv_tokens} tokens < one sequence of "
                f"{plan.max_seq_len}: "
                f"gpu_memory_utilization share {_g(plan.rollout_reserved)} - weights "
                f"{_g(plan.rollout_weights)} (rollout TP {plan.rollout_tp}) - trainer resident during rollout "
                f"{_g(plan.trainer_at_rollout)} = {_g(plan.rollout_kv_cache)}")
    elif plan.rollout_peak > plan.gpu_memory:
        problems.append(
            f"rollout (local engine) needs {_g(plan.rollout_peak)} > GPU {_g(plan.gpu_memory)}: training "
            f"state {_g(plan.resident_train_state)} + KV cache {_g(plan.rollout_kv_cache)} + overhead "
            f"{_g(plan.overhead)}")
    if problems:
        raise ValueError("configuration does not fit: " + "; ".join(problems))


def format_plan(plan: MemoryPlan) -> str:
    """A table of the plan, one component per line."""
    experts = f" / expert DP = {plan.expert_dp}" if plan.ep > 1 else ""
    opt_kind = (f"distributed over DP x CP = {plan.dp * plan.cp}{experts}" if plan.use_distributed_optimizer
                else "replicated")
    rows = [
        ("actor params", plan.actor_params,
         f"{plan.params_per_gpu / 1e9:.3f} B params ({plan.params_dtype}) on pipeline rank {plan.pp_rank}"),
        ("actor grads", plan.actor_grads, "grad buffer, fp32 (grad_reduce_in_fp32)"),
        ("actor optimizer", plan.actor_optimizer,
         f"Adam, {opt_kind}; distributed {_g(plan.actor_optimizer_distributed)}, "
         f"replicated {_g(plan.actor_optimizer_replicated)}"),
        ("actor activations", plan.actor_activations,
         f"recompute {plan.recompute}, {plan.micro_batch_tokens} tokens per micro-batch, "
         f"{plan.in_flight:g} in flight"),
        ("actor LM head", plan.actor_lm_head,
         "fused log-prob kernel at real response tokens, last stage" if plan.actor_lm_head else "not on this stage"),
        ("actor log-probs", plan.actor_logprobs,
         "compute_log_prob's gathered statistics (worst case; after the pass, not with activations)"),
        ("actor wgrad", plan.actor_wgrad,
         "unfused: largest linear weight's gradient" if plan.actor_wgrad else "gradient_accumulation_fusion"),
        ("reference params", plan.reference_params,
         "frozen copy" if plan.reference_params else "no KL term: none"),
        ("overhead", plan.overhead, "CUDA context, NCCL, fragmentation (--overhead-gb)"),
        ("= training peak", plan.train_peak, ""),
    ]
    if plan.rollout_engine == "sglang":
        rows += [("rollout weights", plan.rollout_weights, f"SGLang, bf16, TP {plan.rollout_tp}")]
        if plan.rollout_mode == "colocate":
            optimizer = "optimizer on the host (offload_optimizer)" if plan.offload_optimizer else "optimizer"
            rows += [("trainer at rollout", plan.trainer_at_rollout,
                      f"steady state after empty_cache: params, grads, {optimizer}, reference, overhead")]
        rows += [
            ("rollout KV cache", plan.rollout_kv_cache,
             f"{plan.rollout_kv_tokens:,} tokens (one sequence: {plan.max_seq_len:,})"
             + ("; the launch caps the pool at this (--max-total-tokens)" if plan.rollout_mode == "colocate" else "")),
        ]
        if plan.rollout_mode == "colocate":
            rows += [("  unplanned at launch", plan.rollout_kv_cache_at_launch,
                      f"{plan.rollout_kv_tokens_at_launch:,} tokens: the pool SGLang would size before the first "
                      f"optimizer step (trainer {_g(plan.trainer_at_launch)})")]
        rows += [("rollout reserved", plan.rollout_reserved, f"gpu_memory_utilization x GPU, {plan.rollout_mode}")]
    else:
        rows += [("rollout KV cache", plan.rollout_kv_cache,
                  f"local engine, {plan.rollout_kv_tokens:,} tokens")]
    rows += [("= rollout peak", plan.rollout_peak, "")]
    peak_note = ("colocate: max(training, rollout)" if plan.rollout_mode == "colocate"
                 else "disaggregate: training and rollout GPUs separately")
    rows += [("= peak per GPU", plan.peak, f"{peak_note}; GPU {_g(plan.gpu_memory)}")]
    if plan.router_replay_host:
        rows += [("host: routing", plan.router_replay_host,
                  f"router replay records per rank (host memory): rows / DP {plan.dp} x {plan.max_seq_len:,} "
                  f"tokens at most x {plan.router_replay_layers} MoE layers x top-k")]
    if plan.router_replay_rank0:
        rows += [("host: r3 at rank 0", plan.router_replay_rank0,
                  f"the routing of the rows one step trains as SGLang sent it, at {plan.max_seq_len:,} tokens at "
                  "most (the other groups' is released as rank 0 scores them)")]
    head = (f"memory plan: {plan.arch_name}, {plan.params_total / 1e9:.2f} B params; {plan.world_size} GPUs "
            f"= TP {plan.tp} x PP {plan.pp} x CP {plan.cp} x DP {plan.dp} (EP {plan.ep}, ETP {plan.etp}, "
            f"expert DP {plan.expert_dp})")
    lines = [head, f"{'component':<20} {'GiB':>9}  notes"]
    lines += [f"{name:<20} {value / GIB:>9.2f}  {note}".rstrip() for name, value, note in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    usage = __doc__.split("\n\nParameters (exact", 1)[0]  # the derivation stays in the source, not in --help
    p = argparse.ArgumentParser(prog="python -m megatron_dapo.plan", formatter_class=argparse.RawDescriptionHelpFormatter,
                                description=usage + "\n\nHow each term is counted: the docstring of "
                                                    "megatron_dapo/plan/memory.py and docs/models-and-parallelism.md.")
    p.add_argument("--config", default=None, help="YAML recipe (configs/*.yaml)")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory per GPU in GiB (default 80)")
    p.add_argument("--overhead-gb", type=float, default=4.0, help="reserve for CUDA/NCCL/fragmentation, GiB")
    p.add_argument("--backend", choices=("te", "local"), default="te",
                   help="layer spec of the GPUs: te (Transformer Engine, the fusions' default on) or local")
    p.add_argument("--mean-response-tokens", type=int, default=None,
                   help="plan host memory at this response length (default: every response at max_response_length)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(argv)
    from megatron_dapo.config import ConfigError, load_config_cli

    cfg = load_config_cli(args.config, args.overrides)
    if cfg is None:
        return 2
    try:
        plan = plan_from_config(cfg, gpu_memory_gib=args.gpu_memory_gb, overhead_gib=args.overhead_gb,
                                backend=args.backend)
    except ConfigError as e:      # a fusion the chosen backend cannot run
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    host = plan_host(cfg, memory_plan=plan, response_tokens=args.mean_response_tokens)
    print(format_host(host))
    if cfg.rollout.engine == "sglang":
        from megatron_dapo.models.config_arch import model_arch
        from megatron_dapo.plan.weights import format_weight_sync, plan_weight_sync_from_config

        print(format_weight_sync(plan_weight_sync_from_config(cfg, arch=model_arch(cfg, vocab_size=0))))
    try:
        check_fits(plan, host=host)
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 1
    print("fits")
    return 0
