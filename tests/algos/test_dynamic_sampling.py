"""Dynamic sampling keeps the groups whose metric varies, in first-seen order."""

import numpy as np
import pytest
import torch

from megatron_dapo.algos.dynamic_sampling import select_informative_groups


def test_keeps_varying_groups_and_singletons_in_first_seen_order():
    index = ["p2", "p1", "p2", "p3", "p1", "p4", "p5", "p5"]
    values = [1.0, 1.0, 0.0, 1.0, 1.0, 0.5, -1.0, -1.0]
    # p2 varies, p1 and p5 are constant, p3 and p4 are groups of one.
    assert select_informative_groups(index, values) == ["p2", "p3", "p4"]


def test_accepts_bools_tensors_and_arrays():
    assert select_informative_groups(np.array([3, 3, 1, 1]), [True, False, True, True]) == [3]
    kept = select_informative_groups(torch.tensor([3, 3, 1, 1]), torch.tensor([0.0, 0.0, 1.0, -1.0]))
    assert kept == [1] and isinstance(kept[0], int)


def test_all_constant_groups_give_an_empty_selection():
    assert select_informative_groups(["a", "a", "b", "b"], [0.0, 0.0, 1.0, 1.0]) == []


def test_length_mismatch_and_non_finite_values_raise():
    with pytest.raises(ValueError, match="metric_values"):
        select_informative_groups(["a", "a"], [1.0])
    with pytest.raises(ValueError, match=r"metric_values\[1\] \(prompt 'a'\)"):
        select_informative_groups(["a", "a"], [1.0, float("nan")])
