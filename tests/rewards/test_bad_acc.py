"""A reward function's `acc` must be a bool: NaN or a string used to count as correct (bool(nan) is True)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_dapo.rewards.manager import _check_result


@pytest.mark.parametrize("acc", [math.nan, "yes", 2, 0.5, None])
def test_a_non_bool_acc_is_a_named_failure(acc):
    out = _check_result({"score": 1.0, "acc": acc})
    assert out.failure == f"returned acc={acc!r} ({type(acc).__name__}), expected a bool"


@pytest.mark.parametrize("acc,want", [(True, True), (False, False), (1, True), (0, False), (np.bool_(True), True),
                                      (torch.tensor(False), False)])
def test_bools_and_their_numpy_torch_and_0_1_forms_are_taken(acc, want):
    out = _check_result({"score": 1.0, "acc": acc})
    assert out.failure is None and out.acc is want
    assert _check_result({"score": -1.0}).acc is False  # absent: from the score
