"""KL penalty estimators and KL-coefficient controllers.

Shape legend:
    logprob, ref_logprob and the returned penalty: any shape, the same for all three
    (in practice [B, T]: B responses, T padded response length)

Estimators of KL(pi || pi_ref) from samples of pi, per token, with d = logprob - ref_logprob:
    k1 = d                 unbiased value, but its gradient is not the KL's gradient
    k2 = d^2 / 2           biased value, but the right gradient (its gradient is d * grad logprob)
    k3 = exp(-d) + d - 1   unbiased, low-variance, non-negative value (Schulman's estimator)
A trailing "+" on a name keeps the forward value of that estimator and takes k2's gradient
(straight-through), so a loss term gets an unbiased value *and* a correct gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "KL_PENALTY_TYPES",
    "AdaptiveKLController",
    "FixedKLController",
    "get_kl_controller",
    "kl_penalty",
]

KL_PENALTY_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")


def _kl_forward(logprob: Tensor, ref_logprob: Tensor, name: str) -> Tensor:
    if name in ("kl", "k1"):
        return logprob - ref_logprob
    if name == "abs":
        return (logprob - ref_logprob).abs()
    if name in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if name in ("low_var_kl", "k3"):
        # The clamps keep exp() finite and bound the per-token penalty for outlier tokens.
        kl = torch.clamp(ref_logprob - logprob, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(kl) - kl - 1.0, min=-10.0, max=10.0)
    if name == "full":
        raise NotImplementedError(
            "kl_penalty 'full' needs the full vocabulary distributions; it is not implemented"
        )
    raise ValueError(
        f"unknown kl_penalty {name!r}; valid: {list(KL_PENALTY_TYPES)}, each optionally with a '+' suffix"
    )


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """Per-token KL penalty between the policy and the reference; see the module docstring.

    `kl_penalty` is one of KL_PENALTY_TYPES, optionally with a trailing "+":
    `k2 - k2.detach() + base.detach()` (forward = base, gradient = k2's). "k2+"/"mse+" equal k2.
    """
    if not isinstance(kl_penalty, str):
        raise ValueError(f"kl_penalty must be a string such as 'k3' or 'k3+', got {kl_penalty!r}")
    if logprob.shape != ref_logprob.shape:
        raise ValueError(
            f"ref_logprob has shape {tuple(ref_logprob.shape)}, expected {tuple(logprob.shape)} (logprob's shape)"
        )
    straight_through = kl_penalty.endswith("+")
    base_name = kl_penalty[:-1] if straight_through else kl_penalty
    forward = _kl_forward(logprob, ref_logprob, base_name)
    if not straight_through or base_name in ("mse", "k2"):
        return forward
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + forward.detach()


class FixedKLController:
    """A constant KL coefficient; `update` is a no-op kept for a uniform interface."""

    def __init__(self, kl_coef: float):
        if not kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef!r}")
        self.value = float(kl_coef)

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        """Nothing to adapt."""


class AdaptiveKLController:
    """PPO's adaptive KL coefficient (Ziegler et al. 2019): steer the measured KL to `target_kl`.

    update(current_kl, n_steps):
        proportional_error = clip(current_kl / target_kl - 1, -0.2, 0.2)
        value *= 1 + proportional_error * n_steps / horizon
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if not init_kl_coef >= 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef!r}")
        if target_kl is None or not target_kl > 0:
            raise ValueError(f"target_kl must be > 0 for the adaptive KL controller, got {target_kl!r}")
        if horizon is None or not horizon > 0:
            raise ValueError(f"horizon must be > 0 for the adaptive KL controller, got {horizon!r}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        """Scale the coefficient by the clipped relative error of `current_kl` (a float or 0-dim tensor)."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def get_kl_controller(
    type: str, kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> FixedKLController | AdaptiveKLController:
    """Build the controller named by `type`: "fixed" or "adaptive" (needs target_kl > 0 and horizon > 0)."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl=target_kl, horizon=horizon)
    raise ValueError(f"unknown KL controller type {type!r}; valid: ['fixed', 'adaptive']")
