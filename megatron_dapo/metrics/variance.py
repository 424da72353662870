"""Gradient-variance proxies from the old policy's token probabilities.

Shape legend:
    B  responses in the batch
    T  padded response length
    old_log_probs   [B, T]        log pi_old(y_t | prefix) of the sampled token
    sum_sq_probs    [B, T]        sum_v pi_old(v | prefix)^2 over the vocabulary (from the actor)
    response_mask   [B, T]        0/1
    advantages      [B, T] or [B]
    is_weights      [B, T] or [B] rollout-correction importance weights, or None

Why W. For a softmax policy the gradient of log pi(y_t) with respect to the logits at step t is
`e_{y_t} - pi_t`, whose squared norm is `1 - 2 pi_t(y_t) + sum_v pi_t(v)^2`. Summing over the
response gives the score-norm proxy

    W_i = sum_t mask_it * w_it^2 * (1 - 2 pi_t(y_t) + sum_v pi_t(v)^2)        (w = 1 on-policy)

and, treating tokens' scores as uncorrelated, `A_i^2 W_i` estimates the squared norm of sequence
i's policy-gradient contribution `||g_i||^2` (logit space). With token-level IS weights each token's
gradient is scaled by `w_it`, hence `w_it^2` inside the sum; sequence-level weights are constant
along the sequence, so this is `w_i^2 A_i^2 W_i`, the reference's E[w^2 A^2 W].
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

__all__ = ["compute_variance_proxy_metrics"]

# Tolerance for probabilities computed in bf16/fp32: sum_v pi^2 can exceed 1 and log pi can
# exceed 0 by round-off; anything beyond this is a wrong input, not round-off.
_PROB_TOL = 1e-3


def compute_variance_proxy_metrics(
    *,
    old_log_probs: Tensor,
    sum_sq_probs: Tensor,
    response_mask: Tensor,
    advantages: Tensor,
    is_weights: Tensor | None = None,
    grad_norm: float | None = None,
) -> dict[str, float]:
    """Signal, total power and noise of the policy gradient, under `variance_proxy/`.

    Over the N sequences that have at least one valid token (A_i is the sequence's advantage:
    `advantages[i]` for a [B] tensor, the value at its first valid token for [B, T]; outcome
    estimators such as GRPO give the same value at every token):

    - `proxy1_signal_strength` = `grad_norm ** 2`, the squared norm of the batch-mean gradient
      measured by the optimizer step (0.0 when `grad_norm` is None).
    - `proxy2_total_power` = `mean_i A_i^2 W_i` ~ E[||g_i||^2]: signal plus noise per sample
      (with `is_weights` the weights enter W as above, E[w^2 A^2 W]).
    - `proxy3_pure_noise` = `max(0, (proxy2 - proxy1) / (N - 1))`: E||g_i||^2 - ||g_bar||^2 is
      the per-sample noise power; dividing by N - 1 turns it into the unbiased estimate of the
      variance of the batch-mean gradient (the reference trainer's definition). 0.0 when
      `grad_norm` is None or N < 2. The clamp at 0 absorbs the cases where the measured signal
      exceeds the proxy power.
    - `expected_a_squared` = `mean_i A_i^2`, `expected_w` = `mean_i W_i` (the two factors, to see
      which one moved).

    Scale caveat: proxy2 is a logit-space estimate of one sequence's summed-token gradient,
    proxy1 the parameter-space norm of the loss actually optimised (token-mean divides by the
    token count). proxy3 is therefore a trend indicator, not a calibrated variance.

    With no valid token at all every metric is 0.0. Returns Python floats.
    """
    if not isinstance(response_mask, Tensor) or response_mask.dim() != 2:
        raise ValueError(f"response_mask: expected a tensor of shape [B, T], got {_describe(response_mask)}")
    shape = tuple(response_mask.shape)
    for name, t in (("old_log_probs", old_log_probs), ("sum_sq_probs", sum_sq_probs)):
        if not isinstance(t, Tensor) or tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected a tensor of shape {list(shape)}, got {_describe(t)}")
    _check_per_seq_or_token("advantages", advantages, shape)
    if is_weights is not None:
        _check_per_seq_or_token("is_weights", is_weights, shape)
    if grad_norm is not None and (
        isinstance(grad_norm, bool)
        or not isinstance(grad_norm, numbers.Real)
        or not math.isfinite(grad_norm)
        or grad_norm < 0
    ):
        raise ValueError(f"grad_norm: expected a finite float >= 0 or None, got {grad_norm!r}")

    mask = response_mask.bool()
    valid_lp = old_log_probs[mask]
    valid_sq = sum_sq_probs[mask]
    if valid_lp.numel() and float(valid_lp.max()) > _PROB_TOL:
        raise ValueError(
            f"old_log_probs: log-probabilities must be <= 0, got max {float(valid_lp.max()):.4g}"
        )
    if valid_sq.numel() and (float(valid_sq.min()) < -_PROB_TOL or float(valid_sq.max()) > 1 + _PROB_TOL):
        raise ValueError(
            "sum_sq_probs: a sum of squared probabilities lies in [0, 1], got range "
            f"[{float(valid_sq.min()):.4g}, {float(valid_sq.max()):.4g}]"
        )

    # ||e_y - pi||^2 >= 0 exactly; the clamp only removes negative round-off.
    w_tok = (1.0 - 2.0 * old_log_probs.float().exp() + sum_sq_probs.float()).clamp_min(0.0)
    if is_weights is not None:
        weights = is_weights.float()
        weights = weights.unsqueeze(-1) if weights.dim() == 1 else weights
        w_tok = w_tok * weights.detach().square()
    # where, not a multiply by the mask: padding may hold inf / NaN and NaN * 0 is NaN.
    w_seq = torch.where(mask, w_tok, torch.zeros_like(w_tok)).sum(-1)  # [B]

    if advantages.dim() == 1:
        adv_seq = advantages.float()
    else:
        # argmax returns the first maximum: the first valid token (0 for an empty row, dropped below).
        first = mask.int().argmax(-1, keepdim=True)
        adv_seq = advantages.float().gather(-1, first).squeeze(-1)

    has_tokens = mask.any(-1)
    n = int(has_tokens.sum())
    if n == 0:
        return {f"variance_proxy/{k}": 0.0 for k in _NAMES}
    a2 = adv_seq[has_tokens].square()
    w = w_seq[has_tokens]
    expected_a_squared, expected_w, total_power = torch.stack([a2.mean(), w.mean(), (a2 * w).mean()]).tolist()

    signal = float(grad_norm) ** 2 if grad_norm is not None else 0.0
    noise = max(0.0, (total_power - signal) / (n - 1)) if grad_norm is not None and n > 1 else 0.0
    return {
        "variance_proxy/proxy1_signal_strength": signal,
        "variance_proxy/proxy2_total_power": total_power,
        "variance_proxy/proxy3_pure_noise": noise,
        "variance_proxy/expected_a_squared": expected_a_squared,
        "variance_proxy/expected_w": expected_w,
    }


_NAMES = (
    "proxy1_signal_strength",
    "proxy2_total_power",
    "proxy3_pure_noise",
    "expected_a_squared",
    "expected_w",
)


def _check_per_seq_or_token(name: str, x: object, shape: tuple[int, int]) -> None:
    if not isinstance(x, Tensor) or (tuple(x.shape) != shape and tuple(x.shape) != shape[:1]):
        raise ValueError(
            f"{name}: expected a tensor of shape {list(shape)} or [{shape[0]}], got {_describe(x)}"
        )


def _describe(x: object) -> str:
    return f"shape {list(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
