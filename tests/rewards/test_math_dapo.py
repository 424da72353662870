"""math_dapo (verl 0.9.1's scoring) on hand-judged cases, quirks included.

The full comparison with recorded verl outputs is test_verl_parity.py; these cases spell out each
rule of the module docstring, so a reader sees what verl's reward does without running verl.
"""

import pytest

from megatron_dapo.rewards.math_dapo import compute_score, last_boxed_content, normalize_final_answer


@pytest.mark.parametrize(
    "answer,normalised",
    [
        pytest.param("42", "42", id="plain"),
        pytest.param("x = -7", "-7", id="after_last_equals"),
        pytest.param("12 meters", "12", id="unit_word"),
        pytest.param("a + b", "+b", id="a_space_is_deleted_anywhere"),
        pytest.param("\\tan x", "\\tx", id="an_space_is_deleted_inside_tan"),
        pytest.param("\\dfrac{1}{2}", "\\dfrac{1}{2}", id="dfrac_kept"),
        pytest.param("\\frac12", "\\frac{1}{2}", id="frac_shorthand"),
        pytest.param("\\sqrt3", "\\sqrt{3}", id="sqrt_shorthand"),
        pytest.param("\\text{(A)}", "(A)", id="text_unwrapped"),
        pytest.param("\\text{\\frac{1}{2}}", "\\frac{1{2}}", id="text_stops_at_first_brace"),
        pytest.param("10\\%", "10\\%", id="percent_kept"),
        pytest.param("1,000", "1000", id="thousands"),
        pytest.param("-1,000", "-1,000", id="negative_thousands_kept"),
        pytest.param("5\\,000", "5\\,000", id="thin_space_kept"),
        pytest.param("\\left( 1, 2 \\right)", "\\left(1,2\\right)", id="left_right_kept"),
        pytest.param("\\boxed{x=5}", "5}", id="boxed_equation_split_first"),
        pytest.param("\\boxed{5}", "5", id="boxed_unwrapped"),
        pytest.param("The answer is $42$ apples", "42", id="first_math_span"),
        pytest.param("90^\\circ", "90", id="degrees"),
        pytest.param("\\$5", "5", id="currency"),
        pytest.param("Monday", "Monday", id="capitalised_word_kept"),
        pytest.param("acme", "ae", id="unit_deleted_inside_word"),
        pytest.param("1,\u00b2", "1\u00b2", id="unicode_digits_count_as_digits"),
        pytest.param("[INVALID]", "[INVALID]", id="invalid_marker_unchanged"),
    ],
)
def test_normalisation_by_hand(answer, normalised):
    assert normalize_final_answer(answer) == normalised


@pytest.mark.parametrize(
    "response,truth,expected",
    [
        pytest.param("Answer: 42", "42", (True, "42"), id="answer_line"),
        pytest.param("Answer: 41\nAnswer: 42", "42", (True, "42"), id="last_answer_line"),
        pytest.param("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", (False, "\\dfrac{1}{2}"), id="dfrac_rejected"),
        pytest.param("Answer: -1,000", "-1000", (False, "-1,000"), id="negative_thousands_rejected"),
        pytest.param("Answer: \\boxed{x=5}", "5", (False, "5}"), id="boxed_equation_rejected"),
        pytest.param("Answer: \\fbox{42}", "42", (False, "\\fbox{42}"), id="fbox_is_text"),
        # No Answer: line: the last \boxed{} of the final 100 characters, as written.
        pytest.param("So \\boxed{42}.", "42", (True, "42"), id="boxed_fallback"),
        pytest.param("So \\boxed{ 42 }", "42", (False, " 42 "), id="boxed_fallback_not_stripped"),
        pytest.param("So \\boxed{1,000}", "1000", (False, "1,000"), id="boxed_fallback_not_normalised"),
        pytest.param("So \\fbox{42}", "42", (False, "[INVALID]"), id="fbox_is_no_box"),
        pytest.param("\\boxed{42}" + " " * 91, "42", (False, "[INVALID]"), id="box_outside_final_100"),
        pytest.param("\\boxed{42}" + " " * 90, "42", (True, "42"), id="box_inside_final_100"),
        pytest.param("Answer: 42\n" + "x" * 300, "42", (False, "[INVALID]"), id="answer_outside_final_300"),
        pytest.param("Answer: [INVALID]\n\\boxed{7}", "7", (True, "7"), id="invalid_text_falls_back_to_box"),
        pytest.param("nothing here", "42", (False, "[INVALID]"), id="neither"),
    ],
)
def test_default_mode_by_hand(response, truth, expected):
    correct, pred = expected
    assert compute_score(response, truth) == {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


@pytest.mark.parametrize(
    "response,truth,expected",
    [
        pytest.param("Answer: 42", "42", (False, None), id="answer_line_ignored"),
        pytest.param("Answer: 41 so \\boxed{42}", "42", (True, "42"), id="box_decides"),
        pytest.param("\\boxed{42 cm}", "42", (False, "42 cm"), id="no_normalisation"),
    ],
)
def test_strict_mode_by_hand(response, truth, expected):
    correct, pred = expected
    result = compute_score(response, truth, strict_box_verify=True)
    assert result == {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


def test_pause_tokens_index_moves_the_box_window():
    response = "z" * 200 + "\\boxed{9}" + "w" * 92  # the box starts 101 characters before the end
    assert compute_score(response, "9", strict_box_verify=True)["acc"] is False
    assert compute_score(response, "9", strict_box_verify=True, pause_tokens_index=[0, 1, 2, 215])["acc"] is True
    with pytest.raises(ValueError, match="pause_tokens_index must hold 4"):
        compute_score(response, "9", strict_box_verify=True, pause_tokens_index=[215])


def test_last_boxed_content_matches_braces_and_only_boxed():
    assert last_boxed_content("\\boxed{1} and \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert last_boxed_content("\\boxed{unclosed") is None
    assert last_boxed_content("$\\boxed 5$") is None
    assert last_boxed_content("\\fbox{5}") is None


def test_integer_ground_truth_is_its_decimal_text():
    assert compute_score("Answer: 42", 42)["acc"] is True


@pytest.mark.parametrize("bad", [None, 4.2, ["42"], True])
def test_ground_truth_of_another_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match="ground_truth"):
        compute_score("Answer: 42", bad)
