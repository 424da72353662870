"""The model architecture a config describes (no Megatron import: the memory planner uses it)."""

from __future__ import annotations

import dataclasses

from megatron_dapo.config import Config
from megatron_dapo.models.arch import ModelArch, get_arch


def model_arch(cfg: Config, *, vocab_size: int) -> ModelArch:
    """The architecture of cfg.model with its overrides and the tokenizer's vocabulary."""
    m = cfg.model
    if m.arch == "hf":
        from megatron_dapo.models.hf import arch_from_hf

        arch = arch_from_hf(m.hf_path)
    else:
        arch = get_arch(m.arch)
    overrides = {k: getattr(m, k) for k in ("num_layers", "hidden_size", "ffn_hidden_size",
                                            "num_attention_heads", "num_query_groups") if getattr(m, k) is not None}
    if m.mtp_num_layers:
        overrides["mtp_num_layers"] = m.mtp_num_layers
    if m.arch in ("tiny", "tiny_moe"):  # the tiny presets take the task's vocabulary
        overrides["vocab_size"] = vocab_size
    elif vocab_size > arch.vocab_size:
        raise ValueError(f"model.arch {m.arch!r} has vocab_size {arch.vocab_size} < the tokenizer's {vocab_size}")
    return dataclasses.replace(arch, **overrides)
