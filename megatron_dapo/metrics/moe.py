"""MoE router load balance, accumulated over a step's micro-batches and reported once.

Shape legend:
    B  responses, T padded response length
    L  MoE layers, K experts per token (router top-k), E experts per layer
    routed_experts  [B, T, L, K]  int   expert id chosen by layer l for token t of response b
                                        (the layout SGLang's routed-experts replay returns per
                                        sample, [T, L, K], padded to a batch)
    response_mask   [B, T]        0/1   only tokens with mask 1 are counted; padded positions
                                        may hold anything (e.g. -1)
    counts          [L, E]        int   token->expert assignments per layer and expert

Load of expert e in layer l = the number of (token, top-k slot) assignments routed to it.
Imbalance of a layer = max_e load / mean_e load: 1.0 is perfectly even, E means every token went
to one expert. Counts stay on the device of the first update; with `num_experts` given, `update`
never synchronises with the host, which sees the counts once, in `compute()`. Under data parallelism each rank holds its own counts;
all-reduce `accumulator.counts` (a SUM over the DP group) before `compute()` for global figures.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["MoELoadBalanceAccumulator"]


class MoELoadBalanceAccumulator:
    """Per-layer, per-expert assignment counts; `add_to_metrics` publishes them and resets.

    `num_experts=None` infers E as (largest expert id seen) + 1 and widens the counts when a
    larger id shows up; an experts-never-chosen tail is then invisible, so pass the model's
    expert count when it is known.
    """

    def __init__(self, num_experts: int | None = None) -> None:
        if num_experts is not None and (
            isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1
        ):
            raise ValueError(f"num_experts: expected an int >= 1 or None, got {num_experts!r}")
        self.num_experts = num_experts
        self._counts: Tensor | None = None  # [L, E] int64
        self._num_tokens: Tensor | int = 0  # masked tokens seen by update(); a device tensor
        self._overflow: Tensor | int = 0  # out-of-range ids at counted positions (see update)

    @classmethod
    def from_counts(cls, counts: Tensor, num_experts: int | None = None) -> MoELoadBalanceAccumulator:
        """An accumulator holding `counts` [L, E], for actors that count routing themselves."""
        acc = cls(num_experts=num_experts)
        acc.update_counts(counts)
        return acc

    @property
    def counts(self) -> Tensor | None:
        """The accumulated [L, E] int64 counts (None before any update); in place for all-reduce."""
        return self._counts

    def update(self, routed_experts: Tensor, response_mask: Tensor) -> None:
        """Count the experts chosen for the tokens where `response_mask` is set.

        With `num_experts` known this never synchronises with the device: an id outside
        [0, num_experts) at a counted position goes to an overflow tally that `compute()` turns
        into a ValueError. With `num_experts=None` the largest id must reach the host to size
        the counts, one small sync per call.
        """
        if not isinstance(routed_experts, Tensor) or routed_experts.dim() != 4:
            raise ValueError(
                f"routed_experts: expected an int tensor of shape [B, T, L, K], got {_describe(routed_experts)}"
            )
        if routed_experts.dtype.is_floating_point or routed_experts.dtype == torch.bool:
            raise ValueError(f"routed_experts: expected integer expert ids, got dtype {routed_experts.dtype}")
        b, t, num_layers, _ = routed_experts.shape
        if not isinstance(response_mask, Tensor) or tuple(response_mask.shape) != (b, t):
            raise ValueError(
                f"response_mask: expected shape [B={b}, T={t}] to match routed_experts, got {_describe(response_mask)}"
            )
        if routed_experts.numel() == 0:
            return  # an empty micro-batch routes nothing
        ids = routed_experts.long()
        keep = response_mask.bool()[:, :, None, None].expand_as(ids)  # [B, T, L, K]
        if self.num_experts is not None:
            width = self.num_experts
        else:
            lo, hi = torch.stack([ids.masked_fill(~keep, 0).min(), ids.masked_fill(~keep, -1).max()]).tolist()
            if lo < 0:
                raise ValueError(
                    f"routed_experts: expert id {lo} < 0 at a position where response_mask is set"
                )
            width = max(hi + 1, self._width(), 1)
        # Column `width` is the overflow bin for out-of-range ids; masked positions add weight 0
        # wherever they land. One scatter_add for all layers: (layer l, column c) is bin
        # l * (width + 1) + c.
        in_range = (ids >= 0) & (ids < width)
        column = torch.where(in_range, ids, torch.full_like(ids, width))
        layer = torch.arange(num_layers, device=ids.device).view(1, 1, num_layers, 1)
        bins = (layer * (width + 1) + column).reshape(-1)
        tally = torch.zeros(num_layers * (width + 1), dtype=torch.long, device=ids.device)
        tally.scatter_add_(0, bins, keep.reshape(-1).long())
        tally = tally.view(num_layers, width + 1)
        self._add(tally[:, :width], source="routed_experts")
        self._overflow = self._overflow + tally[:, width].sum()
        self._num_tokens = self._num_tokens + response_mask.bool().sum()

    def update_counts(self, counts: Tensor) -> None:
        """Add per-layer per-expert counts [L, E] computed elsewhere (e.g. by the router)."""
        if not isinstance(counts, Tensor) or counts.dim() != 2:
            raise ValueError(f"counts: expected a tensor of shape [L, E], got {_describe(counts)}")
        if counts.dtype.is_floating_point:
            if not bool((counts == counts.round()).all()):
                raise ValueError("counts: expected whole numbers of assignments, got fractional values")
        if counts.numel() and int(counts.min()) < 0:
            raise ValueError("counts: assignment counts must be >= 0")
        if self.num_experts is not None and counts.shape[1] != self.num_experts:
            raise ValueError(f"counts: expected E={self.num_experts} columns, got {counts.shape[1]}")
        self._add(counts.long(), source="counts")

    def compute(self) -> dict[str, float]:
        """Metrics of the counts so far ({} when nothing was accumulated); does not reset.

        Per layer i: `moe/layer_<i>/max_load`, `moe/layer_<i>/mean_load` (assignments) and
        `moe/layer_<i>/imbalance` (max / mean; 0.0 for a layer that received no assignment, which
        is then left out of the aggregates). Across layers: `moe/load_imbalance/mean|max|min`,
        plus `moe/num_layers`, `moe/num_experts`, `moe/num_assignments` (all layers) and
        `moe/num_tokens` (masked tokens seen through `update`; counts added with
        `update_counts` carry no token count).
        """
        if self._counts is None:
            return {}
        overflow = int(self._overflow)
        if overflow:
            raise ValueError(
                f"routed_experts: {overflow} expert ids outside [0, num_experts={self.num_experts}) "
                "at positions where response_mask is set (found now: update() does not sync)"
            )
        counts = self._counts.double()
        num_layers, width = counts.shape
        max_load = counts.max(-1).values
        mean_load = counts.sum(-1) / width
        imbalance = torch.where(
            mean_load > 0, max_load / mean_load.clamp_min(1e-30), torch.zeros_like(mean_load)
        )
        host = torch.stack([max_load, mean_load, imbalance]).tolist()  # the one host sync
        total = int(self._counts.sum())
        metrics: dict[str, float] = {}
        for i in range(num_layers):
            metrics[f"moe/layer_{i}/max_load"] = host[0][i]
            metrics[f"moe/layer_{i}/mean_load"] = host[1][i]
            metrics[f"moe/layer_{i}/imbalance"] = host[2][i]
        active = [host[2][i] for i in range(num_layers) if host[1][i] > 0]
        metrics["moe/load_imbalance/mean"] = sum(active) / len(active) if active else 0.0
        metrics["moe/load_imbalance/max"] = max(active) if active else 0.0
        metrics["moe/load_imbalance/min"] = min(active) if active else 0.0
        metrics["moe/num_layers"] = float(num_layers)
        metrics["moe/num_experts"] = float(width)
        metrics["moe/num_assignments"] = float(total)
        metrics["moe/num_tokens"] = float(self._num_tokens)
        return metrics

    def add_to_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Write `compute()` into `metrics` (in place, also returned) and reset the accumulator."""
        metrics.update(self.compute())
        self.reset()
        return metrics

    def reset(self) -> None:
        self._counts = None
        self._num_tokens = 0
        self._overflow = 0

    def _width(self) -> int:
        return 0 if self._counts is None else self._counts.shape[1]

    def _add(self, counts: Tensor, *, source: str) -> None:
        if self._counts is None:
            self._counts = counts.clone()
            return
        if counts.shape[0] != self._counts.shape[0]:
            raise ValueError(
                f"{source}: {counts.shape[0]} MoE layers, but earlier updates had {self._counts.shape[0]}"
            )
        if counts.device != self._counts.device:
            raise ValueError(
                f"{source}: on {counts.device}, but earlier updates were on {self._counts.device}"
            )
        # Only with inferred num_experts: widen whichever side is narrower.
        width = max(counts.shape[1], self._counts.shape[1])
        self._counts = _pad_cols(self._counts, width) + _pad_cols(counts, width)


def _pad_cols(x: Tensor, width: int) -> Tensor:
    return x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))


def _describe(x: object) -> str:
    return f"shape {list(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
