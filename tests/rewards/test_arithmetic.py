"""arithmetic.compute_score: exact integer answers score 1, everything else 0."""

import pytest

from megatron_dapo.rewards.arithmetic import compute_score


@pytest.mark.parametrize(
    "response,truth,score,pred",
    [
        pytest.param("19", "19", 1.0, "19", id="exact"),
        pytest.param(" 19\n", "19", 1.0, "19", id="surrounding_whitespace"),
        pytest.param("-3", "-3", 1.0, "-3", id="negative"),
        pytest.param("3", "-3", 0.0, "3", id="sign_matters"),
        pytest.param("019", "19", 1.0, "19", id="leading_zero_is_same_integer"),
        pytest.param("20", "19", 0.0, "20", id="wrong_number"),
        pytest.param("19<eos>7", "19", 1.0, "19", id="text_after_eos_ignored"),
        pytest.param("19a", "19", 0.0, "[INVALID]", id="trailing_garbage"),
        pytest.param("1 9", "19", 0.0, "[INVALID]", id="inner_space"),
        pytest.param("", "19", 0.0, "[INVALID]", id="empty"),
        pytest.param("+19", "19", 0.0, "[INVALID]", id="plus_sign_not_an_answer_format"),
        pytest.param("19", 19, 1.0, "19", id="int_ground_truth"),
    ],
)
def test_score_is_one_only_for_the_right_integer(response, truth, score, pred):
    assert compute_score(response, truth) == {"score": score, "acc": score == 1.0, "pred": pred}


def test_ground_truth_that_is_not_an_integer_is_a_data_error():
    with pytest.raises(ValueError, match="'abc' is not an integer"):
        compute_score("1", "abc")
    with pytest.raises(TypeError, match="ground_truth"):
        compute_score("1", 1.5)
