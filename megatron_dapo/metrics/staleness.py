"""Off-policy staleness of the trajectories in a training batch.

Shape legend:
    B  trajectories in the batch
    min_policy_version, max_policy_version  [B] int  the oldest / newest policy version
                                                     (weight-sync count) that produced any
                                                     token of the trajectory

With partial rollouts a trajectory interrupted by a weight sync is resumed under the new
weights, so one trajectory can span several versions. Per trajectory:

    version_span     = max - min + 1       versions that produced it (1 = a single policy)
    lag_lower_bound  = current - max       how far its newest tokens lag the policy being trained
    lag_worst        = current - min       how far its oldest tokens lag (the worst case)

Each is reported as mean / max / min under `staleness/<name>/`.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["compute_staleness_metrics"]


def compute_staleness_metrics(
    *,
    min_policy_version: Tensor | Sequence[int],
    max_policy_version: Tensor | Sequence[int],
    current_policy_version: int,
) -> dict[str, float]:
    """Version span and lag statistics (see the module docstring); {} for an empty batch.

    Raises ValueError when a trajectory has min > max, a version < 0, or a max version newer
    than `current_policy_version` (a trajectory cannot come from a policy that does not exist
    yet: that means the version counters are out of step).
    """
    if isinstance(current_policy_version, bool) or not isinstance(current_policy_version, numbers.Integral):
        raise ValueError(f"current_policy_version: expected an int, got {current_policy_version!r}")
    lo = _as_versions("min_policy_version", min_policy_version)
    hi = _as_versions("max_policy_version", max_policy_version)
    if lo.shape != hi.shape:
        raise ValueError(
            f"min_policy_version has {lo.numel()} entries but max_policy_version has {hi.numel()}"
        )
    if lo.numel() == 0:
        return {}
    current = int(current_policy_version)
    _first_bad("min_policy_version", lo < 0, "a version is >= 0", lo)
    _first_bad("max_policy_version", hi < lo, "max_policy_version >= min_policy_version", hi)
    _first_bad("max_policy_version", hi > current, f"a version <= current_policy_version={current}", hi)

    stats = {
        "version_span": hi - lo + 1,
        "lag_lower_bound": current - hi,
        "lag_worst": current - lo,
    }
    stacked = torch.stack(
        [torch.stack([v.double().mean(), v.max().double(), v.min().double()]) for v in stats.values()]
    ).tolist()  # the one host sync
    metrics: dict[str, float] = {}
    for name, (mean, vmax, vmin) in zip(stats, stacked, strict=True):
        metrics[f"staleness/{name}/mean"] = mean
        metrics[f"staleness/{name}/max"] = vmax
        metrics[f"staleness/{name}/min"] = vmin
    return metrics


def _as_versions(name: str, x: Tensor | Sequence[int]) -> Tensor:
    t = x if isinstance(x, Tensor) else torch.as_tensor(list(x))
    if t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of versions [B], got shape {list(t.shape)}")
    if t.numel() and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
        raise ValueError(f"{name}: expected integer policy versions, got dtype {t.dtype}")
    return t.long()


def _first_bad(name: str, bad: Tensor, expected: str, values: Tensor) -> None:
    if bool(bad.any()):
        row = int(bad.int().argmax())
        raise ValueError(f"{name}[{row}] = {int(values[row])}: expected {expected}")
