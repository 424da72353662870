"""The numerical contract between the actor and the rollout engine: how far the engine's log-probs of the
sampled tokens are from the actor's own (recomputed by the old_log_prob pass, or by the on-policy update's
forward), logged every step under the names other trainers gate their runs on, and an alarm.

    rollout_corr/token_mult_prob_error   mean over response tokens of exp(|log p_actor - log p_engine|)
                                         (NeMo-RL's multiplicative probability error; 1 = identical)
    rollout_corr/mismatch_kl             mean over response tokens of r - log r - 1, log r = log p_actor -
                                         log p_engine: the k3 estimate of KL(engine || actor) from the
                                         engine's samples (prime-rl's mismatch KL; 0 = identical)

`rollout.mismatch_alarm` sets a threshold for each (defaults: NeMo-RL's nightly gate of 1.05 and prime-rl's
0.015). A step above either logs one warning naming the step, the metric, its value and the data sources
of the worst rows; `stop_after` consecutive such steps stop the run with MismatchAlarmError (0: warn only).
Every rank holds the same metrics, so every rank raises together.

Shape legend: B rows, T response positions.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import Tensor

log = logging.getLogger(__name__)

METRICS = {"token_mult_prob_error": "rollout_corr/token_mult_prob_error", "mismatch_kl": "rollout_corr/mismatch_kl"}


class MismatchAlarmError(RuntimeError):
    """rollout.mismatch_alarm.stop_after consecutive steps were above a threshold."""


def mismatch_metrics(actor_log_probs: Tensor, engine_log_probs: Tensor, mask: Tensor) -> dict[str, float]:
    """The two contract metrics over the response tokens of mask [B, T]."""
    # float64, and r - log r - 1 as expm1(log r) - log r: at round-off agreement (|log r| ~ 1e-6) float32
    # exp(x) - x - 1 is cancellation noise of +-1e-7 around the true x^2/2 ~ 5e-13, negative as often as not.
    lr = (actor_log_probs.double() - engine_log_probs.double()) * mask
    n = mask.sum().clamp(min=1)
    return {METRICS["token_mult_prob_error"]: float((torch.exp(lr.abs()) * mask).sum() / n),
            METRICS["mismatch_kl"]: float(((torch.expm1(lr) - lr) * mask).sum() / n)}


class MismatchAlarm:
    """Checks each step's contract metrics against rollout.mismatch_alarm (module docstring)."""

    def __init__(self, cfg, *, is_rank0: bool = True):
        self.limits = {METRICS[name]: getattr(cfg, name) for name in METRICS}
        self.stop_after, self.is_rank0 = cfg.stop_after, is_rank0
        self.consecutive = 0

    def check(self, step: int, metrics: dict[str, float], *, actor_log_probs: Tensor, engine_log_probs: Tensor,
              mask: Tensor, data_sources=None) -> None:
        over = [(key, metrics[key], limit) for key, limit in self.limits.items()
                if key in metrics and metrics[key] > limit]
        if not over:
            self.consecutive = 0
            return
        self.consecutive += 1
        if self.is_rank0:
            lr = (actor_log_probs.float() - engine_log_probs.float()).abs() * mask
            per_row = (torch.exp(lr) * mask).sum(1) / mask.sum(1).clamp(min=1)
            worst = per_row.topk(min(8, len(per_row))).indices.tolist()
            sources = Counter(data_sources[i] if data_sources else "unknown" for i in worst)
            log.warning("step %d: rollout/training mismatch above rollout.mismatch_alarm: %s; the %d worst rows "
                        "(token_mult_prob_error up to %.4g) come from %s", step,
                        ", ".join(f"{k.split('/')[-1]}={v:.4g} > {limit:g}" for k, v, limit in over), len(worst),
                        float(per_row.max()), dict(sources.most_common()))
        if self.stop_after and self.consecutive >= self.stop_after:
            k, v, limit = over[0]
            raise MismatchAlarmError(
                f"step {step}: {k.split('/')[-1]}={v:.4g} > {limit:g} for {self.consecutive} consecutive steps "
                f"(rollout.mismatch_alarm.stop_after={self.stop_after}): the engine's log-probs are not the actor's; "
                "check the weight sync (rollout_corr/log_prob_abs_diff), the engine's dtype and kernels")
