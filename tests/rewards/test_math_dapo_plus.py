"""math_dapo_plus.compute_score on hand-written cases: each states the rule it exercises."""

import pytest

from megatron_dapo.rewards.math_dapo_plus import compute_score, last_boxed_content, normalize_final_answer

REASONING = "Let us compute step by step.\nThe sum is what we need.\n"

# (response, ground truth, expected acc, expected pred)
DEFAULT_MODE_CASES = [
    pytest.param(REASONING + "Answer: 42", "42", True, "42", id="plain"),
    pytest.param(REASONING + "answer : 42", "42", True, "42", id="case_and_space_insensitive_marker"),
    pytest.param(REASONING + "Answer: 42 cm", "42", True, "42", id="unit_word"),
    pytest.param(REASONING + "Answer: 12 \\text{ meters}", "12", True, "12", id="unit_inside_text"),
    pytest.param(REASONING + "Answer: 3 seconds", "3", True, "3", id="plural_unit"),
    pytest.param(REASONING + "Answer: \\text{Monday}", "Monday", True, "Monday", id="unit_inside_word_kept"),
    pytest.param(REASONING + "Answer: $42$", "42", True, "42", id="dollar_math"),
    pytest.param(REASONING + "Answer: The answer is $42$ apples", "42", True, "42", id="prose_around_math"),
    pytest.param(REASONING + "Answer: \\$5", "5", True, "5", id="currency_dollar"),
    pytest.param(REASONING + "Answer: \\boxed{42}", "42", True, "42", id="boxed_on_answer_line"),
    pytest.param(REASONING + "Answer: \\text{\\textbf{7}}", "7", True, "7", id="nested_text_wrappers"),
    pytest.param(REASONING + "Answer: 1,000", "1000", True, "1000", id="thousands_comma_in_pred"),
    pytest.param(REASONING + "Answer: 1000", "1,000", True, "1000", id="thousands_comma_in_truth"),
    pytest.param(REASONING + "Answer: 1,2", "12", False, "1,2", id="tuple_is_not_a_thousands_number"),
    pytest.param(
        REASONING + "Answer: \\dfrac{1}{2}", "\\frac12", True, "\\frac{1}{2}", id="dfrac_and_shorthand"
    ),
    pytest.param(REASONING + "Answer: \\sqrt3", "\\sqrt{3}", True, "\\sqrt{3}", id="sqrt_shorthand"),
    pytest.param(REASONING + "Answer: -7", "-7", True, "-7", id="negative"),
    pytest.param(REASONING + "Answer: 7", "-7", False, "7", id="sign_matters"),
    pytest.param(REASONING + "Answer: x = -7", "-7", True, "-7", id="after_last_equals"),
    pytest.param(REASONING + "Answer: 90^\\circ", "90", True, "90", id="degrees"),
    pytest.param(REASONING + "Answer: 41\nAnswer: 42", "42", True, "42", id="last_answer_line_wins"),
    pytest.param(REASONING + "Answer: 43", "42", False, "43", id="wrong"),
    pytest.param(REASONING + "Answer: a + b", "a+b", True, "a+b", id="variable_a_is_not_an_article"),
    # The cases where verl's math_dapo (and so ours) rejects a correct answer (the list).
    pytest.param(REASONING + "Answer: \\fbox{42}", "42", True, "42", id="fbox_on_answer_line"),
    pytest.param(REASONING + "Answer: \\tan x", "\\tan x", True, "\\tanx", id="tan_keeps_its_an"),
    pytest.param(REASONING + "Answer: \\text{(A)}", "(A)", True, "(A)", id="text_wrapped_choice"),
    pytest.param(REASONING + "Answer: \\text{\\frac{1}{2}}", "\\frac12", True, "\\frac{1}{2}", id="text_nested_braces"),
    pytest.param(REASONING + "Answer: 10\\%", "10", True, "10", id="percent_escaped"),
    pytest.param(REASONING + "Answer: 10%", "10", True, "10", id="percent_plain"),
    pytest.param(REASONING + "Answer: -1,000", "-1000", True, "-1000", id="thousands_negative"),
    pytest.param(REASONING + "Answer: 5\\,000", "5000", True, "5000", id="thousands_thin_space"),
    pytest.param(REASONING + "Answer: 1,234.5", "1234.5", True, "1234.5", id="thousands_decimal"),
    pytest.param(REASONING + "Answer: \\left( 1, 2 \\right)", "(1,2)", True, "(1,2)", id="left_right"),
    pytest.param(REASONING + "Answer: \\boxed{x=5}", "5", True, "5", id="boxed_equation_on_answer_line"),
    pytest.param(REASONING + "Answer: an apple", "apple", True, "apple", id="article_an"),
    pytest.param(REASONING + "Answer: integers", "digits", False, "", id="all_units_is_no_answer"),
    # No "Answer:": the last box of the final 100 characters, normalised like an answer line.
    pytest.param(REASONING + "So the total is \\boxed{42}.", "42", True, "42", id="boxed_fallback"),
    pytest.param(
        REASONING + "Total \\boxed{\\frac{1}{2}}",
        "\\frac{1}{2}",
        True,
        "\\frac{1}{2}",
        id="boxed_nested_braces",
    ),
    pytest.param(REASONING + "Total \\boxed{1,000}", "1000", True, "1000", id="boxed_fallback_normalised"),
    pytest.param(REASONING + "Total \\fbox{ 42 }", "42", True, "42", id="fbox_fallback"),
    pytest.param(REASONING + "no final answer here", "42", False, "[INVALID]", id="neither_found"),
]


@pytest.mark.parametrize("response,truth,acc,pred", DEFAULT_MODE_CASES)
def test_default_mode_matches_hand_judgement(response, truth, acc, pred):
    result = compute_score(response, truth)
    assert result == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


def test_answer_line_before_the_last_300_characters_is_not_read():
    response = "Answer: 42\n" + "x" * 300
    assert compute_score(response, "42") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    # The same line moved into the tail counts; an earlier wrong guess outside it is ignored.
    response = "Answer: 41\n" + "x" * 300 + "\nAnswer: 42"
    assert compute_score(response, "42")["acc"] is True


def test_box_before_the_last_100_characters_is_not_used_by_the_fallback():
    response = "\\boxed{42}" + " " * 95
    assert len(response) > 100
    assert compute_score(response, "42") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert compute_score("\\boxed{42}" + " " * 89, "42")["acc"] is True  # 99 characters: inside


@pytest.mark.parametrize(
    "response,truth,acc,pred",
    [
        pytest.param("Answer: 42", "42", False, None, id="answer_line_ignored_without_box"),
        pytest.param("Answer: 41 so \\boxed{42}", "42", True, "42", id="box_wins_over_answer_line"),
        pytest.param("\\boxed{ 42 }", "42", True, " 42 ", id="outer_whitespace_ignored"),
        pytest.param("\\boxed{42 cm}", "42", False, "42 cm", id="no_normalisation"),
        pytest.param("\\boxed{42}" + "." * 100, "42", False, None, id="box_outside_final_100_chars"),
    ],
)
def test_strict_mode_uses_only_the_boxed_check(response, truth, acc, pred):
    result = compute_score(response, truth, strict_box_verify=True)
    assert result == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


def test_integer_ground_truth_is_compared_as_text():
    assert compute_score("Answer: 42", 42)["acc"] is True


@pytest.mark.parametrize("bad", [None, 4.2, ["42"], True])
def test_ground_truth_of_another_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match="ground_truth"):
        compute_score("Answer: 42", bad)


@pytest.mark.parametrize(
    "text,content",
    [
        ("a \\boxed{1} b \\boxed{2} c", "2"),
        ("\\boxed{\\frac{a}{b}}", "\\frac{a}{b}"),
        ("\\fbox{7}", "7"),
        ("$\\boxed 5$", "5"),
        ("\\boxed{unclosed", None),
        ("no box", None),
    ],
)
def test_last_boxed_content_matches_braces(text, content):
    assert last_boxed_content(text) == content


def test_normalisation_is_idempotent_on_the_table():
    for case in DEFAULT_MODE_CASES:
        once = normalize_final_answer(case.values[1])
        assert normalize_final_answer(once) == once
