"""Our rewards against verl 0.9.1's, on the outputs tools/verl_reference.py recorded from live verl.

math_dapo must equal verl's math_dapo on every case (score, acc and pred, exactly: they are strings
and booleans). math_verify must give verl's math_verify score on every case. The cases (hand-written
edge cases, generated responses, fuzz strings) are listed in tools/verl_reference.py; the assets
are regenerated with `.venv-verl/bin/python tools/verl_reference.py` (see docs/rewards-and-losses.md).
"""

import json
import pathlib

import pytest

from megatron_dapo.rewards import math_dapo, math_dapo_plus, math_verify

ASSETS = pathlib.Path(__file__).resolve().parents[1] / "assets" / "verl"


def _load(name: str) -> dict:
    return json.loads((ASSETS / name).read_text())


MATH_DAPO = _load("math_dapo.json")
MATH_VERIFY = _load("math_verify.json")


def test_assets_come_from_verl_0_9_1():
    assert MATH_DAPO["verl_version"] == MATH_VERIFY["verl_version"] == "0.9.1"


@pytest.mark.parametrize("mode", ["default", "strict"])
def test_math_dapo_equals_verl_on_every_recorded_case(mode):
    mismatches = []
    for case in MATH_DAPO["cases"]:
        ours = math_dapo.compute_score(case["solution"], case["ground_truth"], strict_box_verify=mode == "strict",
                                       pause_tokens_index=case["pause_tokens_index"])
        if ours != case[mode]:
            mismatches.append((case["id"], ours, case[mode]))
    assert not mismatches, f"{len(mismatches)} of {len(MATH_DAPO['cases'])} differ, first: {mismatches[:5]}"


def test_recorded_cases_cover_the_named_edge_cases():
    ids = {case["id"] for case in MATH_DAPO["cases"]}
    for name in ("fbox_fallback", "article_a", "article_an", "dfrac_vs_frac", "text_choice", "percent_escaped",
                 "thousands_negative", "thousands_thin_space", "left_right", "boxed_equation_answer_line",
                 "empty_solution", "no_answer_line", "unicode_cjk_prose", "long_answer_inside_tail",
                 "pause_tokens_window"):
        assert f"hand/{name}" in ids
    assert sum(i.startswith("gen/") for i in ids) >= 500 and sum(i.startswith("fuzz/") for i in ids) >= 150


# Where math_dapo (verl's scores) and math_dapo_plus differ, on the cases: verl's verdict is
# the recorded one; plus accepts each (its own table is in test_math_dapo_plus.py).
PLUS_FIXES = ["fbox_fallback", "fbox_answer_line", "variable_a", "dfrac_vs_frac",
              "text_nested_braces", "percent_escaped", "percent_plain", "thousands_negative",
              "thousands_thin_space", "thousands_decimal", "left_right", "boxed_equation_answer_line",
              "boxed_fallback_normalised_truth", "boxed_fallback_spaces"]


@pytest.mark.parametrize("name", PLUS_FIXES)
def test_math_dapo_plus_accepts_what_verl_rejects(name):
    case = next(c for c in MATH_DAPO["cases"] if c["id"] == f"hand/{name}")
    assert case["default"]["acc"] is False  # verl (and so math_dapo) rejects it
    assert math_dapo_plus.compute_score(case["solution"], case["ground_truth"])["acc"] is True


def test_math_verify_equals_verl_on_every_recorded_case():
    mismatches = []
    for case in MATH_VERIFY["cases"]:
        ours = math_verify.compute_score(case["solution"], case["ground_truth"])
        if ours["score"] != case["score"] or ours["acc"] != (case["score"] == 1.0):
            mismatches.append((case["id"], ours, case["score"]))
    assert not mismatches, f"{len(mismatches)} of {len(MATH_VERIFY['cases'])} differ, first: {mismatches[:5]}"


def test_math_verify_cases_include_symbolic_equivalences_verl_accepts():
    scores = {case["id"]: case["score"] for case in MATH_VERIFY["cases"]}
    # The point of the reward: equal values written differently score 1, a wrong value 0.
    assert scores["hand/fraction_vs_decimal"] == scores["hand/set_order"] == 1.0
    assert scores["hand/wrong"] == scores["hand/empty_solution"] == 0.0
