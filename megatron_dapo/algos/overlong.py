"""DAPO overlong reward shaping (soft length penalty) and the overlong filter mask.

Shape legend:
    B  responses
    response_length, ended_with_eos, and every returned tensor: [B]

Soft overlong punishment: with L the response length and Lmax = max_response_length,
    0                                                   if L <= Lmax - buffer
    -(L - (Lmax - buffer)) / buffer * penalty_factor    otherwise
so the penalty grows linearly from 0 to -penalty_factor over the last `buffer` tokens.
"""

from __future__ import annotations

from numbers import Integral, Real

import torch
from torch import Tensor

__all__ = ["overlong_filter_mask", "overlong_penalty"]


def overlong_penalty(
    response_length: int | Tensor,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float = 1.0,
) -> float | Tensor:
    """min(-(L - (max_response_length - overlong_buffer_len)) / overlong_buffer_len * penalty_factor, 0).

    An int length gives a float; a tensor of lengths [B] gives a float tensor [B] (the lengths'
    dtype when floating, else the default float dtype).
    """
    if not isinstance(overlong_buffer_len, Integral) or overlong_buffer_len <= 0:
        raise ValueError(f"overlong_buffer_len must be a positive int, got {overlong_buffer_len!r}")
    if not isinstance(max_response_length, Integral) or max_response_length < overlong_buffer_len:
        raise ValueError(
            f"max_response_length must be an int >= overlong_buffer_len ({overlong_buffer_len}), "
            f"got {max_response_length!r}"
        )
    if isinstance(penalty_factor, bool) or not isinstance(penalty_factor, Real) or penalty_factor < 0:
        raise ValueError(f"penalty_factor must be a number >= 0, got {penalty_factor!r}")

    expected_len = max_response_length - overlong_buffer_len
    if isinstance(response_length, Tensor):
        lengths = (
            response_length
            if response_length.is_floating_point()
            else response_length.to(torch.get_default_dtype())
        )
        return torch.clamp(-(lengths - expected_len) / overlong_buffer_len * penalty_factor, max=0.0)
    if isinstance(response_length, bool) or not isinstance(response_length, Integral):
        raise ValueError(f"response_length must be an int or a tensor of lengths, got {response_length!r}")
    return min(-(int(response_length) - expected_len) / overlong_buffer_len * float(penalty_factor), 0.0)


def overlong_filter_mask(
    response_length: Tensor,
    max_response_length: int,
    *,
    ended_with_eos: Tensor | None = None,
) -> Tensor:
    """True for responses that were not truncated: length < max_response_length, or ended with EOS.

    `response_length` [B] (a tensor or a sequence of ints); `ended_with_eos` [B] bool, for the
    response that stopped on EOS exactly at the length limit. Used to drop truncated samples from
    the loss when overlong filtering is on. Returns a bool tensor [B].
    """
    if not isinstance(max_response_length, Integral) or max_response_length <= 0:
        raise ValueError(f"max_response_length must be a positive int, got {max_response_length!r}")
    lengths = torch.as_tensor(response_length)
    if lengths.dim() != 1:
        raise ValueError(f"response_length must be 1-D [B], got shape {tuple(lengths.shape)}")
    keep = lengths < max_response_length
    if ended_with_eos is not None:
        eos = torch.as_tensor(ended_with_eos, device=lengths.device)
        if eos.shape != lengths.shape:
            raise ValueError(
                f"ended_with_eos has shape {tuple(eos.shape)}, expected {tuple(lengths.shape)} "
                "(one flag per response, like response_length)"
            )
        keep = keep | eos.bool()
    return keep
