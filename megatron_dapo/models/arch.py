"""Model architecture presets: a frozen, framework-free description of a decoder-only LM.

`ModelArch` holds only what defines the network's shape and numerics (no parallel sizes, no
dtype, no device); `builder.build_transformer_config` turns it into a Megatron
`TransformerConfig`. The presets:

- "tiny":           4 layers, hidden 128, 4 heads / 2 KV groups, SwiGLU ffn 256, RMSNorm, RoPE,
                    QKV bias (Qwen2-shaped). The CPU default.
- "tiny_moe":       same trunk, every layer MoE with 4 experts top-2 (expert ffn 128), QK-norm,
                    bias-free (Qwen3-MoE-shaped).
- "qwen2.5-32b":    Qwen/Qwen2.5-32B (base). Values from its config.json
                    (https://huggingface.co/Qwen/Qwen2.5-32B/blob/main/config.json): 64 layers,
                    hidden 5120, 40 heads, 8 KV heads, intermediate 27648, vocab 152064,
                    rope_theta 1e6, rms_norm_eps 1e-5 (the Instruct variant uses 1e-6),
                    max_position_embeddings 131072, untied embeddings. 32.76B parameters.
- "qwen3-30b-a3b":  Qwen/Qwen3-30B-A3B: 48 layers, hidden 2048, 32 heads, 4 KV heads, head_dim
                    128, 128 experts top-8 (moe_intermediate_size 768, norm_topk_prob), QK-norm,
                    no QKV bias, vocab 151936, rope_theta 1e6, rms_norm_eps 1e-6,
                    max_position_embeddings 40960, router_aux_loss_coef 1e-3, untied.
                    30.5B total / 3.3B active parameters (model card).

Any preset takes overrides, e.g. `get_arch("qwen3-30b-a3b", mtp_num_layers=1)`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelArch:
    """Shape and numerics of a decoder-only transformer (RoPE, pre-norm, optional MoE and MTP)."""

    name: str
    """Preset or source name; informational."""
    num_layers: int
    """Decoder layers (MTP layers not included)."""
    hidden_size: int
    ffn_hidden_size: int
    """Intermediate size of dense MLP layers (per SwiGLU branch)."""
    num_attention_heads: int
    num_query_groups: int
    """KV heads (GQA groups); must divide num_attention_heads."""
    vocab_size: int
    max_position_embeddings: int
    kv_channels: int | None = None
    """Head dimension; None means hidden_size // num_attention_heads."""
    rotary_base: float = 10000.0
    """RoPE theta."""
    normalization: str = "RMSNorm"
    """"RMSNorm" or "LayerNorm"."""
    norm_epsilon: float = 1e-6
    swiglu: bool = True
    """SwiGLU MLP (silu(gate) * up); False means a plain GELU MLP."""
    add_qkv_bias: bool = False
    """Bias on the fused QKV projection only (Qwen2)."""
    add_bias_linear: bool = False
    """Bias on every other linear layer. MoE models must keep this False (see builder)."""
    qk_layernorm: bool = False
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3)."""
    untie_embeddings_and_output_weights: bool = True
    num_moe_experts: int | None = None
    """None or 0: dense model."""
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    """Intermediate size of one expert."""
    moe_shared_expert_intermediate_size: int | None = None
    moe_aux_loss_coeff: float = 0.0
    moe_norm_topk_prob: bool = True
    """True: softmax over the selected top-k logits (renormalised); False: softmax over all
    experts, then top-k without renormalising (HF `norm_topk_prob`)."""
    moe_layer_freq: int | tuple[int, ...] = 1
    """1: every layer is MoE; a tuple of 0/1 per layer gives the pattern (1 = MoE)."""
    mtp_num_layers: int = 0
    """Multi-token-prediction layers (DeepSeek-V3 style) after the decoder; 0 disables MTP."""
    init_method_std: float = 0.02

    def __post_init__(self):
        for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                      "num_query_groups", "vocab_size", "max_position_embeddings"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelArch.{field} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"ModelArch.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"ModelArch.hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; set kv_channels explicitly")
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"ModelArch.normalization must be 'RMSNorm' or 'LayerNorm', "
                             f"got {self.normalization!r}")
        if self.mtp_num_layers < 0:
            raise ValueError(f"ModelArch.mtp_num_layers must be >= 0, got {self.mtp_num_layers}")
        if self.is_moe:
            if not self.moe_ffn_hidden_size:
                raise ValueError("ModelArch.moe_ffn_hidden_size is required when num_moe_experts is set")
            if not 1 <= self.moe_router_topk <= self.num_moe_experts:
                raise ValueError(f"ModelArch.moe_router_topk={self.moe_router_topk} must be in "
                                 f"[1, num_moe_experts={self.num_moe_experts}]")
            if isinstance(self.moe_layer_freq, tuple):
                if len(self.moe_layer_freq) != self.num_layers or set(self.moe_layer_freq) - {0, 1}:
                    raise ValueError(f"ModelArch.moe_layer_freq must hold one 0/1 per layer "
                                     f"({self.num_layers}), got {self.moe_layer_freq}")
            elif not isinstance(self.moe_layer_freq, int) or self.moe_layer_freq < 1:
                raise ValueError(f"ModelArch.moe_layer_freq must be an int >= 1 or a tuple, "
                                 f"got {self.moe_layer_freq!r}")

    @property
    def is_moe(self) -> bool:
        return bool(self.num_moe_experts)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def moe_layer_pattern(self) -> tuple[int, ...]:
        """One entry per decoder layer: 1 = MoE layer, 0 = dense layer."""
        if not self.is_moe:
            return (0,) * self.num_layers
        if isinstance(self.moe_layer_freq, tuple):
            return self.moe_layer_freq
        return tuple(int(i % self.moe_layer_freq == 0) for i in range(self.num_layers))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if isinstance(self.moe_layer_freq, tuple):
            d["moe_layer_freq"] = list(self.moe_layer_freq)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelArch:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ModelArch fields {unknown}; known: {sorted(known)}")
        d = dict(d)
        if isinstance(d.get("moe_layer_freq"), list):
            d["moe_layer_freq"] = tuple(d["moe_layer_freq"])
        return cls(**d)


PRESETS: dict[str, ModelArch] = {
    "tiny": ModelArch(
        name="tiny", num_layers=4, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
        num_query_groups=2, vocab_size=512, max_position_embeddings=1024, add_qkv_bias=True),
    "tiny_moe": ModelArch(
        name="tiny_moe", num_layers=4, hidden_size=128, ffn_hidden_size=256,
        num_attention_heads=4, num_query_groups=2, vocab_size=512, max_position_embeddings=1024,
        qk_layernorm=True, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128,
        moe_aux_loss_coeff=1e-3),
    "qwen2.5-32b": ModelArch(
        name="qwen2.5-32b", num_layers=64, hidden_size=5120, ffn_hidden_size=27648,
        num_attention_heads=40, num_query_groups=8, vocab_size=152064,
        max_position_embeddings=131072, rotary_base=1e6, norm_epsilon=1e-5, add_qkv_bias=True),
    "qwen3-30b-a3b": ModelArch(
        name="qwen3-30b-a3b", num_layers=48, hidden_size=2048, ffn_hidden_size=6144,
        num_attention_heads=32, num_query_groups=4, kv_channels=128, vocab_size=151936,
        max_position_embeddings=40960, rotary_base=1e6, norm_epsilon=1e-6, qk_layernorm=True,
        num_moe_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768, moe_aux_loss_coeff=1e-3),
}


def get_arch(name: str, **overrides) -> ModelArch:
    """A preset by name, with optional field overrides (e.g. mtp_num_layers=1, vocab_size=...)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}")
    known = {f.name for f in dataclasses.fields(ModelArch)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown ModelArch override(s) {unknown}; known fields: {sorted(known)}")
    return dataclasses.replace(PRESETS[name], **overrides)


def check_layout(arch: ModelArch, *, tp: int = 1, pp: int = 1, ep: int = 1,
                 etp: int | None = None, vpp: int | None = None) -> None:
    """Raise ValueError naming the first dimension of `arch` that a layout cannot split."""
    checks = [
        ("num_attention_heads", arch.num_attention_heads, "tp", tp),
        ("num_query_groups", arch.num_query_groups, "tp", tp),
        ("vocab_size", arch.vocab_size, "tp", tp),
        ("num_layers", arch.num_layers, "pp*vpp", pp * (vpp or 1)),
    ]
    if not all(arch.moe_layer_pattern()):                 # some dense MLP layers exist
        checks.append(("ffn_hidden_size", arch.ffn_hidden_size, "tp", tp))
    if arch.is_moe:
        checks.append(("num_moe_experts", arch.num_moe_experts, "ep", ep))
        checks.append(("moe_ffn_hidden_size", arch.moe_ffn_hidden_size, "etp", tp if etp is None else etp))
    for field, value, size_name, size in checks:
        if value % size:
            raise ValueError(f"ModelArch.{field}={value} is not divisible by {size_name}={size}")


def count_parameters(arch: ModelArch) -> dict[str, int]:
    """Analytical parameter counts of the Megatron model built from `arch` (no weights made).

    Returns {"total", "active", "embedding"}: "active" counts one token's path (top-k experts
    instead of all); "embedding" counts input embedding plus output layer (if untied).
    """
    h, hd = arch.hidden_size, arch.head_dim
    q_out, kv_out = arch.num_attention_heads * hd, arch.num_query_groups * hd
    bias = arch.add_bias_linear
    norm = h * (2 if arch.normalization == "LayerNorm" else 1)
    attn = h * (q_out + 2 * kv_out) + q_out * h + (h if bias else 0)
    attn += (q_out + 2 * kv_out) if (arch.add_qkv_bias or bias) else 0
    attn += 2 * hd if arch.qk_layernorm else 0

    def mlp(ffn: int) -> int:
        fc1_out = 2 * ffn if arch.swiglu else ffn
        return h * fc1_out + ffn * h + ((fc1_out + h) if bias else 0)

    def layer(is_moe: int) -> tuple[int, int]:          # (total, active) of one decoder layer
        if not is_moe:
            n = attn + 2 * norm + mlp(arch.ffn_hidden_size)
            return n, n
        shared = mlp(arch.moe_shared_expert_intermediate_size) if arch.moe_shared_expert_intermediate_size else 0
        base = attn + 2 * norm + h * arch.num_moe_experts + shared          # router: [E, h]
        expert = mlp(arch.moe_ffn_hidden_size)
        return base + arch.num_moe_experts * expert, base + arch.moe_router_topk * expert

    pattern = arch.moe_layer_pattern()
    layers = [layer(is_moe) for is_moe in pattern]
    # Megatron MTP layer: enorm + hnorm + eh_proj [h, 2h] + one decoder layer like the last
    # decoder layer + final norm; it shares the embedding and the output layer.
    mtp_total, mtp_active = layer(pattern[-1])
    layers += [(3 * norm + 2 * h * h + mtp_total, 3 * norm + 2 * h * h + mtp_active)] * arch.mtp_num_layers
    embedding = arch.vocab_size * h * (2 if arch.untie_embeddings_and_output_weights else 1)
    fixed = embedding + norm                                                # + final norm
    return {"total": fixed + sum(t for t, _ in layers), "active": fixed + sum(a for _, a in layers),
            "embedding": embedding}


def expert_id_dtype(num_experts: int):
    """The compact dtype of a MoE expert id (routing records, routed experts from the engine): uint8 up to
    256 experts, int16 above."""
    import torch

    return torch.uint8 if num_experts <= 256 else torch.int16
