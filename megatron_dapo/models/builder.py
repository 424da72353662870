"""Build Megatron-Core GPT models from a `ModelArch`.

Three small ordered functions:

    config = build_transformer_config(arch, params_dtype=..., tp=..., pp=..., ep=..., device=...)
    specs  = layer_spec(arch, backend="local" | "te", config=config, pp_rank=..., vp_stage=...)
    model  = build_gpt_model(arch, pgs=pgs, ...)          # does both, seeds, returns the model

`layer_spec` is the only place where the CPU and GPU paths differ (STYLE rule 9): "te" uses
Megatron's Transformer-Engine spec (fused norm+linear, TE attention, grouped-GEMM experts);
"local" uses Megatron's plain-torch spec with `TorchNorm` in place of every norm, which keeps
sequence parallelism working without Apex. `default_backend(device)` picks "te" on CUDA when
`transformer_engine` imports, else "local".

Tensor layout: Megatron works in [s, b, h] inside the model; `GPTModel.forward` takes
input_ids / position_ids [b, s] and returns logits [b, s, V / tp] (vocab-sharded when
parallel_output=True, the default), or per-token CE loss [b, s] when labels are given.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import NamedTuple

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron_dapo.models.arch import ModelArch, check_layout
from megatron_dapo.models.fusions import resolve_fusions

__all__ = ["build_transformer_config", "layer_spec", "build_gpt_model", "build_gpt_model_chunks",
           "default_backend", "LayerSpecs", "TorchNorm", "CausalGPTModel"]


def default_backend(device: str | torch.device) -> str:
    """"te" on CUDA when transformer_engine is importable, else "local"."""
    if torch.device(device).type == "cuda" and importlib.util.find_spec("transformer_engine"):
        return "te"
    return "local"


def build_transformer_config(
    arch: ModelArch, *, params_dtype: torch.dtype = torch.float32, tp: int = 1, pp: int = 1,
    ep: int = 1, cp: int = 1, etp: int | None = None, vpp: int | None = None,
    sequence_parallel: bool | None = None, device: str | torch.device = "cpu",
    backend: str | None = None, moe_token_dispatcher_type: str = "alltoall",
    init_weights: bool = True, overrides: dict | None = None,
) -> TransformerConfig:
    """The Megatron TransformerConfig for `arch` at the given parallel sizes.

    sequence_parallel: None means on whenever tp > 1 (required by Megatron for MoE with TP).
    init_weights=False skips random initialisation (weights will be loaded).
    Fusions default per backend (`models.fusions.resolve_fusions`: on with "te", off with "local").
    overrides: extra TransformerConfig fields (recompute, fusions, ...), applied last.
    Raises ValueError for layouts the architecture cannot be split into.
    """
    device = torch.device(device)
    backend = backend or default_backend(device)
    if backend not in ("local", "te"):
        raise ValueError(f"backend must be 'local' or 'te', got {backend!r}")
    check_layout(arch, tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp)
    if sequence_parallel is None:
        sequence_parallel = tp > 1
    if arch.is_moe and tp > 1 and not sequence_parallel:
        raise ValueError("MoE with tensor parallelism requires sequence_parallel=True (Megatron rule)")
    if arch.is_moe and arch.add_bias_linear and backend == "local":
        # SequentialMLP adds the expert bias in place on a view (mlp.py:247): "Output 0 of
        # _ReduceFromModelParallelRegion is a view and is being modified inplace".
        raise ValueError("MoE models need add_bias_linear=False with the local layer spec")
    fp = {"bf16": params_dtype == torch.bfloat16, "fp16": params_dtype == torch.float16}
    kwargs = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size, num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups, kv_channels=arch.head_dim,
        normalization=arch.normalization, layernorm_epsilon=arch.norm_epsilon,
        gated_linear_unit=arch.swiglu, activation_func=F.silu if arch.swiglu else F.gelu,
        add_bias_linear=arch.add_bias_linear, add_qkv_bias=arch.add_qkv_bias,
        qk_layernorm=arch.qk_layernorm, init_method_std=arch.init_method_std,
        # RL needs log-probs that do not depend on a dropout draw.
        hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=params_dtype, pipeline_dtype=params_dtype, **fp,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=tp if etp is None else etp,
        sequence_parallel=sequence_parallel,
        # On CPU the master weight is drawn on every rank and sliced, so a TP=2 model starts
        # identical to the TP=1 model of the same seed.
        use_cpu_initialization=device.type == "cpu", perform_initialization=init_weights,
        # Interleaved PP with batched p2p pairs the two sends to one peer in the wrong order on
        # gloo: no error, wrong gradients from microbatch 3 on (notes, PP section).
        batch_p2p_comm=vpp is None,
        # Megatron's fusions: on with TE, off with the local spec (models/fusions.py). A bare model has
        # no DDP main_grad, so gradient_accumulation_fusion stays off here; build_actor's overrides
        # turn it on and apply the model.* keys.
        **resolve_fusions(backend, arch=arch, device_type=device.type),
        mtp_num_layers=arch.mtp_num_layers or None,
        # Set for dense models too: Megatron's default ("allgather") refuses variable_seq_lengths,
        # which pipeline parallelism with token-budget micro-batches needs, even without experts.
        moe_token_dispatcher_type=moe_token_dispatcher_type,
    )
    if arch.is_moe:
        kwargs.update(
            num_moe_experts=arch.num_moe_experts, moe_router_topk=arch.moe_router_topk,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=arch.moe_shared_expert_intermediate_size,
            moe_aux_loss_coeff=arch.moe_aux_loss_coeff,
            moe_router_load_balancing_type="aux_loss" if arch.moe_aux_loss_coeff else "none",
            # Top-k on logits then softmax over the k == softmax, top-k, renormalise.
            moe_router_pre_softmax=not arch.moe_norm_topk_prob,
            moe_router_dtype="fp32",
            # GroupedMLP needs the CUDA-only grouped_gemm package; TE has its own grouped GEMM.
            moe_grouped_gemm=backend == "te",
            moe_layer_freq=list(arch.moe_layer_freq) if isinstance(arch.moe_layer_freq, tuple)
            else arch.moe_layer_freq,
        )
    kwargs.update(overrides or {})
    return TransformerConfig(**kwargs)


class TorchNorm:
    """Local-spec norm: torch.nn.RMSNorm / LayerNorm in params_dtype.

    Megatron's WrappedTorchNorm asserts `not sequence_parallel`. With SP each TP rank normalises
    a different slice of the sequence, so the weight gradients differ per rank; tagging the
    params `.sequence_parallel` makes `finalize_model_grads` all-reduce them over TP.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


class LayerSpecs(NamedTuple):
    decoder: object
    """TransformerBlockSubmodules of this pipeline stage's layers."""
    mtp: object | None
    """MultiTokenPredictionBlockSubmodules on the stage that holds the MTP layers, else None."""


def layer_spec(arch: ModelArch, backend: str = "local", *, config, pp_rank: int = 0,
               vp_stage: int | None = None) -> LayerSpecs:
    """Megatron module specs for one pipeline stage (or virtual stage) of `arch`."""
    if backend == "te" and not importlib.util.find_spec("transformer_engine"):
        raise ValueError("backend='te' needs transformer_engine, which is not importable")
    if backend not in ("local", "te"):
        raise ValueError(f"backend must be 'local' or 'te', got {backend!r}")
    use_te = backend == "te"
    decoder = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                         normalization=arch.normalization, vp_stage=vp_stage,
                                         pp_rank=pp_rank)
    mtp = None
    last_stage = pp_rank == config.pipeline_model_parallel_size - 1 and (
        vp_stage is None or vp_stage == config.virtual_pipeline_model_parallel_size - 1)
    if arch.mtp_num_layers and last_stage:       # all MTP layers sit on the last stage
        mtp = get_gpt_mtp_block_spec(config, decoder, use_transformer_engine=use_te,
                                     vp_stage=vp_stage, pp_rank=pp_rank)
    if not use_te:
        decoder, mtp = _swap_norms(decoder), _swap_norms(mtp)
    return LayerSpecs(decoder, mtp)


def _swap_norms(spec):
    """Replace Megatron's local norm classes by TorchNorm everywhere inside a spec tree."""
    local_norms = {WrappedTorchNorm}
    try:
        from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
        local_norms.add(FusedLayerNorm)
    except ImportError:
        pass
    if isinstance(spec, type):
        return TorchNorm if spec in local_norms else spec
    if isinstance(spec, (list, tuple)):
        return type(spec)(_swap_norms(s) for s in spec)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: _swap_norms(getattr(spec, f.name)) for f in dataclasses.fields(spec)
                   if f.init}
        return dataclasses.replace(spec, **changes)
    return spec


class CausalGPTModel(GPTModel):
    """GPTModel whose attention_mask defaults to None, i.e. causal (Megatron's default mask for
    attn_mask_type=causal). Nothing else differs: forward(input_ids [b, s], position_ids [b, s],
    attention_mask=None, ...) -> logits [b, s, V/tp], or CE loss [b, s] when labels are given."""

    def forward(self, input_ids, position_ids, attention_mask=None, *args, **kwargs):
        return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)


def build_gpt_model(
    arch: ModelArch, *, pgs, params_dtype: torch.dtype = torch.float32,
    pre_process: bool | None = None, post_process: bool | None = None,
    device: str | torch.device | None = None, seed: int | None = 1234, backend: str | None = None,
    vp_stage: int | None = None, parallel_output: bool = True, init_weights: bool = True,
    sequence_parallel: bool | None = None, moe_token_dispatcher_type: str = "alltoall",
    config_overrides: dict | None = None,
):
    """Build this rank's GPTModel (one pipeline stage, or one virtual stage `vp_stage`).

    pgs: parallel.ParallelGroups. device: defaults to pgs.device. seed: re-seeds torch
    and Megatron's RNG tracker before building (None keeps the current RNG state); with
    use_cpu_initialization (CPU) the same seed gives the same weights at any TP size.
    pre_process / post_process default to "this is the first / last (virtual) stage".
    Returns a CausalGPTModel (a GPTModel whose attention_mask defaults to causal).
    """
    from megatron_dapo.parallel import seed_parallel_rng

    device = torch.device(device) if device is not None else pgs.device
    backend = backend or default_backend(device)
    vpp = pgs.vpp_size
    if (vpp is None) != (vp_stage is None) or (vpp is not None and not 0 <= vp_stage < vpp):
        raise ValueError(f"vp_stage={vp_stage} does not fit pgs.vpp_size={vpp}")
    config = build_transformer_config(
        arch, params_dtype=params_dtype, tp=pgs.tp_size, pp=pgs.pp_size, ep=pgs.ep_size,
        cp=pgs.cp_size, etp=pgs.etp_size, vpp=vpp, sequence_parallel=sequence_parallel,
        device=device, backend=backend, moe_token_dispatcher_type=moe_token_dispatcher_type,
        init_weights=init_weights, overrides=config_overrides)
    specs = layer_spec(arch, backend, config=config, pp_rank=pgs.pp_rank, vp_stage=vp_stage)
    first_chunk = vp_stage is None or vp_stage == 0
    last_chunk = vp_stage is None or vp_stage == vpp - 1
    if pre_process is None:
        pre_process = pgs.is_first_pp_stage and first_chunk
    if post_process is None:
        post_process = pgs.is_last_pp_stage and last_chunk
    if seed is not None:
        seed_parallel_rng(pgs, seed)
    if arch.is_moe:
        # Megatron's process-global MoE aux-loss logging tracker is sized by the first model's
        # layer count; a later model with more layers (e.g. +MTP) would index past its end.
        get_moe_layer_wise_logging_tracker().clear()
    model = CausalGPTModel(
        config=config, transformer_layer_spec=specs.decoder, vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings, pre_process=pre_process,
        post_process=post_process, parallel_output=parallel_output,
        share_embeddings_and_output_weights=not arch.untie_embeddings_and_output_weights,
        position_embedding_type="rope", rotary_base=arch.rotary_base, mtp_block_spec=specs.mtp,
        pg_collection=pgs.collection, vp_stage=vp_stage)
    return model.to(device)


def build_gpt_model_chunks(arch: ModelArch, *, pgs, seed: int | None = 1234, **kwargs) -> list:
    """All model chunks of this rank: one per virtual stage (a list of one without VPP)."""
    if pgs.vpp_size is None:
        return [build_gpt_model(arch, pgs=pgs, seed=seed, **kwargs)]
    chunks = [build_gpt_model(arch, pgs=pgs, seed=seed if i == 0 else None, vp_stage=i, **kwargs)
              for i in range(pgs.vpp_size)]
    return chunks
