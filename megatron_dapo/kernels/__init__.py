"""Fused Triton kernels and their PyTorch references (installed as megatron_dapo.kernels).

Each kernel file holds the @triton.jit kernels, their launcher, the autograd Function and the
`*_reference` that specifies them (STYLE.md rule 11). Importing this package never needs a
working triton: the torch paths stay available and backend="triton" explains what is missing.
On CPU tensors the Triton kernels run only in Triton's interpreter, which is chosen when triton is
imported: set TRITON_INTERPRET=1 before that (tests/kernels/conftest.py does).
"""

from .clipped_loss import METRIC_NAMES, fused_clipped_token_loss, fused_clipped_token_loss_reference
from .logprob_entropy import (
    fused_logprob_entropy,
    fused_logprob_entropy_reference,
    fused_logprob_stats,
    fused_logprob_stats_reference,
)

__all__ = [
    "METRIC_NAMES",
    "fused_clipped_token_loss",
    "fused_clipped_token_loss_reference",
    "fused_logprob_entropy",
    "fused_logprob_entropy_reference",
    "fused_logprob_stats",
    "fused_logprob_stats_reference",
]
