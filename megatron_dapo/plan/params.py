"""Parameters per GPU of a parallel layout: the counting half of the memory planner
(megatron_dapo/plan/memory.py), shared with the weight-sync traffic plan (megatron_dapo/plan/weights.py).
Closed forms per layer from the architecture; tested against Megatron's own parameter counts."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_dapo.models.arch import ModelArch

# --- parameters --------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankParams:
    """Parameters held by one GPU of pipeline rank `pp_rank` (interleaved stages included)."""

    pp_rank: int
    dense: int
    """Non-expert parameters (their optimizer state is sharded over DP x CP)."""
    expert: int
    """Expert parameters (optimizer state sharded over the expert-data-parallel group)."""
    layers: tuple[int, ...]
    """Decoder layer indices on this rank."""
    mtp_layers: int
    """MTP layers on this rank (the last stage holds them)."""


def _mlp(arch: ModelArch, ffn: int) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of one MLP with intermediate size ffn."""
    h, n_in = arch.hidden_size, (2 * ffn if arch.swiglu else ffn)
    bias = arch.add_bias_linear
    return h * n_in + ffn * h + (n_in if bias else 0), (h if bias else 0)


def _attention(arch: ModelArch) -> tuple[int, int]:
    h, hd = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * hd, arch.num_query_groups * hd
    sharded = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if (arch.add_qkv_bias or arch.add_bias_linear) else 0)
    replicated = (h if arch.add_bias_linear else 0) + (2 * hd if arch.qk_layernorm else 0)
    return sharded, replicated


def _norm(arch: ModelArch) -> int:
    return arch.hidden_size * (2 if arch.normalization == "LayerNorm" else 1)


def layer_params(arch: ModelArch, *, moe: bool, tp: int, ep: int, etp: int) -> tuple[int, int]:
    """(dense, expert) parameters of one decoder layer on one GPU."""
    attn_s, attn_r = _attention(arch)
    dense = math.ceil(attn_s / tp) + attn_r + 2 * _norm(arch)
    if not moe:
        mlp_s, mlp_r = _mlp(arch, arch.ffn_hidden_size)
        return dense + math.ceil(mlp_s / tp) + mlp_r, 0
    dense += arch.hidden_size * arch.num_moe_experts                      # router, replicated
    if arch.moe_shared_expert_intermediate_size:
        sh_s, sh_r = _mlp(arch, arch.moe_shared_expert_intermediate_size)
        dense += math.ceil(sh_s / tp) + sh_r
    ex_s, ex_r = _mlp(arch, arch.moe_ffn_hidden_size)
    return dense, math.ceil(arch.num_moe_experts / ep) * (math.ceil(ex_s / etp) + ex_r)


def layers_of_rank(num_layers: int, *, pp: int, vpp: int | None, pp_rank: int) -> tuple[int, ...]:
    """Decoder layer indices held by pipeline rank pp_rank (virtual stages round robin)."""
    chunks = vpp or 1
    if num_layers % (pp * chunks):
        raise ValueError(f"num_layers={num_layers} is not divisible by PP*VPP = {pp}*{chunks}")
    per_stage = num_layers // (pp * chunks)
    stages = [c * pp + pp_rank for c in range(chunks)]
    return tuple(i for s in stages for i in range(s * per_stage, (s + 1) * per_stage))


def count_shards(arch: ModelArch, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
                 vpp: int | None = None) -> list[RankParams]:
    """Parameters per GPU for each pipeline rank."""
    etp = etp or tp
    pattern = arch.moe_layer_pattern()
    h, vocab = arch.hidden_size, math.ceil(arch.vocab_size / tp)
    out = []
    for r in range(pp):
        layers = layers_of_rank(arch.num_layers, pp=pp, vpp=vpp, pp_rank=r)
        dense = expert = 0
        for i in layers:
            d, e = layer_params(arch, moe=bool(pattern[i]), tp=tp, ep=ep, etp=etp)
            dense, expert = dense + d, expert + e
        if r == 0:
            dense += vocab * h                                              # input embedding
        mtp = 0
        if r == pp - 1:
            # Output layer: its own weight when untied; a tied model's last stage keeps a copy when PP > 1.
            if arch.untie_embeddings_and_output_weights or pp > 1:
                dense += vocab * h
            dense += _norm(arch)                                            # final norm
            mtp = arch.mtp_num_layers
            d, e = layer_params(arch, moe=bool(pattern[-1]), tp=tp, ep=ep, etp=etp)
            # MTP layer: enorm + hnorm + its final norm, eh_proj [h, 2h] (column parallel), one layer.
            dense += mtp * (3 * _norm(arch) + math.ceil(2 * h * h / tp) + d)
            expert += mtp * e
        out.append(RankParams(pp_rank=r, dense=dense, expert=expert, layers=layers, mtp_layers=mtp))
    return out
