"""DAPO dynamic sampling: keep only the prompt groups whose responses disagree.

A group whose responses all get the same metric value (all correct or all wrong) has zero GRPO
advantage everywhere and contributes no gradient; DAPO drops it and samples more prompts.

Shape legend:
    B  responses; `index` and `metric_values` both hold B entries (lists, numpy arrays or [B] tensors)
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import numpy as np
from torch import Tensor

__all__ = ["select_informative_groups"]


def _as_list(values: Sequence | np.ndarray | Tensor, name: str) -> list:
    if isinstance(values, Tensor | np.ndarray):
        if values.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(values.shape)}")
        return values.tolist()
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise ValueError(f"{name} must be a list, numpy array or tensor, got {type(values).__name__}")
    return list(values)


def select_informative_groups(
    index: Sequence[Hashable] | np.ndarray | Tensor,
    metric_values: Sequence[float | bool] | np.ndarray | Tensor,
) -> list:
    """Prompt ids, in first-seen order, whose responses do not all share one metric value.

    `index[i]` is the prompt id of response i and `metric_values[i]` its filter metric (for
    example acc or score; floats, bools or a tensor). A group of one response is kept, as the
    DAPO recipe does (its std is undefined, not zero). "Std > 0" is tested exactly as
    min != max, so float round-off in a mean cannot keep a constant group.
    """
    ids = _as_list(index, "index")
    values = _as_list(metric_values, "metric_values")
    if len(ids) != len(values):
        raise ValueError(
            f"metric_values has {len(values)} entries, expected one per response like index ({len(ids)})"
        )
    groups: dict[Hashable, list[float]] = {}
    for row, (prompt_id, value) in enumerate(zip(ids, values, strict=True)):
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(
                f"metric_values[{row}] (prompt {prompt_id!r}) is {value}; expected a finite number"
            )
        groups.setdefault(prompt_id, []).append(value)
    return [prompt_id for prompt_id, group in groups.items() if len(group) == 1 or min(group) != max(group)]
