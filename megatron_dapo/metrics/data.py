"""Per-step batch statistics for the dashboard: scores, rewards, advantages, returns, lengths, aborts.

Shape legend:
    B  responses in the batch
    T  padded response length
    scores, rewards              [B]     float  sequence score (reward function output) and the
                                                sequence reward after shaping / in-reward KL
    advantages, returns          [B, T]  float
    response_mask                [B, T]  0/1 (bool or float)
    response_length              [B]     int    generated tokens per response
    prompt_length                [B]     int    prompt tokens per response
    aborted                      [B]     bool   True for responses the engine aborted

All statistics are reduced on the inputs' device and moved to the host with a single `.tolist()`,
so a GPU batch costs one synchronisation for the whole dictionary, not one per metric.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["compute_data_metrics", "compute_overlong_metrics", "reward_extra_metrics"]


def compute_data_metrics(
    *,
    scores: Tensor,
    rewards: Tensor,
    advantages: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    response_length: Tensor,
    prompt_length: Tensor,
    max_response_length: int,
    aborted: Tensor | None = None,
    max_prompt_length: int | None = None,
) -> dict[str, float]:
    """Mean / max / min of the batch quantities the DAPO dashboard plots.

    Which samples each statistic covers:

    - `critic/score/*`, `critic/rewards/*`: non-aborted responses only (an aborted response has
      no meaningful score; counting it would drag the mean towards the failure value).
    - `critic/advantages/*`, `critic/returns/*`: every token where `response_mask` is set.
    - `response_length/mean|max|min`: non-aborted responses; `response_length/clip_ratio` is the
      fraction of non-aborted responses with `response_length >= max_response_length` (they hit
      the generation limit and were truncated).
    - `prompt_length/mean|max|min`: every response; `prompt_length/clip_ratio` (only when
      `max_prompt_length` is given) is the fraction with `prompt_length >= max_prompt_length`.
    - `response/aborted_ratio`: aborted responses / B.

    `aborted=None` uses the rule of the DAPO reference trainer: a response of length 0 counts as
    aborted (the engine returned nothing for it).

    Degenerate batches never produce NaN. When every response is aborted, the score, reward and
    response-length statistics (including clip_ratio) are reported as 0.0 and
    `response/aborted_ratio` is 1.0, which is what a dashboard should flag. When `response_mask`
    selects no token, the advantage and return statistics are 0.0.

    Returns plain Python floats keyed by the metric name.
    """
    batch = _check_vector("scores", scores, None)
    _check_vector("rewards", rewards, batch)
    _check_vector("response_length", response_length, batch)
    _check_vector("prompt_length", prompt_length, batch)
    if not isinstance(response_mask, Tensor) or response_mask.dim() != 2 or response_mask.shape[0] != batch:
        raise ValueError(
            f"response_mask: expected a tensor of shape [B={batch}, T], got {_describe(response_mask)}"
        )
    for name, t in (("advantages", advantages), ("returns", returns)):
        if not isinstance(t, Tensor) or t.shape != response_mask.shape:
            raise ValueError(
                f"{name}: expected a tensor of the shape of response_mask {tuple(response_mask.shape)}, "
                f"got {_describe(t)}"
            )
    _check_positive_int("max_response_length", max_response_length)
    if max_prompt_length is not None:
        _check_positive_int("max_prompt_length", max_prompt_length)
    if batch == 0:
        raise ValueError("compute_data_metrics: the batch is empty (B=0); there is nothing to report")

    response_length = response_length.float()
    prompt_length = prompt_length.float()
    if bool((response_length < 0).any()) or bool((prompt_length < 0).any()):
        raise ValueError("response_length and prompt_length must be >= 0")

    if aborted is None:
        aborted = response_length == 0
    else:
        _check_vector("aborted", aborted, batch)
        if aborted.dtype != torch.bool:
            raise ValueError(f"aborted: expected a bool tensor, got dtype {aborted.dtype}")
    kept = ~aborted
    mask = response_mask.bool()

    kept_lengths = response_length[kept]
    names: list[str] = []
    values: list[Tensor] = []

    def add(prefix: str, x: Tensor) -> None:
        names.extend(f"{prefix}/{s}" for s in ("mean", "max", "min"))
        values.append(_mean_max_min(x))

    add("critic/score", scores.float()[kept])
    add("critic/rewards", rewards.float()[kept])
    add("critic/advantages", advantages.float()[mask])
    add("critic/returns", returns.float()[mask])
    add("response_length", kept_lengths)
    names.append("response_length/clip_ratio")
    values.append(_fraction(kept_lengths >= max_response_length))
    add("prompt_length", prompt_length)
    if max_prompt_length is not None:
        names.append("prompt_length/clip_ratio")
        values.append(_fraction(prompt_length >= max_prompt_length))
    names.append("response/aborted_ratio")
    values.append(aborted.float().mean().reshape(1))

    flat = torch.cat([v.reshape(-1) for v in values]).tolist()  # the one host sync
    return dict(zip(names, flat, strict=True))


def compute_overlong_metrics(*, overlong_reward, overlong, aborted: Tensor | None = None) -> dict[str, float]:
    """`reward.overlong_buffer.log`: the overlong penalty over the batch's finished responses.

    overlong_reward [B] float (the penalty, <= 0), overlong [B] bool (the response hit
    max_response_length). Metrics: `reward/overlong_penalty/mean|min` and
    `reward/overlong_penalized_ratio` (responses with a penalty < 0), `reward/overlong_ratio`
    (responses that reached the limit). An empty batch (or all aborted) gives zeros, never NaN.
    """
    pen = torch.as_tensor(overlong_reward, dtype=torch.float32).reshape(-1)
    hit = torch.as_tensor(overlong, dtype=torch.bool).reshape(-1)
    _check_vector("overlong", hit, pen.numel())
    if aborted is not None:
        keep = ~torch.as_tensor(aborted, dtype=torch.bool).reshape(-1)
        pen, hit = pen[keep], hit[keep]
    if pen.numel() == 0:
        return {"reward/overlong_penalty/mean": 0.0, "reward/overlong_penalty/min": 0.0,
                "reward/overlong_penalized_ratio": 0.0, "reward/overlong_ratio": 0.0}
    return {"reward/overlong_penalty/mean": float(pen.mean()), "reward/overlong_penalty/min": float(pen.min()),
            "reward/overlong_penalized_ratio": float((pen < 0).float().mean()),
            "reward/overlong_ratio": float(hit.float().mean())}


def _mean_max_min(x: Tensor) -> Tensor:
    """[3] tensor (mean, max, min) of a 1-D tensor; zeros when it is empty (no NaN, see docstring)."""
    if x.numel() == 0:
        return x.new_zeros(3)
    return torch.stack([x.mean(), x.max(), x.min()])


def _fraction(flags: Tensor) -> Tensor:
    """[1] tensor: the fraction of True in a 1-D bool tensor, 0 when it is empty."""
    if flags.numel() == 0:
        return torch.zeros(1, device=flags.device)
    return flags.float().mean().reshape(1)


def _check_vector(name: str, x: object, batch: int | None) -> int:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of shape [B], got {type(x).__name__}")
    if x.dim() != 1 or (batch is not None and x.shape[0] != batch):
        want = "[B]" if batch is None else f"[B={batch}]"
        raise ValueError(f"{name}: expected shape {want}, got {tuple(x.shape)}")
    return x.shape[0]


def _describe(x: object) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def reward_extra_metrics(rows) -> dict[str, float]:
    """`reward_extra/<key>/mean` of every numeric key (bools count as 0 / 1) the reward function returned
    beyond score / acc / pred, over the rows that returned it. rows: a dict per row (RewardOutput.extra
    "reward_extra"), or None."""
    sums: dict[str, list[float]] = {}
    for extra in rows or ():
        for key, value in extra.items():
            if isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
                sums.setdefault(key, []).append(float(value))
    return {f"reward_extra/{key}/mean": sum(values) / len(values) for key, values in sorted(sums.items())}
