"""Megatron-Core's GPU fusions: on with Transformer Engine, off with the local spec, each overridable.

    resolve_fusions("te", arch=arch, main_grad=True, apply_rope_fusion=None, ...) -> dict of the five
    TransformerConfig fields below (None = the backend's default; True / False = the user's choice).

| field | what it fuses | needs |
|---|---|---|
| gradient_accumulation_fusion | weight-gradient GEMM accumulates straight into DDP's fp32 main_grad (no separate param.grad) | TE (local spec: Apex's fused_weight_gradient_mlp_cuda, not a dependency); Megatron DDP's main_grad |
| apply_rope_fusion | RoPE applied to q / k in one kernel | TE |
| bias_activation_fusion | (bias +) SwiGLU / GeLU in one kernel that keeps only its input for backward | torch.compile (not on the CPU layer); SwiGLU, or GeLU with bias |
| bias_dropout_fusion | bias + dropout + residual add in one kernel | torch.compile (not on the CPU layer) |
| masked_softmax_fusion | scale + mask + softmax of the local attention (TE's attention is fused anyway) | Megatron's fused softmax kernel; falls back to torch when absent |

gradient_accumulation_fusion defaults on only for a model trained through Megatron's DDP wrapper
(`main_grad=True`: the actor); a bare model (eval, conversion, a frozen reference) has no main_grad
for TE to accumulate into. Asking for a fusion its backend cannot run is a ConfigError naming the
`model.<field>` key, instead of an error from deep inside Megatron at the first forward.
No Megatron import here: the memory planner uses it too.
"""

from __future__ import annotations

from megatron_dapo.config.errors import ConfigError
from megatron_dapo.models.arch import ModelArch

FUSIONS = ("gradient_accumulation_fusion", "apply_rope_fusion", "bias_activation_fusion",
           "bias_dropout_fusion", "masked_softmax_fusion")
_NEEDS_TE = {"gradient_accumulation_fusion": "Transformer Engine's fused weight-gradient GEMM (or Apex, which "
                                             "is not a dependency)",
             "apply_rope_fusion": "Transformer Engine's fused RoPE kernel"}
_COMPILED = ("bias_activation_fusion", "bias_dropout_fusion")     # Megatron's jit_fuser = torch.compile


def _activation_fusable(arch: ModelArch) -> bool:
    """Megatron's rule (TransformerConfig.__post_init__): SwiGLU, or GeLU with a bias."""
    return arch.swiglu or arch.add_bias_linear


def resolve_fusions(backend: str, *, arch: ModelArch, main_grad: bool = False, device_type: str = "cuda",
                    gradient_accumulation_fusion: bool | None = None, apply_rope_fusion: bool | None = None,
                    bias_activation_fusion: bool | None = None, bias_dropout_fusion: bool | None = None,
                    masked_softmax_fusion: bool | None = None) -> dict[str, bool]:
    """The five fusion fields of TransformerConfig for a layer-spec backend ("te" or "local").

    main_grad: the model's parameters get Megatron DDP's main_grad (it is trained through DDP).
    device_type: "cpu" refuses the torch.compile fusions (the CPU compatibility layer cannot compile).
    """
    if backend not in ("te", "local"):
        raise ValueError(f"backend must be 'te' or 'local', got {backend!r}")
    te = backend == "te"
    asked = dict(gradient_accumulation_fusion=gradient_accumulation_fusion, apply_rope_fusion=apply_rope_fusion,
                 bias_activation_fusion=bias_activation_fusion, bias_dropout_fusion=bias_dropout_fusion,
                 masked_softmax_fusion=masked_softmax_fusion)
    for name, value in asked.items():
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"model.{name}", f"expected true, false or null, got {value!r}")
        if value and not te and name in _NEEDS_TE:
            raise ConfigError(f"model.{name}", f"needs {_NEEDS_TE[name]}; this run uses the local layer spec "
                              "(CPU, or CUDA without transformer_engine): set it to null or false")
        if value and device_type == "cpu" and name in _COMPILED:
            raise ConfigError(f"model.{name}", "Megatron builds this fusion with torch.compile, which the CPU "
                              "compatibility layer cannot run: set it to null or false on CPU")
    if asked["gradient_accumulation_fusion"] and not main_grad:
        raise ConfigError("model.gradient_accumulation_fusion", "needs parameters with Megatron DDP's main_grad "
                          "(a model trained through DistributedDataParallel)")
    if asked["bias_activation_fusion"] and not _activation_fusable(arch):
        raise ConfigError("model.bias_activation_fusion", f"{arch.name} uses GeLU without a bias; Megatron fuses "
                          "only SwiGLU or GeLU with bias")

    def pick(name: str, default: bool) -> bool:
        return default if asked[name] is None else asked[name]

    return dict(
        gradient_accumulation_fusion=pick("gradient_accumulation_fusion", te and main_grad),
        apply_rope_fusion=pick("apply_rope_fusion", te),
        bias_activation_fusion=pick("bias_activation_fusion", te and _activation_fusable(arch)),
        bias_dropout_fusion=pick("bias_dropout_fusion", te),
        masked_softmax_fusion=pick("masked_softmax_fusion", te),
    )
