"""Staleness metrics on four hand-made trajectories (current policy version 7).

min  max   span = max-min+1   lag_lower = 7-max   lag_worst = 7-min
 3    5        3                  2                  4
 5    5        1                  2                  2
 5    6        2                  1                  2
 2    2        1                  5                  5
"""

import pytest
import torch

from megatron_dapo.metrics.staleness import compute_staleness_metrics

MIN = [3, 5, 5, 2]
MAX = [5, 5, 6, 2]

EXPECTED = {
    "staleness/version_span/mean": 7 / 4,
    "staleness/version_span/max": 3.0,
    "staleness/version_span/min": 1.0,
    "staleness/lag_lower_bound/mean": 10 / 4,
    "staleness/lag_lower_bound/max": 5.0,
    "staleness/lag_lower_bound/min": 1.0,
    "staleness/lag_worst/mean": 13 / 4,
    "staleness/lag_worst/max": 5.0,
    "staleness/lag_worst/min": 2.0,
}


def test_span_and_lags_match_hand_values():
    m = compute_staleness_metrics(min_policy_version=MIN, max_policy_version=MAX, current_policy_version=7)
    assert m == pytest.approx(EXPECTED)
    assert all(isinstance(v, float) for v in m.values())


def test_tensors_and_lists_give_the_same_result():
    m = compute_staleness_metrics(
        min_policy_version=torch.tensor(MIN, dtype=torch.int32),
        max_policy_version=torch.tensor(MAX),
        current_policy_version=7,
    )
    assert m == pytest.approx(EXPECTED)


def test_on_policy_batch_has_span_one_and_zero_lag():
    m = compute_staleness_metrics(
        min_policy_version=[4, 4], max_policy_version=[4, 4], current_policy_version=4
    )
    assert m["staleness/version_span/max"] == 1.0
    assert m["staleness/lag_worst/max"] == 0.0


def test_empty_batch_returns_nothing():
    assert (
        compute_staleness_metrics(min_policy_version=[], max_policy_version=[], current_policy_version=3)
        == {}
    )


@pytest.mark.parametrize(
    "lo, hi, current, match",
    [
        (
            [3, 6],
            [5, 5],
            7,
            r"max_policy_version\[1\] = 5: expected max_policy_version >= min_policy_version",
        ),
        ([3, 5], [5, 8], 7, r"max_policy_version\[1\] = 8: expected a version <= current_policy_version=7"),
        ([-1, 5], [5, 5], 7, r"min_policy_version\[0\] = -1"),
        ([3, 5], [5], 7, "2 entries but max_policy_version has 1"),
        ([3.0, 5.0], [5.0, 5.0], 7, "min_policy_version: expected integer policy versions"),
        ([3, 5], [5, 5], 7.0, "current_policy_version: expected an int"),
        ([[3, 5]], [[5, 5]], 7, r"min_policy_version: expected a 1-D sequence"),
    ],
)
def test_inconsistent_versions_are_rejected_with_the_offending_row(lo, hi, current, match):
    with pytest.raises(ValueError, match=match):
        compute_staleness_metrics(
            min_policy_version=lo, max_policy_version=hi, current_policy_version=current
        )
