"""compute_data_metrics on a hand-made batch: which samples / tokens each statistic covers."""

import math

import pytest
import torch

from megatron_dapo.metrics.data import compute_data_metrics

PAD = 99.0  # in padding and aborted rows: any statistic that includes it is visibly wrong


def _batch(**overrides):
    # 4 responses, T=3. Row 3 is aborted; its score/reward (5.0 / -7.0) would move max/min.
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.float32)
    adv = torch.tensor([[0.5, 0.5, PAD], [-1.0, -1.0, -1.0], [2.0, PAD, PAD], [PAD, PAD, PAD]])
    batch = dict(
        scores=torch.tensor([1.0, -1.0, 1.0, 5.0]),
        rewards=torch.tensor([0.9, -1.2, 1.0, -7.0]),
        advantages=adv,
        returns=adv + 1.0,
        response_mask=mask,
        response_length=torch.tensor([2, 3, 1, 0]),
        prompt_length=torch.tensor([5, 5, 7, 7]),
        max_response_length=3,
        aborted=torch.tensor([False, False, False, True]),
        max_prompt_length=7,
    )
    batch.update(overrides)
    return batch


def test_hand_computed_values_exclude_aborted_rows_and_masked_tokens():
    m = compute_data_metrics(**_batch())
    expected = {
        "critic/score/mean": 1.0 / 3.0,
        "critic/score/max": 1.0,
        "critic/score/min": -1.0,
        "critic/rewards/mean": 0.7 / 3.0,
        "critic/rewards/max": 1.0,
        "critic/rewards/min": -1.2,
        # valid advantages: 0.5, 0.5, -1, -1, -1, 2
        "critic/advantages/mean": 0.0,
        "critic/advantages/max": 2.0,
        "critic/advantages/min": -1.0,
        "critic/returns/mean": 1.0,
        "critic/returns/max": 3.0,
        "critic/returns/min": 0.0,
        # non-aborted lengths 2, 3, 1; one of three reaches max_response_length=3
        "response_length/mean": 2.0,
        "response_length/max": 3.0,
        "response_length/min": 1.0,
        "response_length/clip_ratio": 1.0 / 3.0,
        "prompt_length/mean": 6.0,
        "prompt_length/max": 7.0,
        "prompt_length/min": 5.0,
        "prompt_length/clip_ratio": 0.5,
        "response/aborted_ratio": 0.25,
    }
    assert set(m) == set(expected)
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, abs=1e-6), key
        assert isinstance(m[key], float), key


def test_aborted_none_treats_zero_length_responses_as_aborted():
    assert compute_data_metrics(**_batch(aborted=None)) == compute_data_metrics(**_batch())


def test_aborted_flag_wins_over_length_for_a_partial_response():
    # Row 1 has 3 tokens but the engine aborted it: its score -1 and length 3 drop out.
    m = compute_data_metrics(**_batch(aborted=torch.tensor([False, True, False, True])))
    assert m["critic/score/min"] == 1.0
    assert m["response_length/max"] == 2.0
    assert m["response_length/clip_ratio"] == 0.0
    assert m["response/aborted_ratio"] == 0.5


def test_clip_ratio_counts_lengths_at_or_above_the_limit():
    m = compute_data_metrics(**_batch(max_response_length=2))
    assert m["response_length/clip_ratio"] == pytest.approx(2.0 / 3.0)  # lengths 2 and 3 of 2, 3, 1


def test_prompt_clip_ratio_only_with_max_prompt_length():
    m = compute_data_metrics(**_batch(max_prompt_length=None))
    assert "prompt_length/clip_ratio" not in m
    assert m["prompt_length/mean"] == 6.0


def test_all_aborted_reports_zeros_and_full_abort_ratio_without_nan():
    m = compute_data_metrics(**_batch(aborted=torch.ones(4, dtype=torch.bool)))
    for key in ("critic/score", "critic/rewards", "response_length"):
        for stat in ("mean", "max", "min"):
            assert m[f"{key}/{stat}"] == 0.0
    assert m["response_length/clip_ratio"] == 0.0
    assert m["response/aborted_ratio"] == 1.0
    assert m["critic/advantages/max"] == 2.0  # the mask still selects tokens
    assert all(math.isfinite(v) for v in m.values())


def test_empty_response_mask_reports_zero_advantage_and_return_stats():
    m = compute_data_metrics(**_batch(response_mask=torch.zeros(4, 3)))
    for key in ("critic/advantages", "critic/returns"):
        for stat in ("mean", "max", "min"):
            assert m[f"{key}/{stat}"] == 0.0
    assert m["critic/score/mean"] == pytest.approx(1.0 / 3.0)


def test_bool_mask_and_low_precision_inputs_give_the_same_numbers():
    b = _batch()
    low = _batch(
        response_mask=b["response_mask"].bool(),
        scores=b["scores"].to(torch.bfloat16),
        advantages=b["advantages"].double(),
    )
    m, m_low = compute_data_metrics(**b), compute_data_metrics(**low)
    assert m_low == pytest.approx(m, abs=1e-2)  # bf16 scores: 3 significant digits
    assert m_low["critic/advantages/max"] == m["critic/advantages/max"]


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(rewards=torch.zeros(3)), r"rewards: expected shape \[B=4\]"),
        (dict(advantages=torch.zeros(4, 2)), "advantages: expected a tensor of the shape of response_mask"),
        (dict(returns=[0.0] * 4), "returns: expected a tensor"),
        (dict(response_mask=torch.zeros(3, 3)), r"response_mask: expected a tensor of shape \[B=4, T\]"),
        (dict(aborted=torch.zeros(4)), "aborted: expected a bool tensor"),
        (dict(max_response_length=0), "max_response_length: expected a positive int"),
        (dict(max_prompt_length=1.5), "max_prompt_length: expected a positive int"),
        (dict(response_length=torch.tensor([2, -1, 1, 0])), "response_length and prompt_length must be >= 0"),
    ],
)
def test_bad_inputs_name_the_offending_argument(overrides, match):
    with pytest.raises((ValueError, TypeError), match=match):
        compute_data_metrics(**_batch(**overrides))


def test_scores_must_be_a_tensor():
    with pytest.raises(TypeError, match="scores: expected a torch.Tensor"):
        compute_data_metrics(**_batch(scores=[1.0, 2.0, 3.0, 4.0]))


def test_empty_batch_is_an_error():
    empty = dict(
        scores=torch.zeros(0),
        rewards=torch.zeros(0),
        advantages=torch.zeros(0, 3),
        returns=torch.zeros(0, 3),
        response_mask=torch.zeros(0, 3),
        response_length=torch.zeros(0, dtype=torch.long),
        prompt_length=torch.zeros(0, dtype=torch.long),
        max_response_length=3,
    )
    with pytest.raises(ValueError, match="B=0"):
        compute_data_metrics(**empty)


def test_overlong_metrics_by_hand():
    from megatron_dapo.metrics import compute_overlong_metrics

    m = compute_overlong_metrics(overlong_reward=[0.0, -0.5, -1.0, 0.0, -0.25], overlong=[False, False, True, False, True],
                                 aborted=torch.tensor([False, False, False, False, True]))
    assert m == pytest.approx({"reward/overlong_penalty/mean": -1.5 / 4, "reward/overlong_penalty/min": -1.0,
                               "reward/overlong_penalized_ratio": 0.5, "reward/overlong_ratio": 0.25})
    empty = compute_overlong_metrics(overlong_reward=[-1.0], overlong=[True], aborted=torch.tensor([True]))
    assert set(empty.values()) == {0.0}
    with pytest.raises(ValueError, match="overlong"):
        compute_overlong_metrics(overlong_reward=[0.0, 0.0], overlong=[True])
