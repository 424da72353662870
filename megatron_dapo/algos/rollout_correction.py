"""Rollout correction: importance weights and rejection sampling for the rollout/training mismatch.

The rollout engine (SGLang, bf16/fp8 kernels, maybe a stale checkpoint) samples from pi_rollout,
while the loss assumes samples from pi_old (the training engine's recomputation). Per token
    lr = clamp(old_log_prob - rollout_log_prob, -20, 20),   r = exp(lr) = pi_old / pi_rollout
gives importance weights (IS) and divergence statistics for rejection sampling (RS):
    k1 = -lr,  k2 = lr^2 / 2,  k3 = exp(lr) - 1 - lr
(under rollout samples E[k1] = E[k3] = KL(pi_rollout || pi_old)).

Shape legend:
    B  responses, T padded response length
    old_log_prob, rollout_log_prob, response_mask, is_weights, returned mask: [B, T]
    per-sequence statistics: [B]; every metric: [] (detached 0-dim tensor)

IS weights and rejection sampling are computed independently from the input mask, as verl 0.9.1 does:
batch normalisation averages over every valid input token (or sequence), rejected ones included, and a
rejected token keeps its weight (the returned mask removes it from the loss).
"""

from __future__ import annotations

import math
from numbers import Real

import torch
from torch import Tensor

__all__ = [
    "ROLLOUT_CORRECTION_PRESETS",
    "ROLLOUT_RS_MODES",
    "compute_rollout_correction",
    "get_rollout_correction_preset",
]

ROLLOUT_RS_MODES = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
_IS_LEVELS = ("token", "sequence")
_LOG_RATIO_BOUND = 20.0


# ---------------------------------------------------------------------------------------------
# Threshold parsing (pure Python, no tensors)
# ---------------------------------------------------------------------------------------------


def _parse_number(text: str | Real, argument: str, context: str) -> float:
    if isinstance(text, bool):
        raise ValueError(f"{argument}: expected a number in {context}, got a bool")
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{argument}: {text!r} in {context} is not a number") from None
    if math.isnan(value) or value <= 0:
        raise ValueError(f"{argument}: bounds must be positive, got {text!r} in {context}")
    return value


def _parse_band(spec: str | Real, argument: str, context: str) -> tuple[float | None, float]:
    """A number u -> (None, u); a string "lower_upper" -> (lower, upper) with 0 < lower <= upper."""
    if isinstance(spec, str) and "_" in spec:
        parts = spec.strip().split("_")
        if len(parts) != 2:
            raise ValueError(f"{argument}: expected 'lower_upper' in {context}, got {spec!r}")
        lower = _parse_number(parts[0], argument, context)
        upper = _parse_number(parts[1], argument, context)
        if lower > upper:
            raise ValueError(f"{argument}: lower bound {lower} > upper bound {upper} in {context}")
        return lower, upper
    if not isinstance(spec, str | Real) or isinstance(spec, bool):
        raise ValueError(
            f"{argument}: expected a number or a 'lower_upper' string in {context}, got {spec!r}"
        )
    return None, _parse_number(spec.strip() if isinstance(spec, str) else spec, argument, context)


def _parse_rs(
    rollout_rs: str, rollout_rs_threshold: str | Real | None
) -> list[tuple[str, float | None, float]]:
    """[(mode, lower, upper)]: for k1 modes log-space bounds on k1; for k2/k3 (None, upper)."""
    if not isinstance(rollout_rs, str):
        raise ValueError(f"rollout_rs must be a string of comma-joined modes, got {rollout_rs!r}")
    modes = [mode.strip() for mode in rollout_rs.split(",")]
    for mode in modes:
        if mode not in ROLLOUT_RS_MODES:
            raise ValueError(
                f"rollout_rs: unknown mode {mode!r} in {rollout_rs!r}; valid: {list(ROLLOUT_RS_MODES)}"
            )
    if rollout_rs_threshold is None:
        raise ValueError(
            f"rollout_rs_threshold is required when rollout_rs is set (rollout_rs={rollout_rs!r})"
        )
    if isinstance(rollout_rs_threshold, str):
        specs: list[str | Real] = [spec.strip() for spec in rollout_rs_threshold.split(",")]
    elif isinstance(rollout_rs_threshold, Real) and not isinstance(rollout_rs_threshold, bool):
        specs = [rollout_rs_threshold]
    else:
        raise ValueError(f"rollout_rs_threshold must be a number or a string, got {rollout_rs_threshold!r}")
    if len(specs) not in (1, len(modes)):
        raise ValueError(
            f"rollout_rs_threshold has {len(specs)} specs, expected 1 (shared) or {len(modes)} "
            f"(one per mode of rollout_rs={rollout_rs!r})"
        )
    if len(specs) == 1:
        specs = specs * len(modes)

    parsed = []
    for mode, spec in zip(modes, specs, strict=True):
        context = f"the threshold {spec!r} of mode {mode!r}"
        lower, upper = _parse_band(spec, "rollout_rs_threshold", context)
        if mode.endswith("k1"):
            # A ratio band on k1 = log(pi_rollout / pi_old); a single u means [1/u, u].
            if lower is None:
                lower = 1.0 / upper
                if lower > upper:
                    raise ValueError(
                        f"rollout_rs_threshold: a single bound u for a k1 mode needs u >= 1 ({context})"
                    )
            parsed.append((mode, math.log(lower), math.log(upper)))
        else:
            if lower is not None:
                raise ValueError(
                    f"rollout_rs_threshold: k2/k3 modes take a single positive upper bound, not a range ({context})"
                )
            parsed.append((mode, None, upper))
    return parsed


# ---------------------------------------------------------------------------------------------
# Tensor helpers
# ---------------------------------------------------------------------------------------------


def _mean(values: Tensor, weights: Tensor) -> Tensor:
    """Weighted mean with 0/1 weights; 0 when nothing is valid."""
    return (values * weights).sum() / weights.sum().clamp(min=1)


def _masked_extreme(values: Tensor, valid: Tensor, largest: bool) -> Tensor:
    fill = float("-inf") if largest else float("inf")
    filled = values.masked_fill(~valid, fill)
    extreme = filled.max() if largest else filled.min()
    return torch.where(valid.any(), extreme, torch.zeros_like(extreme))


def _rejection_keep(
    log_ratio: Tensor, valid: Tensor, modes: list[tuple[str, float | None, float]]
) -> tuple[Tensor, dict[str, Tensor]]:
    """Bool keep mask [B, T] (every mode must keep a token) and the per-mode reject fractions."""
    maskf = valid.to(log_ratio.dtype)
    stats = {
        "k1": -log_ratio,
        "k2": 0.5 * log_ratio.square(),
        "k3": torch.exp(log_ratio) - 1.0 - log_ratio,
    }
    tokens_per_seq = maskf.sum(dim=-1)  # [B]
    keep_all = torch.ones_like(valid)
    metrics = {}
    for mode, lower, upper in modes:
        level, stat_name = mode.rsplit("_", 1)
        token_stat = stats[stat_name]  # [B, T]
        if level == "token":
            stat = token_stat
        elif level == "seq_sum":
            stat = (token_stat * maskf).sum(dim=-1, keepdim=True)  # [B, 1]
        elif level == "seq_mean":
            stat = (token_stat * maskf).sum(dim=-1, keepdim=True) / tokens_per_seq.clamp(min=1).unsqueeze(-1)
        else:  # seq_max
            stat = token_stat.masked_fill(~valid, float("-inf")).amax(dim=-1, keepdim=True)
        keep = stat <= upper
        if lower is not None:
            keep = keep & (stat >= lower)
        keep = keep.expand_as(valid)
        metrics[f"rollout_corr/rs_reject_frac/{mode}"] = _mean((~keep).to(maskf.dtype), maskf)
        keep_all = keep_all & keep
    return keep_all, metrics


def _is_weights(
    log_ratio: Tensor,
    kept: Tensor,
    rollout_is: str,
    lower: float | None,
    upper: float,
    batch_normalize: bool,
) -> tuple[Tensor, dict[str, Tensor]]:
    """IS weights [B, T] (0 outside `kept`) and their metrics, over tokens or sequences."""
    maskf = kept.to(log_ratio.dtype)
    if rollout_is == "token":
        raw = torch.exp(log_ratio)  # [B, T]
        unit_valid = kept  # one weight per valid token
    else:
        seq_log_ratio = torch.clamp((log_ratio * maskf).sum(dim=-1), -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
        raw = torch.exp(seq_log_ratio)  # [B]
        unit_valid = kept.any(dim=-1)  # one weight per sequence with a valid token
    if lower is None:
        outside = raw > upper
        weights = torch.clamp(raw, max=upper)  # truncated IS
    else:
        outside = (raw < lower) | (raw > upper)
        weights = torch.where(outside, torch.zeros_like(raw), raw)  # masked IS: zero outside the band
    unit_validf = unit_valid.to(raw.dtype)
    if batch_normalize:
        mean = _mean(weights, unit_validf)
        weights = torch.where(mean > 0, weights / mean, weights)
    metrics = {
        "rollout_corr/is_weight_mean": _mean(weights, unit_validf),
        "rollout_corr/is_weight_max": _masked_extreme(weights, unit_valid, largest=True),
        "rollout_corr/is_weight_min": _masked_extreme(weights, unit_valid, largest=False),
        "rollout_corr/is_clip_frac": _mean(outside.to(raw.dtype), unit_validf),
        # Effective sample size fraction (mean w)^2 / mean(w^2), in (0, 1]; 1 = uniform weights.
        "rollout_corr/is_ess": _mean(weights, unit_validf).square()
        / _mean(weights.square(), unit_validf).clamp(min=1e-12),
    }
    if rollout_is == "sequence":
        weights = weights.unsqueeze(-1).expand_as(log_ratio)
    return weights * maskf, metrics


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def compute_rollout_correction(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: str | Real | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | Real | None = None,
) -> tuple[Tensor | None, Tensor, dict[str, Tensor]]:
    """IS weights, the response mask after rejection sampling, and mismatch metrics.

    rollout_is: None (metrics only), "token" (w = r per token) or "sequence"
        (w = exp(clamp(sum_t lr*mask, -20, 20)) broadcast over the sequence).
    rollout_is_threshold: a number u truncates (w = min(w, u)); "lower_upper" zeroes weights
        outside [lower, upper]. Required (not None) when rollout_is is set.
    rollout_is_batch_normalize: rescale so the mean weight over valid tokens (token level) or
        valid sequences (sequence level) is 1.0; applied after the threshold.
    rollout_rs: one mode of ROLLOUT_RS_MODES or several joined by commas; a token survives only if
        every mode keeps it; seq_* decisions apply to all tokens of the sequence.
    rollout_rs_threshold: one spec for all modes or one per mode, comma-separated. k1 modes: a
        "lower_upper" ratio band (kept where log(lower) <= k1 <= log(upper)), or a single u for
        [1/u, u]; k2/k3 modes: a single positive upper bound (kept where stat <= upper).

    Returns (weights [B, T] in float32 or wider, 0 on padding, computed over the input mask as verl
    does, so a rejected token keeps its weight and batch normalisation counts it; detached; or None
    when rollout_is is None), the response mask [B, T] (input dtype) with rejected tokens zeroed (the
    input is not modified; it is what removes them from the loss), and metrics under "rollout_corr/".
    """
    if old_log_prob.dim() != 2:
        raise ValueError(f"old_log_prob must be a [B, T] tensor, got shape {tuple(old_log_prob.shape)}")
    for name, tensor in (("rollout_log_prob", rollout_log_prob), ("response_mask", response_mask)):
        if tensor.shape != old_log_prob.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected {tuple(old_log_prob.shape)} (old_log_prob's shape)"
            )
    if rollout_is is not None and rollout_is not in _IS_LEVELS:
        raise ValueError(f"rollout_is must be None, 'token' or 'sequence', got {rollout_is!r}")
    if not isinstance(rollout_is_batch_normalize, bool):
        raise ValueError(f"rollout_is_batch_normalize must be a bool, got {rollout_is_batch_normalize!r}")
    is_band = None
    if rollout_is is not None:
        if rollout_is_threshold is None:
            raise ValueError(
                "rollout_is_threshold is required when rollout_is is set: a number u (truncate at u) "
                "or a string 'lower_upper' (zero weights outside the band)"
            )
        is_band = _parse_band(
            rollout_is_threshold, "rollout_is_threshold", f"the spec {rollout_is_threshold!r}"
        )
    rs_modes = _parse_rs(rollout_rs, rollout_rs_threshold) if rollout_rs is not None else []

    # Float32 at least: the sequence sums and exps lose too much in bf16.
    dtype = torch.promote_types(old_log_prob.dtype, torch.float32)
    valid = response_mask.bool()
    maskf = valid.to(dtype)
    log_ratio = torch.clamp(
        old_log_prob.to(dtype) - rollout_log_prob.to(dtype), -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND
    )
    # Padding may hold anything (even inf/nan from a dummy log-prob): neutralise it once here.
    log_ratio = torch.where(valid, log_ratio, torch.zeros_like(log_ratio))

    metrics = _mismatch_metrics(old_log_prob.to(dtype), rollout_log_prob.to(dtype), log_ratio, valid)

    kept = valid
    if rs_modes:
        keep, rs_metrics = _rejection_keep(log_ratio, valid, rs_modes)
        kept = valid & keep
        metrics.update(rs_metrics)
        rejected = (valid & ~keep).to(dtype)
        metrics["rollout_corr/rs_reject_frac"] = _mean(rejected, maskf)
        seq_valid = valid.any(dim=-1).to(dtype)
        metrics["rollout_corr/rs_seq_reject_frac"] = _mean((rejected.sum(dim=-1) > 0).to(dtype), seq_valid)
    new_mask = torch.where(kept, response_mask, torch.zeros_like(response_mask))

    weights = None
    if rollout_is is not None:
        lower, upper = is_band
        weights, is_metrics = _is_weights(  # over the input mask, not `kept`: verl 0.9.1's weights
            log_ratio, valid, rollout_is, lower, upper, rollout_is_batch_normalize
        )
        metrics.update(is_metrics)
    return weights, new_mask, metrics


def _mismatch_metrics(
    old_log_prob: Tensor, rollout_log_prob: Tensor, log_ratio: Tensor, valid: Tensor
) -> dict:
    """Off-policy diagnostics over the valid tokens of the input mask, defined as verl 0.9.1 does.

    Users put these next to verl's curves, so the definitions are verl's, including where they
    differ from the IS/RS statistics above: `kl`, `k3_kl` and the per-row log-ratio sum of
    `chi2_seq` use the *unclamped* log ratio (`chi2_token` and the sum are clamped at +-20 before
    exp); per-sequence statistics (the ppl, log_ppl and chi2_seq metrics) average over *every* row,
    a row without valid tokens counting as a mean log-prob of 0 (ppl 1, log ratio 0).
    """
    maskf = valid.to(log_ratio.dtype)
    zero = torch.zeros_like(log_ratio)
    raw_log_ratio = torch.where(valid, old_log_prob - rollout_log_prob, zero)  # [B, T], unclamped
    tokens_per_seq = maskf.sum(dim=-1).clamp(min=1)  # [B]
    old_mean = torch.where(valid, old_log_prob, zero).sum(dim=-1) / tokens_per_seq  # [B]
    rollout_mean = torch.where(valid, rollout_log_prob, zero).sum(dim=-1) / tokens_per_seq  # [B]
    log_ppl_diff = rollout_mean - old_mean  # [B] = log(training_ppl / rollout_ppl) per row
    seq_log_ratio = torch.clamp(raw_log_ratio.sum(dim=-1), -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)  # [B]
    return {
        "rollout_corr/log_ratio_mean": _mean(log_ratio, maskf),
        "rollout_corr/kl": _mean(-raw_log_ratio, maskf),
        "rollout_corr/k3_kl": _mean(torch.exp(raw_log_ratio) - raw_log_ratio - 1.0, maskf),
        "rollout_corr/chi2_token": _mean(torch.exp(log_ratio).square(), maskf) - 1.0,
        "rollout_corr/chi2_seq": _over_rows(torch.exp(2.0 * seq_log_ratio), torch.mean) - 1.0,
        "rollout_corr/training_ppl": _over_rows(torch.exp(-old_mean), torch.mean),
        "rollout_corr/training_log_ppl": _over_rows(-old_mean, torch.mean),
        "rollout_corr/rollout_ppl": _over_rows(torch.exp(-rollout_mean), torch.mean),
        "rollout_corr/rollout_log_ppl": _over_rows(-rollout_mean, torch.mean),
        "rollout_corr/log_ppl_diff": _over_rows(log_ppl_diff, torch.mean),
        "rollout_corr/log_ppl_abs_diff": _over_rows(log_ppl_diff.abs(), torch.mean),
        "rollout_corr/log_ppl_diff_max": _over_rows(log_ppl_diff, torch.max),
        "rollout_corr/log_ppl_diff_min": _over_rows(log_ppl_diff, torch.min),
        "rollout_corr/ppl_ratio": _over_rows(torch.exp(log_ppl_diff), torch.mean),
    }


def _over_rows(values: Tensor, reduce) -> Tensor:
    """A reduction over the B rows; 0 for an empty batch (B = 0) instead of NaN or an error."""
    return reduce(values) if values.numel() else values.new_zeros(())


# ---------------------------------------------------------------------------------------------
# Presets: every keyword of compute_rollout_correction, plus how the actor uses the result.
#   bypass_mode False ("decoupled"): old_log_prob is recomputed by the actor and the correction is
#     computed once per batch; True ("bypass"): the rollout log-probs serve as old_log_prob.
#   loss_type: "ppo_clip" (compute_policy_loss_vanilla) or "reinforce".
# ---------------------------------------------------------------------------------------------

_NO_CORRECTION = {
    "rollout_is": None,
    "rollout_is_threshold": 2.0,
    "rollout_is_batch_normalize": False,
    "rollout_rs": None,
    "rollout_rs_threshold": None,
}

ROLLOUT_CORRECTION_PRESETS: dict[str, dict] = {
    # Token-level truncated IS (TIS): low variance, some bias.
    "decoupled_token_is": {
        **_NO_CORRECTION,
        "rollout_is": "token",
        "bypass_mode": False,
        "loss_type": "ppo_clip",
    },
    # Sequence-level truncated IS: unbiased up to truncation, higher variance.
    "decoupled_seq_is": {
        **_NO_CORRECTION,
        "rollout_is": "sequence",
        "bypass_mode": False,
        "loss_type": "ppo_clip",
    },
    # Geometric-mean rejection: drop sequences whose per-token ratio drifts beyond 0.1%.
    "decoupled_geo_rs": {
        **_NO_CORRECTION,
        "rollout_rs": "seq_mean_k1",
        "rollout_rs_threshold": "0.999_1.001",
        "bypass_mode": False,
        "loss_type": "ppo_clip",
    },
    # The PPO ratio against the rollout policy already clips the mismatch.
    "bypass_ppo_clip": {**_NO_CORRECTION, "bypass_mode": True, "loss_type": "ppo_clip"},
    # Policy gradient with sequence-level IS weights, no clipping.
    "bypass_pg_is": {
        **_NO_CORRECTION,
        "rollout_is": "sequence",
        "bypass_mode": True,
        "loss_type": "reinforce",
    },
}


def get_rollout_correction_preset(name: str) -> dict:
    """A copy of the preset `name` (so callers cannot alter the shared table)."""
    try:
        return dict(ROLLOUT_CORRECTION_PRESETS[name])
    except KeyError:
        raise ValueError(
            f"unknown rollout correction preset {name!r}; valid: {sorted(ROLLOUT_CORRECTION_PRESETS)}"
        ) from None
