"""Policy-gradient losses and their aggregation (DAPO's token-level clipped objective).

Shape legend:
    B  responses in the (micro-)batch
    T  padded response length
    loss_mat, log_prob, old_log_prob, advantages, response_mask, rollout_is_weights: [B, T]
    returned loss and every metric: [] (0-dim tensors)

Every registered loss takes the same keyword arguments (see `POLICY_LOSS_KWARGS`) so the actor
resolves the function once (`get_policy_loss_fn(cfg.actor.policy_loss)`) and calls it by keyword
with every field of its config. A loss that does not use a knob (REINFORCE has no clip ratios)
still names it as an explicit keyword parameter and ignores it: a mistyped keyword then raises
`TypeError` instead of vanishing into `**kwargs`.

Metrics are returned as detached 0-dim tensors on the input's device: calling `.item()` per
micro-batch would synchronise the GPU (STYLE rule 7). `float(metrics[name])` works on each.
"""

from __future__ import annotations

from collections.abc import Callable
from numbers import Real

import torch
from torch import Tensor

__all__ = [
    "AGG_MODES",
    "POLICY_LOSS_KWARGS",
    "agg_loss",
    "compute_policy_loss_cispo",
    "compute_policy_loss_gspo",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_vanilla",
    "get_policy_loss_fn",
    "register_policy_loss",
]

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

# The keyword set every registered loss accepts; the actor passes all of them.
POLICY_LOSS_KWARGS = (
    "old_log_prob",
    "log_prob",
    "advantages",
    "response_mask",
    "loss_agg_mode",
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_c",
    "rollout_is_weights",
    "dp_size",
    "batch_num_tokens",
    "global_batch_size",
)

# exp(20) ~ 4.9e8: large enough for any sane ratio, small enough that fp32 never overflows.
_LOG_RATIO_BOUND = 20.0


def _check_same_shape(reference_name: str, reference: Tensor, **others: Tensor | None) -> None:
    if reference.dim() != 2:
        raise ValueError(f"{reference_name} must be a [B, T] tensor, got shape {tuple(reference.shape)}")
    for name, tensor in others.items():
        if tensor is not None and tensor.shape != reference.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected {tuple(reference.shape)} "
                f"(the shape of {reference_name})"
            )


def _denominator(value: Tensor | Real | None, default: Tensor, name: str, dp_size: int) -> Tensor | float:
    """The normaliser of a mean: an explicit global count, or the local count `default`.

    A local count of 0 (a micro-batch with no valid token) is clamped to 1: the numerator is then 0
    too, so the loss is 0 rather than NaN. An explicit tensor count is used as given (checking its
    value would force a device sync); an explicit number must be positive.
    """
    if value is None:
        if dp_size > 1:
            raise ValueError(
                f"{name} is required when dp_size > 1 (got dp_size={dp_size}): pass the count summed "
                "over every micro-batch and data-parallel rank of the mini-batch"
            )
        return default.clamp(min=1)
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        return value.reshape(())
    if isinstance(value, bool) or not isinstance(value, Real) or value <= 0:
        raise ValueError(f"{name} must be a positive number or a scalar tensor, got {value!r}")
    return float(value)


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Tensor | Real | None = None,
    global_batch_size: Tensor | Real | None = None,
) -> Tensor:
    """Aggregate a per-token loss `loss_mat` [B, T] into a scalar.

    The result is scaled by `dp_size` because data-parallel gradient reduction takes the *mean*
    over ranks: with the global counts, summing the losses of every micro-batch on every rank and
    averaging over ranks gives exactly the full-batch loss, however the batch was split.

    Modes (mask = loss_mask as a float):
      token-mean              sum(loss*mask) / batch_num_tokens * dp_size
                              (batch_num_tokens defaults to mask.sum(); required when dp_size > 1)
      token-sum               sum(loss*mask) * dp_size
      seq-mean-token-sum      sum over sequences with >= 1 valid token of sum_t(loss*mask),
                              / global_batch_size (defaults to that sequence count; required when
                              dp_size > 1) * dp_size
      seq-mean-token-mean     as above with per-sequence sum_t(loss*mask) / (n_tokens + 1e-8)
      seq-mean-token-sum-norm seq-mean-token-sum / T (Dr.GRPO; T = loss_mat.shape[-1])
    """
    _check_same_shape("loss_mat", loss_mat, loss_mask=loss_mask)
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be an int >= 1, got {dp_size!r}")
    mask = loss_mask.to(loss_mat.dtype)
    masked = loss_mat * mask

    if loss_agg_mode == "token-mean":
        denom = _denominator(batch_num_tokens, mask.sum(), "batch_num_tokens", dp_size)
        return masked.sum() / denom * dp_size
    if loss_agg_mode == "token-sum":
        return masked.sum() * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        tokens_per_seq = mask.sum(dim=-1)  # [B]
        seq_valid = (tokens_per_seq > 0).to(loss_mat.dtype)  # [B]
        seq_loss = masked.sum(dim=-1)  # [B]
        if loss_agg_mode == "seq-mean-token-mean":
            seq_loss = seq_loss / (tokens_per_seq + 1e-8)
        denom = _denominator(global_batch_size, seq_valid.sum(), "global_batch_size", dp_size)
        loss = (seq_loss * seq_valid).sum() / denom * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / loss_mat.shape[-1]
        return loss
    raise ValueError(f"loss_agg_mode must be one of {list(AGG_MODES)}, got {loss_agg_mode!r}")


def check_clip_ratios(clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float) -> None:
    """The clip arguments' contract, shared with the fused kernel: ValueError naming the argument."""
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual-clip lower bound), got {clip_ratio_c!r}")
    _check_clip_band(clip_ratio_low, clip_ratio_high)


def _check_clip_band(clip_ratio_low: float, clip_ratio_high: float) -> None:
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(f"clip_ratio_low must be in [0, 1), got {clip_ratio_low!r}")
    if not clip_ratio_high >= 0.0:
        raise ValueError(f"clip_ratio_high must be >= 0, got {clip_ratio_high!r}")


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over valid tokens, detached; 0 when there is no valid token."""
    values = values.detach().to(mask.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------

_POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {}


def register_policy_loss(name: str) -> Callable:
    """Decorator registering a policy loss under `name` (resolved once, at actor build time).

    The function must accept every keyword in `POLICY_LOSS_KWARGS`.
    """

    def decorator(fn: Callable) -> Callable:
        existing = _POLICY_LOSSES.get(name)
        if existing is not None and existing.__qualname__ != fn.__qualname__:
            raise ValueError(f"policy loss {name!r} is already registered to {existing.__qualname__}")
        _POLICY_LOSSES[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> Callable[..., tuple[Tensor, dict[str, Tensor]]]:
    """The policy loss registered under `name`; call it with keyword arguments only."""
    try:
        return _POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy loss {name!r}; registered losses: {sorted(_POLICY_LOSSES)}"
        ) from None


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: Tensor | None = None,
    dp_size: int = 1,
    batch_num_tokens: Tensor | Real | None = None,
    global_batch_size: Tensor | Real | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with decoupled clip (DAPO clip-higher) and dual clip for A < 0.

    ratio   = exp(clamp(log_prob - old_log_prob, -20, 20))
    clipped = max(-A*ratio, -A*clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))
    loss    = min(clipped, -A*clip_ratio_c) where A < 0, else clipped
    then times `rollout_is_weights` (if given) and aggregated by `agg_loss`.

    Returns (loss [], metrics) with metrics (detached 0-dim tensors, masked means over this call):
      actor/pg_clipfrac        fraction of tokens where the clipped term is the larger one
      actor/ppo_kl             mean of old_log_prob - log_prob (after the clamp)
      actor/pg_clipfrac_lower  fraction of tokens with A < 0 where the dual clip engaged
    """
    _check_same_shape(
        "log_prob",
        log_prob,
        old_log_prob=old_log_prob,
        advantages=advantages,
        response_mask=response_mask,
        rollout_is_weights=rollout_is_weights,
    )
    check_clip_ratios(clip_ratio_low, clip_ratio_high, clip_ratio_c)

    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    # Dual clip: for A < 0 a huge ratio would make -A*ratio unbounded; cap it at -A*c.
    loss_dual_bound = -advantages * clip_ratio_c
    negative_adv = advantages < 0
    pg_losses = torch.where(negative_adv, torch.minimum(loss_ppo, loss_dual_bound), loss_ppo)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()

    loss = agg_loss(
        pg_losses,
        mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
    )
    metrics = {
        "actor/pg_clipfrac": _masked_mean(loss_clipped > loss_unclipped, mask),
        "actor/ppo_kl": _masked_mean(-log_ratio, mask),
        "actor/pg_clipfrac_lower": _masked_mean((loss_ppo > loss_dual_bound) & negative_adv, mask),
    }
    return loss, metrics


@register_policy_loss("reinforce")
def compute_policy_loss_reinforce(
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: Tensor | None = None,
    dp_size: int = 1,
    batch_num_tokens: Tensor | Real | None = None,
    global_batch_size: Tensor | Real | None = None,
    old_log_prob: Tensor | None = None,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE with optional importance weights: per-token loss -A * log_prob * w.

    Used by the `bypass_pg_is` rollout-correction preset, where `w` are the (detached) rollout
    IS weights and there is no trust-region clipping. `clip_ratio_low/high/c` are accepted only
    so every registered loss shares one keyword signature; they are ignored. `old_log_prob`, when
    given, only feeds the "actor/ppo_kl" metric (masked mean of old_log_prob - log_prob).
    """
    _check_same_shape(
        "log_prob",
        log_prob,
        advantages=advantages,
        response_mask=response_mask,
        rollout_is_weights=rollout_is_weights,
        old_log_prob=old_log_prob,
    )
    mask = response_mask.to(log_prob.dtype)
    pg_losses = -advantages * log_prob
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    loss = agg_loss(
        pg_losses,
        mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
    )
    metrics: dict[str, Tensor] = {}
    if old_log_prob is not None:
        log_ratio = torch.clamp(log_prob - old_log_prob, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
        metrics["actor/ppo_kl"] = _masked_mean(-log_ratio, mask)
    return loss, metrics


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    loss_agg_mode: str = "seq-mean-token-mean",
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    clip_ratio_c: float | None = None,
    rollout_is_weights: Tensor | None = None,
    dp_size: int = 1,
    batch_num_tokens: Tensor | Real | None = None,
    global_batch_size: Tensor | Real | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): PPO clipping on a sequence-level ratio.

    s_i     = exp(mean over the valid tokens of row i of (log_prob - old_log_prob))  [B]
    s_i,t   = exp(clamp(sg[log s_i] + log_prob - sg[log_prob], max=10))   (value s_i, the
              gradient of token t's own log-prob: GSPO-token)
    loss    = max(-A*s_i,t, -A*clamp(s_i,t, 1 - clip_ratio_low, 1 + clip_ratio_high))
    then times `rollout_is_weights` (if given) and aggregated by `agg_loss`.

    As verl 0.9.1 defines it (value and gradient equal on the recorded cases): the sequence
    ratio is not clamped at +-20 (a length-normalised log-ratio is small), only the combined log
    ratio at 10; there is no dual clip, so `clip_ratio_c` is accepted for the shared signature and
    ignored. The clip ratios act on a sequence ratio near 1: the GSPO paper and verl's recipe use
    3e-4 / 4e-4 (the defaults here; set actor.clip_ratio_low/high to them) with
    loss_agg_mode="seq-mean-token-mean" (the default here; the actor passes actor.loss_agg_mode).
    A row without valid tokens has s_i = 1 and no weight in the loss.

    Metrics (detached 0-dim tensors, masked means over this call): "actor/pg_clipfrac" (the
    clipped term is the larger), "actor/ppo_kl" (old_log_prob - log_prob, unclamped) and
    "actor/pg_clipfrac_lower" (always 0: no dual clip).
    """
    _check_same_shape(
        "log_prob",
        log_prob,
        old_log_prob=old_log_prob,
        advantages=advantages,
        response_mask=response_mask,
        rollout_is_weights=rollout_is_weights,
    )
    _check_clip_band(clip_ratio_low, clip_ratio_high)
    mask = response_mask.to(log_prob.dtype)
    # Padding may hold anything: it never enters the sequence mean.
    log_ratio = torch.where(mask > 0, log_prob - old_log_prob, torch.zeros_like(log_prob))  # [B, T]
    seq_log_ratio = log_ratio.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)  # [B]
    # Value: the sequence ratio on every token; gradient: each token's own log-prob.
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))  # [B, T]

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()

    loss = agg_loss(
        pg_losses,
        mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
    )
    metrics = {
        "actor/pg_clipfrac": _masked_mean(loss_clipped > loss_unclipped, mask),
        "actor/ppo_kl": _masked_mean(-log_ratio, mask),
        "actor/pg_clipfrac_lower": torch.zeros((), dtype=mask.dtype, device=mask.device),
    }
    return loss, metrics


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float | None = None,
    rollout_is_weights: Tensor | None = None,
    dp_size: int = 1,
    batch_num_tokens: Tensor | Real | None = None,
    global_batch_size: Tensor | Real | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE weighted by a clipped, stopped IS ratio.

    ratio = exp(clamp(log_prob - old_log_prob, -20, 20))
    w     = sg[clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)]
    loss  = -w * A * log_prob, then times `rollout_is_weights` (if given) and aggregated by `agg_loss`.

    Unlike PPO clipping, no token loses its gradient: a clipped ratio only caps the token's weight.
    As verl 0.9.1 defines it (value and gradient equal on the recorded cases), with the clip
    bounds taken from actor.clip_ratio_low/high; there is no dual clip, so `clip_ratio_c` is
    accepted for the shared signature and ignored. The loss value is -w*A*log_prob (not a ratio),
    so it is not comparable with the vanilla loss's value; its gradient is -w*A*grad(log_prob).

    Metrics (detached 0-dim tensors, masked means over this call): "actor/pg_clipfrac" (tokens
    whose ratio was clipped), "actor/ppo_kl" (old_log_prob - log_prob, after the clamp) and
    "actor/pg_clipfrac_lower" (always 0: no dual clip).
    """
    _check_same_shape(
        "log_prob",
        log_prob,
        old_log_prob=old_log_prob,
        advantages=advantages,
        response_mask=response_mask,
        rollout_is_weights=rollout_is_weights,
    )
    _check_clip_band(clip_ratio_low, clip_ratio_high)
    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()

    loss = agg_loss(
        pg_losses,
        mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
    )
    metrics = {
        "actor/pg_clipfrac": _masked_mean(ratio != clipped_ratio, mask),
        "actor/ppo_kl": _masked_mean(-log_ratio, mask),
        "actor/pg_clipfrac_lower": torch.zeros((), dtype=mask.dtype, device=mask.device),
    }
    return loss, metrics
