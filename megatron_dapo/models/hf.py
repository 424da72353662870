"""HF <-> Megatron weights for Qwen2 / Qwen2.5 (dense), Qwen3 (dense) and Qwen3-MoE.

Layers of the mapping (all pure, tensor-by-tensor, on the safetensors checkpoint layout):

- `arch_from_hf_config(config)` / `hf_config_from_arch(arch)`: config.json <-> ModelArch.
- `canonical_param_names(arch)`: the names of the world-1 Megatron state (see weights.py).
- `hf_sources(name, arch)`: which HF tensors make one canonical Megatron tensor, and how:
    "copy"  one tensor as is;
    "qkv"   linear_qkv = per KV group g: [q heads of g; k_g; v_g] (rows), from q/k/v_proj;
    "glu"   linear_fc1 = [gate_proj; up_proj] (rows).
  `to_mcore` / `to_hf` apply those transforms both ways; they only permute and concatenate,
  so HF -> Megatron -> HF reproduces every tensor bit for bit.
- `load_hf_as_mcore(hf_dir, ...)`, `load_hf_weights_into(model_or_chunks, hf_dir, pgs=...)`,
  `save_mcore_as_hf(model, out_dir, pgs=..., arch=...)`: the model-level API; TP / PP / EP
  slicing and gathering happen in weights.py.

HF checkpoints are read with safetensors only. Experts are written in the per-expert layout
of the released Qwen3-MoE checkpoints (`mlp.experts.{e}.gate_proj.weight`, ...), which is also
what transformers 5 writes on save_pretrained.

MTP layers (`mtp.layers.0.*`, on the last pipeline stage) take the names SGLang's MTP drafter for
Qwen3-MoE loads (`Qwen3MoeForCausalLMMTP`, sglang/srt/models/qwen3_moe_mtp.py, 0.5.13+; its
`load_weights` is Qwen3MoeForCausalLM's with is_mtp=True: it keeps only names containing "mtp",
strips `mtp.` from the three below and renames `mtp.` to `model.` elsewhere), the Qwen3-Next
checkpoint layout:

    mtp.layers.0.enorm.weight            mtp.pre_fc_norm_embedding.weight   (norm of the next token's embedding)
    mtp.layers.0.hnorm.weight            mtp.pre_fc_norm_hidden.weight      (norm of the trunk's hidden state)
    mtp.layers.0.eh_proj.weight [h, 2h]  mtp.fc.weight                      (on cat(embedding, hidden), in that order)
    mtp.layers.0.transformer_layer.X     mtp.layers.0.<X's HF name>         (one decoder layer)
    mtp.layers.0.final_layernorm.weight  mtp.norm.weight

The drafter shares the target's embedding and LM head (SGLang's set_embed_and_head), so these are
all its own tensors. The layout holds one MTP layer: `mtp.layers.{k}` for k >= 1 has no name.
"""

from __future__ import annotations

import json
import logging
import os
import re

import torch
import torch.distributed as dist

from megatron_dapo.models.arch import ModelArch
from megatron_dapo.models.weights import (
    SafetensorsDir,
    ShardedSafetensorsWriter,
    gather_canonical_state,
    gather_stage_state,
    load_canonical_state,
)

__all__ = ["arch_from_hf", "arch_from_hf_config", "hf_config_from_arch", "read_hf_config",
           "canonical_param_names", "hf_sources", "to_mcore", "to_hf", "load_hf_as_mcore",
           "load_hf_weights_into", "iter_hf_tensors", "iter_stage_hf_groups", "mtp_hf_names", "hf_model_type",
           "save_mcore_as_hf", "SUPPORTED_MODEL_TYPES", "MTP_HF_LAYERS"]

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe")
_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM"}


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: not a Hugging Face model directory")
    with open(path) as f:
        return json.load(f)


def _rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"config.json: rope type {rope_type!r} is not supported (only default RoPE)")
    theta = config.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise ValueError("config.json: neither rope_theta nor rope_parameters.rope_theta is set")
    return float(theta)


def arch_from_hf_config(config: dict, *, name: str | None = None) -> ModelArch:
    """ModelArch of a Qwen2 / Qwen3 / Qwen3-MoE config.json (a dict)."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.json: model_type {model_type!r} is not supported; "
                         f"supported: {SUPPORTED_MODEL_TYPES}")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {config['hidden_act']!r} is not supported (silu only)")
    if config.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window=true is not supported")
    heads = config["num_attention_heads"]
    kwargs = dict(
        name=name or config.get("_name_or_path") or model_type,
        num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        ffn_hidden_size=config["intermediate_size"], num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        vocab_size=config["vocab_size"], max_position_embeddings=config["max_position_embeddings"],
        rotary_base=_rope_theta(config), normalization="RMSNorm",
        norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        add_bias_linear=False, swiglu=True,
    )
    # kv_channels None means hidden // heads, so equal architectures compare equal.
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kwargs["kv_channels"] = None if head_dim * heads == config["hidden_size"] else head_dim
    if model_type == "qwen2":
        kwargs.update(add_qkv_bias=True, qk_layernorm=False)
    else:
        kwargs.update(add_qkv_bias=bool(config.get("attention_bias", False)), qk_layernorm=True)
    if model_type == "qwen3_moe":
        experts = config.get("num_experts", config.get("num_local_experts"))
        step, dense_only = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or [])
        pattern = tuple(int(i not in dense_only and (i + 1) % step == 0)
                        for i in range(config["num_hidden_layers"]))
        kwargs.update(
            num_moe_experts=experts, moe_router_topk=config["num_experts_per_tok"],
            moe_ffn_hidden_size=config["moe_intermediate_size"],
            moe_aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)),
            moe_norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            moe_layer_freq=1 if all(pattern) else pattern)
    return ModelArch(**kwargs)


def hf_model_type(arch: ModelArch) -> str:
    """The HF model type (qwen2, qwen3, qwen3_moe) `arch` maps to; ValueError when none does."""
    if arch.add_bias_linear or arch.normalization != "RMSNorm" or not arch.swiglu or arch.moe_shared_expert_intermediate_size:
        raise ValueError(f"{arch.name}: only bias-free RMSNorm SwiGLU models without shared experts "
                         "map to Qwen checkpoints")
    if arch.is_moe:
        if not arch.qk_layernorm:
            raise ValueError(f"{arch.name}: a Qwen3-MoE checkpoint needs qk_layernorm=True")
        return "qwen3_moe"
    if arch.qk_layernorm:
        return "qwen3"
    if not arch.add_qkv_bias:
        raise ValueError(f"{arch.name}: a dense model without QK-norm maps to Qwen2, which has QKV bias")
    return "qwen2"


def hf_config_from_arch(arch: ModelArch, *, base: dict | None = None, dtype: torch.dtype | None = None) -> dict:
    """A config.json dict for `arch`; keys of `base` (e.g. token ids) are kept unless the
    architecture defines them."""
    model_type = hf_model_type(arch)
    config = dict(base or {})
    for stale in ("rope_parameters", "rope_scaling", "num_local_experts", "_name_or_path"):
        config.pop(stale, None)
    config.update(
        architectures=[_ARCHITECTURES[model_type]], model_type=model_type,
        num_hidden_layers=arch.num_layers, hidden_size=arch.hidden_size,
        intermediate_size=arch.ffn_hidden_size, num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_query_groups, head_dim=arch.head_dim,
        vocab_size=arch.vocab_size, max_position_embeddings=arch.max_position_embeddings,
        rope_theta=arch.rotary_base, rope_scaling=None, rms_norm_eps=arch.norm_epsilon,
        hidden_act="silu", tie_word_embeddings=not arch.untie_embeddings_and_output_weights,
        use_sliding_window=False, sliding_window=None)
    if model_type != "qwen2":
        config["attention_bias"] = arch.add_qkv_bias
    if model_type == "qwen3_moe":
        pattern = arch.moe_layer_pattern()
        config.update(num_experts=arch.num_moe_experts, num_experts_per_tok=arch.moe_router_topk,
                      moe_intermediate_size=arch.moe_ffn_hidden_size, decoder_sparse_step=1,
                      mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe],
                      norm_topk_prob=arch.moe_norm_topk_prob,
                      router_aux_loss_coef=arch.moe_aux_loss_coeff)
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        config["torch_dtype"] = name
        if "dtype" in config:          # transformers 5 spelling
            config["dtype"] = name
    return config


def canonical_param_names(arch: ModelArch, *, include_mtp: bool = True) -> list[str]:
    """Names of the world-1 Megatron parameters of `arch`, in model order."""
    def layer(prefix: str, moe: bool) -> list[str]:
        attn = prefix + "self_attention."
        names = [prefix + "input_layernorm.weight", attn + "linear_proj.weight"]
        names += [attn + "linear_proj.bias"] if arch.add_bias_linear else []
        names.append(attn + "linear_qkv.weight")
        if arch.add_qkv_bias or arch.add_bias_linear:
            names.append(attn + "linear_qkv.bias")
        if arch.qk_layernorm:
            names += [attn + "q_layernorm.weight", attn + "k_layernorm.weight"]
        names.append(prefix + "pre_mlp_layernorm.weight")
        mlps = [prefix + f"mlp.experts.local_experts.{e}." for e in range(arch.num_moe_experts)] if moe \
            else [prefix + "mlp."]
        if moe:
            names.append(prefix + "mlp.router.weight")
            if arch.moe_shared_expert_intermediate_size:
                mlps.append(prefix + "mlp.shared_experts.")
        for mlp in mlps:
            for fc in ("linear_fc1.", "linear_fc2."):
                names.append(mlp + fc + "weight")
                names += [mlp + fc + "bias"] if arch.add_bias_linear else []
        if arch.normalization == "LayerNorm":
            names += [n[:-len("weight")] + "bias" for n in names if n.endswith("layernorm.weight")
                      and "q_layernorm" not in n and "k_layernorm" not in n]
        return names

    pattern = arch.moe_layer_pattern()
    names = ["embedding.word_embeddings.weight"]
    for i, moe in enumerate(pattern):
        names += layer(f"decoder.layers.{i}.", bool(moe))
    names.append("decoder.final_layernorm.weight")
    if include_mtp:
        for k in range(arch.mtp_num_layers):
            mtp = f"mtp.layers.{k}."
            names += [mtp + "enorm.weight", mtp + "hnorm.weight", mtp + "eh_proj.weight"]
            names += layer(mtp + "transformer_layer.", bool(pattern[-1]))
            names.append(mtp + "final_layernorm.weight")
    if arch.untie_embeddings_and_output_weights:
        names.append("output_layer.weight")
    return names


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_PER_LAYER = {
    "input_layernorm.weight": ("copy", ["input_layernorm.weight"]),
    "self_attention.linear_qkv.weight": ("qkv", ["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                 "self_attn.v_proj.weight"]),
    "self_attention.linear_qkv.bias": ("qkv", ["self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                               "self_attn.v_proj.bias"]),
    "self_attention.q_layernorm.weight": ("copy", ["self_attn.q_norm.weight"]),
    "self_attention.k_layernorm.weight": ("copy", ["self_attn.k_norm.weight"]),
    "self_attention.linear_proj.weight": ("copy", ["self_attn.o_proj.weight"]),
    "pre_mlp_layernorm.weight": ("copy", ["post_attention_layernorm.weight"]),
    "mlp.linear_fc1.weight": ("glu", ["mlp.gate_proj.weight", "mlp.up_proj.weight"]),
    "mlp.linear_fc2.weight": ("copy", ["mlp.down_proj.weight"]),
    "mlp.router.weight": ("copy", ["mlp.gate.weight"]),
}
_GLOBAL = {
    "embedding.word_embeddings.weight": ("copy", ["model.embed_tokens.weight"]),
    "decoder.final_layernorm.weight": ("copy", ["model.norm.weight"]),
    "output_layer.weight": ("copy", ["lm_head.weight"]),
}
MTP_HF_LAYERS = 1
"""MTP layers the HF / SGLang drafter layout holds (module docstring)."""
_MTP_OWN = {  # the MTP layer's own tensors around its decoder layer (module docstring)
    "enorm.weight": "mtp.pre_fc_norm_embedding.weight",
    "hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
    "eh_proj.weight": "mtp.fc.weight",
    "final_layernorm.weight": "mtp.norm.weight",
}


def _layer_sources(prefix: str, rest: str) -> tuple[str, list[str]] | None:
    """(kind, HF names) of one decoder layer's parameter `rest`, the HF layer prefix prepended."""
    if rest in _PER_LAYER:
        kind, hf_names = _PER_LAYER[rest]
        return kind, [prefix + n for n in hf_names]
    expert = _EXPERT.match(rest)
    if expert:
        e = f"{prefix}mlp.experts.{expert.group(1)}."
        if expert.group(2) == "linear_fc1":
            return "glu", [e + "gate_proj.weight", e + "up_proj.weight"]
        return "copy", [e + "down_proj.weight"]
    return None


def hf_sources(name: str) -> tuple[str, list[str]]:
    """(kind, HF tensor names) that make the canonical Megatron tensor `name`."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    match = _LAYER.match(name)
    found = _layer_sources(f"model.layers.{match.group(1)}.", match.group(2)) if match else None
    mtp = _MTP_LAYER.match(name)
    if mtp and int(mtp.group(1)) >= MTP_HF_LAYERS:
        raise ValueError(f"no Hugging Face counterpart for Megatron parameter {name!r}: the HF MTP layout "
                         f"(SGLang's Qwen3MoeForCausalLMMTP drafter, Qwen3-Next checkpoints) holds {MTP_HF_LAYERS} "
                         "MTP layer (model.mtp_num_layers=1)")
    if mtp:
        rest = mtp.group(2)
        if rest in _MTP_OWN:
            found = ("copy", [_MTP_OWN[rest]])
        elif rest.startswith("transformer_layer."):
            found = _layer_sources("mtp.layers.0.", rest.removeprefix("transformer_layer."))
    if found is None:
        raise ValueError(f"no Hugging Face counterpart for Megatron parameter {name!r}")
    return found


def mtp_hf_names(arch: ModelArch) -> list[str]:
    """The HF names of the MTP drafter's tensors (what SGLang's draft model loads), in model order."""
    return [hf for name in canonical_param_names(arch) if name.startswith("mtp.") for hf in hf_sources(name)[1]]


def to_mcore(kind: str, tensors: list[torch.Tensor], arch: ModelArch) -> torch.Tensor:
    """Combine HF tensors into the canonical Megatron tensor (see module docstring)."""
    if kind == "copy":
        return tensors[0]
    if kind == "glu":
        return torch.cat(tensors, dim=0)
    q, k, v = tensors
    groups, per_group = arch.num_query_groups, arch.num_attention_heads // arch.num_query_groups
    rest = q.shape[1:]
    return torch.cat([q.reshape(groups, per_group * arch.head_dim, *rest),
                      k.reshape(groups, arch.head_dim, *rest),
                      v.reshape(groups, arch.head_dim, *rest)], dim=1).reshape(-1, *rest)


def to_hf(kind: str, tensor: torch.Tensor, arch: ModelArch) -> list[torch.Tensor]:
    """Inverse of to_mcore."""
    if kind == "copy":
        return [tensor]
    if kind == "glu":
        return list(tensor.chunk(2, dim=0))
    groups, per_group, hd = arch.num_query_groups, arch.num_attention_heads // arch.num_query_groups, arch.head_dim
    rest = tensor.shape[1:]
    grouped = tensor.reshape(groups, (per_group + 2) * hd, *rest)
    q, k, v = grouped.split([per_group * hd, hd, hd], dim=1)
    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


def hf_tensor_getter(source: SafetensorsDir, arch: ModelArch):
    """get(canonical name) -> full Megatron tensor, read from an HF checkpoint."""
    def get(name: str) -> torch.Tensor:
        kind, hf_names = hf_sources(name)
        missing = [n for n in hf_names if n not in source]
        if missing and name.startswith("mtp."):
            raise KeyError(f"{source.path}: the checkpoint has no MTP layers ({missing[0]!r} for Megatron {name!r}); "
                           "pass keep_mtp_init=True to keep their initial weights")
        if missing:
            raise KeyError(f"{source.path}: HF tensor(s) {missing} needed for Megatron {name!r} not found")
        return to_mcore(kind, [source.get(n) for n in hf_names], arch)
    return get


def _fresh_mtp_layers(source: SafetensorsDir, arch: ModelArch) -> list[int]:
    """MTP layers the checkpoint has none of (they keep their init); a layer it has only part of is a
    KeyError naming what is missing (a truncated or foreign checkpoint, not a fresh drafter)."""
    fresh = []
    for k in range(arch.mtp_num_layers):
        names = [n for n in canonical_param_names(arch) if n.startswith(f"mtp.layers.{k}.")]
        try:
            wanted = [hf for n in names for hf in hf_sources(n)[1]]
        except ValueError:  # beyond the HF layout's MTP layers: never in a checkpoint
            fresh.append(k)
            continue
        missing = [hf for hf in wanted if hf not in source]
        if len(missing) == len(wanted):
            fresh.append(k)
        elif missing:
            raise KeyError(f"{source.path}: MTP layer {k} is incomplete: {len(missing)} of {len(wanted)} tensors "
                           f"missing (first: {missing[0]!r})")
    return fresh


def arch_from_hf(hf_dir: str) -> ModelArch:
    """ModelArch of an HF model directory (its config.json)."""
    return arch_from_hf_config(read_hf_config(hf_dir), name=os.path.basename(os.path.normpath(hf_dir)))


def load_hf_weights_into(model_chunks, hf_dir: str, *, pgs, arch: ModelArch | None = None,
                         keep_mtp_init: bool = False) -> list[str]:
    """Load an HF checkpoint into this rank's model (or list of virtual-stage chunks);
    returns the canonical names loaded.

    arch: the architecture the model was built with (default: from config.json); its MoE and
    attention shapes drive the QKV / SwiGLU transforms. MTP layers load from the checkpoint's
    `mtp.*` tensors (module docstring); released Qwen checkpoints have none, and then a model with
    MTP raises unless keep_mtp_init=True: MTP layers absent from the checkpoint keep their initial
    weights (logged, naming them), present ones are loaded.
    """
    arch = arch or arch_from_hf(hf_dir)
    source = SafetensorsDir(hf_dir)
    get = hf_tensor_getter(source, arch)
    fresh = _fresh_mtp_layers(source, arch) if keep_mtp_init else []
    prefixes = tuple(f"mtp.layers.{k}." for k in fresh)
    if fresh and pgs.rank == 0:
        log.info("%s: no tensors for MTP layer(s) %s; they start from Megatron's initialisation (fresh drafter)",
                 hf_dir, ", ".join(f"mtp.layers.{k}" for k in fresh))
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    return [name for chunk in chunks  # str.startswith(()) is False: nothing skipped without fresh layers
            for name in load_canonical_state(chunk, get, pgs=pgs, skip=lambda n: n.startswith(prefixes))]


def load_hf_as_mcore(hf_dir: str, *, pgs=None, tp: int = 1, pp: int = 1, ep: int = 1,
                     etp: int | None = None, params_dtype: torch.dtype = torch.float32,
                     device: str | torch.device | None = None, backend: str | None = None,
                     sequence_parallel: bool | None = None):
    """Build the Megatron model of an HF checkpoint and load its weights (no VPP).

    pgs: the ParallelGroups to build on; when None, init_parallel(tp, pp, ep, etp) is called
    (in a plain Python process: a single-rank world on gloo or NCCL, with the CPU layer
    installed on CPU). Returns this rank's GPTModel in eval mode;
    model(input_ids [B, S], position_ids [B, S]) gives logits [B, S, V/tp] with a causal mask.
    """
    from megatron_dapo.models.builder import build_gpt_model
    from megatron_dapo.parallel import init_parallel

    arch = arch_from_hf(hf_dir)
    if pgs is None:
        pgs = init_parallel(tp=tp, pp=pp, ep=ep, etp=etp)
    model = build_gpt_model(arch, pgs=pgs, params_dtype=params_dtype, device=device, seed=None,
                            backend=backend, init_weights=False, sequence_parallel=sequence_parallel)
    load_hf_weights_into(model, hf_dir, pgs=pgs, arch=arch)
    return model.eval()


def iter_hf_tensors(model, *, pgs, arch: ModelArch, drop_mtp: bool = True):
    """(HF name, full tensor) of the model, gathered over TP/PP/EP. A collective: every rank iterates;
    the tensors are yielded on each name's writer rank only (rank 0 for a world of one). drop_mtp=False
    includes the MTP layers under their drafter names (`mtp.*`, module docstring)."""
    tied = not arch.untie_embeddings_and_output_weights
    for name, full, is_writer in gather_canonical_state(model, pgs=pgs):
        if not is_writer or (drop_mtp and name.startswith("mtp.")) or (tied and name == "output_layer.weight"):
            continue
        kind, hf_names = hf_sources(name)
        yield from zip(hf_names, to_hf(kind, full, arch), strict=True)


def iter_stage_hf_groups(model, *, pgs, arch: ModelArch, drop_mtp: bool = True, traffic: dict | None = None):
    """(canonical name, [(HF name, full tensor), ...] or None, bytes) for every tensor of this pipeline
    stage (all EP ranks' experts included), the same sequence on every rank of the stage; the tensors
    only on the stage's sender (models.weights.gather_stage_state). A collective over the stage."""
    tied = not arch.untie_embeddings_and_output_weights
    for name, full, nbytes in gather_stage_state(model, pgs=pgs, traffic=traffic):
        if (drop_mtp and name.startswith("mtp.")) or (tied and name == "output_layer.weight"):
            continue
        kind, hf_names = hf_sources(name)
        pieces = None if full is None else list(zip(hf_names, to_hf(kind, full, arch), strict=True))
        yield name, pieces, nbytes


def save_mcore_as_hf(model, out_dir: str, *, pgs, arch: ModelArch, hf_config: dict | None = None,
                     dtype: torch.dtype | None = None, drop_mtp: bool = False) -> None:
    """Write this model as an HF checkpoint (safetensors + config.json). A collective: every
    rank calls it; each writer rank writes its own files and rank 0 writes the index.

    hf_config: a source config.json dict whose other keys (token ids, ...) are kept.
    dtype: cast tensors on write (default: the model's dtype). MTP layers are not written
    (transformers' Qwen classes do not load them; `iter_hf_tensors(drop_mtp=False)` gives their
    drafter names): a model with MTP raises unless drop_mtp=True.
    """
    if arch.mtp_num_layers and not drop_mtp:       # checked before any collective starts
        raise ValueError(f"{arch.name}: HF Qwen checkpoints have no MTP layers; pass drop_mtp=True")
    multi = pgs.world_size > 1
    writer = ShardedSafetensorsWriter(out_dir, prefix=f"model-rank{pgs.rank:05d}" if multi else "model")
    param_dtype = next(iter(model.parameters())).dtype
    for hf_name, tensor in iter_hf_tensors(model, pgs=pgs, arch=arch):
        writer.add(hf_name, tensor.to(dtype) if dtype is not None else tensor)
    weight_map = writer.close()
    if multi:
        maps = [None] * pgs.world_size
        dist.all_gather_object(maps, weight_map)
        weight_map = {k: v for m in maps for k, v in m.items()}
    if pgs.rank != 0:
        return
    if multi:
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=1)
    config = hf_config_from_arch(arch, base=hf_config, dtype=dtype or param_dtype)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
