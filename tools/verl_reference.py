"""Record verl 0.9.1's outputs on generated cases: the reference our parity tests compare against.

verl is never a project dependency. `make verl-env` builds it into its own venv, then

    .venv-verl/bin/python tools/verl_reference.py              # rewrites tests/assets/verl/
    .venv-verl/bin/python tools/verl_reference.py --out DIR    # writes DIR instead (the slow test)

What it writes (inputs and verl's outputs, so the default tests need no verl):
    math_dapo.json       verl.utils.reward_score.math_dapo.compute_score, default and strict mode
    math_verify.json     verl.utils.reward_score.math_verify.compute_score
    tensors.safetensors  tensor inputs ("<set>/<name>") and outputs ("out/<case>/<name>")
    tensors.json         the tensor cases: function, set, keyword arguments, scalar outputs (metrics)

The generators below import nothing from verl, and every input is built from Python's Mersenne
Twister stream with IEEE arithmetic only (+ - * /, no libm, no torch RNG), then rounded to float32:
the same bits on any machine, so a test can check that the committed inputs are what this file makes.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys

import torch

SEED = 20260914
VERL_VERSION = "0.9.1"
ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "tests" / "assets" / "verl"

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


class Rng:
    """Reproducible draws from random.Random: integers and IEEE arithmetic only."""

    def __init__(self, seed: int):
        self._r = random.Random(seed)

    def uniform(self, lo: float, hi: float) -> float:
        return lo + (hi - lo) * self._r.random()

    def centred(self, scale: float) -> float:
        """Sum of four uniforms, centred: in [-2 scale, 2 scale], std scale / sqrt(3), bell-shaped."""
        return scale * (self._r.random() + self._r.random() + self._r.random() + self._r.random() - 2.0)

    def randint(self, lo: int, hi: int) -> int:
        return self._r.randint(lo, hi)

    def choice(self, seq):
        return seq[self._r.randrange(len(seq))]

    def chance(self, p: float) -> bool:
        return self._r.random() < p


# ---------------------------------------------------------------------------------------------
# Strings: math_dapo and math_verify
# ---------------------------------------------------------------------------------------------

# (id, response, ground truth): the cases the issue names, then the edges of each rule.
_HAND_MATH: list[tuple[str, str, str]] = [
    ("empty_solution", "", "42"),
    ("empty_truth", "Answer: 42", ""),
    ("both_empty", "", ""),
    ("no_answer_line", "The result is 42.", "42"),
    ("answer_colon_nothing", "Answer:", "42"),
    ("answer_colon_newline_value", "Answer:\n42", "42"),
    ("answer_spaces", "Answer :   42  ", "42"),
    ("lowercase_marker", "answer: 42", "42"),
    ("two_answer_lines", "Answer: 41\nAnswer: 42", "42"),
    ("answer_then_text", "Answer: 42\nThat is all.", "42"),
    ("fbox_fallback", "So \\fbox{42}", "42"),
    ("fbox_answer_line", "Answer: \\fbox{42}", "42"),
    ("article_a", "Answer: a 5", "5"),
    ("article_an", "Answer: an integer", "integer"),
    ("article_inside_tan", "Answer: \\tan x", "\\tan x"),
    ("variable_a", "Answer: a + b", "a+b"),
    ("dfrac_vs_frac", "Answer: \\dfrac{1}{2}", "\\frac{1}{2}"),
    ("dfrac_both", "Answer: \\dfrac{1}{2}", "\\dfrac{1}{2}"),
    ("text_choice", "Answer: \\text{(A)}", "(A)"),
    ("text_nested_braces", "Answer: \\text{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("text_unit", "Answer: 12 \\text{ meters}", "12"),
    ("percent_escaped", "Answer: 10\\%", "10"),
    ("percent_plain", "Answer: 10%", "10"),
    ("percent_both_sides", "Answer: 10\\%", "10\\%"),
    ("thousands", "Answer: 1,000", "1000"),
    ("thousands_negative", "Answer: -1,000", "-1000"),
    ("thousands_thin_space", "Answer: 5\\,000", "5000"),
    ("thousands_decimal", "Answer: 1,234.5", "1234.5"),
    ("tuple", "Answer: (1,2)", "(1, 2)"),
    ("left_right", "Answer: \\left( 1, 2 \\right)", "(1,2)"),
    ("boxed_equation_answer_line", "Answer: \\boxed{x=5}", "5"),
    ("boxed_answer_line", "Answer: \\boxed{5}", "5"),
    ("boxed_fallback", "Thus \\boxed{42}.", "42"),
    ("boxed_fallback_spaces", "Thus \\boxed{ 42 }", "42"),
    ("boxed_fallback_nested", "Thus \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("boxed_fallback_normalised_truth", "Thus \\boxed{1,000}", "1000"),
    ("boxed_unclosed", "Thus \\boxed{42", "42"),
    ("boxed_no_brace", "Thus $\\boxed 42$", "42"),
    ("boxed_two", "\\boxed{41} then \\boxed{42}", "42"),
    ("boxed_before_last_100", "\\boxed{42}" + " " * 120, "42"),
    ("boxed_at_99", "\\boxed{42}" + " " * 89, "42"),
    ("boxed_and_answer_line", "Answer: 41 \\boxed{42}", "42"),
    ("truth_invalid_marker", "no answer", "[INVALID]"),
    ("answer_invalid_literal", "Answer: [INVALID]\n\\boxed{7}", "7"),
    ("unicode_pi", "Answer: \u03c0", "\u03c0"),
    ("unicode_cjk_prose", "\u7b54\u6848\u662f 5\u3002Answer: 5", "5"),
    ("unicode_fullwidth_digit", "Answer: \uff15", "\uff15"),
    ("unicode_fullwidth_vs_ascii", "Answer: \uff15", "5"),
    ("unicode_superscript_digits", "Answer: 1,\u00b2", "1\u00b2"),
    ("unicode_marker", "\uff21nswer: 5", "5"),
    ("unicode_nbsp", "Answer:\u00a05", "5"),
    ("long_answer_outside_tail", "Answer: 42\n" + "x" * 400, "42"),
    ("long_answer_inside_tail", "y" * 5000 + "\nAnswer: 42", "42"),
    ("long_answer_line", "Answer: " + "1" * 350, "1" * 350),
    ("long_truth", "Answer: 7", "7" * 500),
    ("dollar_math", "Answer: $42$", "42"),
    ("prose_around_math", "Answer: The answer is $42$ apples", "42"),
    ("two_math_spans", "Answer: $3$ or $4$", "3"),
    ("currency", "Answer: \\$5", "5"),
    ("degrees", "Answer: 90^\\circ", "90"),
    ("sqrt_shorthand", "Answer: \\sqrt3", "\\sqrt{3}"),
    ("frac_shorthand", "Answer: \\frac12", "\\frac{1}{2}"),
    ("after_equals", "Answer: x = -7", "-7"),
    ("multiline_truth", "Answer: 5", "5\n6"),
    ("truth_with_dollars", "Answer: 5", "$5$"),
    ("truth_boxed", "Answer: 5", "\\boxed{5}"),
    ("mbox", "Answer: \\mbox{5}", "5"),
    ("text_and", "Answer: 1\\text{and}2", "1,2"),
    ("unit_inside_word", "Answer: Monday", "Monday"),
    ("unit_word_plural", "Answer: 3 hours", "3"),
    ("unit_cm_inside_word", "Answer: acme", "acme"),
    ("textbf", "Answer: \\textbf{7}", "7"),
    ("overline", "Answer: 0.\\overline{3}", "0.3"),
    ("int_like_truth_spaces", "Answer: 42", " 42 "),
]

# Pieces of generated responses (formatted with random values a, b, n, w).
_PREFIXES = ("", "Let me think.\n", "We compute 3 + 4 = 7, so ", "Step 1: x = 2.\nStep 2: y = 3.\n",
             "\u6240\u4ee5 ", "The answer is clear. ")
_MARKERS = ("Answer: ", "Answer:", "answer: ", "ANSWER : ", "Answer:\n", "Final Answer: ", "The answer: ", "",
            "Answer: Answer: ")
_BODIES = ("{n}", "{n} cm", "{n} \\text{{ meters}}", "\\boxed{{{n}}}", "\\fbox{{{n}}}", "${n}$", "$ {n} $",
           "\\frac{{{a}}}{{{b}}}", "\\dfrac{{{a}}}{{{b}}}", "\\tfrac{{{a}}}{{{b}}}", "\\frac{a}{b}",
           "\\frac{a}{b}{n}", "\\sqrt{{{n}}}", "\\sqrt{n}", "{n}\\%", "{n}%", "{n},000", "-{n},000", "{n}\\,000",
           "{n},{a}", "\\text{{{w}}}", "\\text{{{n} {w}}}", "x = {n}", "x={n}", "\\left( {a}, {b} \\right)",
           "({a}, {b})", "a {n}", "an {w}", "{n}^\\circ", "{n}^{{\\circ}}", "\\${n}", "\\boxed{{x={n}}}",
           "{n} dollars", "\\textbf{{{n}}}", "\\mbox{{{n}}}", "{w}", "{a}.{b}", "-{n}", "\\pi", "{n}\\pi",
           "\\{{{a}, {b}\\}}", "[{a}, {b})", "{a}/{b}", "{n}.0", "0.{n}", "\\text{{(}}{w}\\text{{)}}", "$x={n}$")
_SUFFIXES = ("", ".", "\n", "\nThus we are done.", " $", " \\boxed{{{n}}}", "\n\\boxed{{{n}}}", " }}", " {{")
_TRUTHS = ("{n}", "{n}", "{n}", "-{n}", "\\frac{{{a}}}{{{b}}}", "{a}/{b}", "\\sqrt{{{n}}}", "{n}000", "{n},000",
           "{w}", "({a},{b})", "({a}, {b})", "{n}\\%", "0.{n}", "{a}.{b}", "x={n}", "\\pi", "{n}\\pi",
           "\\{{{a},{b}\\}}", "{m}")
_WORDS = ("integer", "apple", "Monday", "red", "A", "B", "yes", "sue", "square", "points")
_FUZZ_ALPHABET = "0123456789abcxyzAnswer:= ,.$\\{}()[]%^_-+/\n\t frac boxed text \u03c0\u00b2"


def _fill(template: str, values: dict) -> str:
    return template.format(**values)


def math_cases(seed: int = SEED) -> list[dict]:
    """math_dapo inputs: the hand cases, generated responses, then fuzz strings."""
    rng = Rng(seed)
    cases = [{"id": f"hand/{name}", "solution": s, "ground_truth": g, "pause_tokens_index": None}
             for name, s, g in _HAND_MATH]
    # verl's pause_tokens_index: four offsets into the 300-character tail; the last one ends the window.
    long_box = "z" * 200 + "\\boxed{9}" + "w" * 92  # the box starts 101 characters before the end
    cases += [
        {"id": "hand/pause_tokens_window", "solution": long_box, "ground_truth": "9", "pause_tokens_index": [0, 5, 10, 215]},
        {"id": "hand/pause_tokens_window_misses", "solution": long_box, "ground_truth": "9", "pause_tokens_index": [0, 5, 10, 300]},
        {"id": "hand/pause_tokens_small_offset", "solution": "\\boxed{3} and more", "ground_truth": "3", "pause_tokens_index": [1, 2, 3, 40]},
    ]
    for i in range(520):
        values = {"a": rng.randint(0, 12), "b": rng.randint(1, 12), "n": rng.randint(0, 999),
                  "w": rng.choice(_WORDS), "m": rng.randint(0, 999)}
        filler = "" if not rng.chance(0.15) else "t" * rng.randint(200, 600)
        response = (filler + rng.choice(_PREFIXES) + rng.choice(_MARKERS) + _fill(rng.choice(_BODIES), values)
                    + _fill(rng.choice(_SUFFIXES), values))
        truth = _fill(rng.choice(_TRUTHS), values)
        cases.append({"id": f"gen/{i}", "solution": response, "ground_truth": truth, "pause_tokens_index": None})
    for i in range(160):
        response = "".join(rng.choice(_FUZZ_ALPHABET) for _ in range(rng.randint(0, 70)))
        truth = "".join(rng.choice(_FUZZ_ALPHABET) for _ in range(rng.randint(0, 6)))
        cases.append({"id": f"fuzz/{i}", "solution": response, "ground_truth": truth, "pause_tokens_index": None})
    return cases


_HAND_VERIFY: list[tuple[str, str, str]] = [
    ("fraction_vs_decimal", "The answer is $\\boxed{0.5}$.", "\\frac{1}{2}"),
    ("decimal_vs_fraction", "So $\\frac{1}{2}$", "0.5"),
    ("equation_vs_value", "We get $x = 5$", "5"),
    ("set_order", "$\\boxed{\\{2, 1\\}}$", "\\{1,2\\}"),
    ("interval", "$\\boxed{(1, 2]}$", "(1,2]"),
    ("interval_wrong", "$\\boxed{[1, 2]}$", "(1,2]"),
    ("sqrt_forms", "$\\boxed{\\frac{\\sqrt{2}}{2}}$", "\\frac{1}{\\sqrt{2}}"),
    ("pi_multiple", "$\\boxed{2\\pi}$", "2\\pi"),
    ("percent", "$\\boxed{10\\%}$", "10"),
    ("thousands", "$\\boxed{1,000}$", "1000"),
    ("dfrac", "$\\boxed{\\dfrac{3}{4}}$", "\\frac{3}{4}"),
    ("text_choice", "$\\boxed{\\text{(A)}}$", "A"),
    ("plain_number_no_box", "The final answer is 7", "7"),
    ("wrong", "$\\boxed{8}$", "7"),
    ("empty_solution", "", "7"),
    ("empty_truth", "$\\boxed{7}$", ""),
    ("no_math", "I do not know.", "7"),
    ("unicode_prose", "\u7b54\u6848 $\\boxed{7}$", "7"),
    ("long_reasoning", "r" * 3000 + " $\\boxed{12}$", "12"),
    ("answer_line_only", "Answer: 12", "12"),
    ("matrix", "$\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}$", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
    ("negative", "$\\boxed{-3}$", "-3"),
    ("sign_wrong", "$\\boxed{3}$", "-3"),
    ("expression", "$\\boxed{x^2 + 2x + 1}$", "(x+1)^2"),
    ("inequality", "$\\boxed{x > 3}$", "x>3"),
    ("degrees", "$\\boxed{90^\\circ}$", "90"),
    ("scientific", "$\\boxed{1.5 \\times 10^{3}}$", "1500"),
    ("unclosed_box", "$\\boxed{7", "7"),
    ("two_boxes", "$\\boxed{6}$ then $\\boxed{7}$", "7"),
]


def math_verify_cases(seed: int = SEED) -> list[dict]:
    """math_verify inputs: the hand cases, then a slice of the math_dapo cases."""
    cases = [{"id": f"hand/{name}", "solution": s, "ground_truth": g} for name, s, g in _HAND_VERIFY]
    pool = [c for c in math_cases(seed) if not c["id"].startswith("hand/pause")]
    cases += [{"id": c["id"], "solution": c["solution"], "ground_truth": c["ground_truth"]} for c in pool[::6]]
    return cases


# ---------------------------------------------------------------------------------------------
# Tensors: policy losses, advantages, rollout correction, KL
# ---------------------------------------------------------------------------------------------


def _tensor(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _lengths_mask(lengths: list[int], width: int) -> list[list[float]]:
    return [[1.0 if t < n else 0.0 for t in range(width)] for n in lengths]


def _loss_set(rng: Rng, name: str, lengths: list[int], width: int, *, spread: float, mask=None) -> dict:
    """old_log_prob, log_prob, advantages, response_mask (and maybe rollout_is_weights) for one set."""
    mask = mask if mask is not None else _lengths_mask(lengths, width)
    rows = len(mask)
    old = [[-rng.uniform(0.0, 3.0) for _ in range(width)] for _ in range(rows)]
    new = [[o + rng.centred(spread) for o in row] for row in old]
    adv = [[rng.centred(1.0) for _ in range(width)] for _ in range(rows)]
    out = {"old_log_prob": old, "log_prob": new, "advantages": adv, "response_mask": mask}
    if name == "beyond20":  # a few tokens whose log ratio is far outside the +-20 clamp
        for r, t, d in ((0, 1, 25.0), (0, 4, -31.0), (2, 0, 44.0), (4, 2, -22.5), (5, 6, 21.0)):
            new[r][t] = old[r][t] + d
    if name == "empty_rows":  # rows without valid tokens, and padding that holds extreme values
        for r in range(rows):
            for t in range(width):
                if mask[r][t] == 0.0:
                    new[r][t], old[r][t] = -40.0 + r, 25.0 - t
    if name == "outcome":  # one advantage per response (the GRPO case), signs mixed
        out["advantages"] = [[row[0]] * width for row in adv]
    if name == "is_weights":
        out["rollout_is_weights"] = [[rng.uniform(0.0, 2.0) for _ in range(width)] for _ in range(rows)]
    return {k: _tensor(v) for k, v in out.items()}


def tensor_sets(seed: int = SEED) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor input, by set name (float32; the values are exact float32 roundings)."""
    rng = Rng(seed + 1)
    w = 10
    gaps = [[1, 1, 0, 0, 1, 1, 1, 0, 1, 1], [0, 1, 1, 1, 0, 0, 1, 0, 0, 0], [1, 0, 1, 0, 1, 0, 1, 0, 1, 0],
            [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]]
    gaps = [[float(v) for v in row] for row in gaps]
    base_lengths = [10, 7, 3, 1, 9, 5]
    sets = {
        "loss/base": _loss_set(rng, "base", base_lengths, w, spread=0.05),
        "loss/wide": _loss_set(rng, "wide", base_lengths, w, spread=0.6),
        "loss/beyond20": _loss_set(rng, "beyond20", base_lengths, w, spread=0.3),
        "loss/empty_rows": _loss_set(rng, "empty_rows", [6, 0, 10, 0, 2, 4], w, spread=0.4),
        "loss/gaps": _loss_set(rng, "gaps", [], w, spread=0.4, mask=gaps),
        "loss/is_weights": _loss_set(rng, "is_weights", base_lengths, w, spread=0.4),
        "loss/single_row": _loss_set(rng, "single", [5], 5, spread=0.4),
        "loss/outcome": _loss_set(rng, "outcome", base_lengths, w, spread=0.3),
    }

    # Rollout correction: old (training) vs rollout log-probs.
    def rc_set(lengths, spread, mask=None, far=(), garbage=False):
        mask = mask if mask is not None else _lengths_mask(lengths, w)
        old = [[-rng.uniform(0.0, 3.0) for _ in range(w)] for _ in mask]
        rollout = [[o + rng.centred(spread) for o in row] for row in old]
        for r, t, d in far:
            rollout[r][t] = old[r][t] - d
        if garbage:
            for r, row in enumerate(mask):
                for t, m in enumerate(row):
                    if m == 0.0:
                        old[r][t], rollout[r][t] = -60.0 + t, 30.0 - r
        return {"old_log_prob": _tensor(old), "rollout_log_prob": _tensor(rollout), "response_mask": _tensor(mask)}

    sets["rc/base"] = rc_set(base_lengths, 0.05)
    sets["rc/wide"] = rc_set(base_lengths, 0.8)
    sets["rc/beyond20"] = rc_set(base_lengths, 0.3, far=((0, 2, 26.0), (1, 0, -35.0), (4, 8, 50.0), (5, 1, -21.0)))
    sets["rc/empty_rows"] = rc_set([8, 0, 4, 0, 0, 10], 0.3, garbage=True)
    sets["rc/gaps"] = rc_set([], 0.3, mask=gaps, garbage=True)

    # Advantages: outcome rewards on the last valid token; index lists go to tensors.json.
    def adv_set(lengths, scores, mask=None, token_rewards=False):
        mask = mask if mask is not None else _lengths_mask(lengths, 6)
        rewards = [[0.0] * len(mask[0]) for _ in mask]
        for r, row in enumerate(mask):
            valid = [t for t, m in enumerate(row) if m > 0]
            if token_rewards:
                rewards[r] = [rng.centred(0.5) for _ in row]  # rewards everywhere, padding included
            elif valid:
                rewards[r][valid[-1]] = scores[r]
        return {"token_level_rewards": _tensor(rewards), "response_mask": _tensor(mask)}

    binary = [rng.choice((-1.0, 1.0)) for _ in range(12)]
    binary[0:3] = [1.0, 1.0, 1.0]  # group p0 (rows 0, 1, 2): all equal
    sets["adv/binary"] = adv_set([6, 3, 5, 1, 6, 2, 4, 6, 0, 5, 6, 3], binary)
    sets["adv/real"] = adv_set([6, 3, 5, 1, 6, 2, 4, 6, 2, 5, 6, 3], [rng.centred(1.5) for _ in range(12)])
    adv_gaps = [[1, 1, 0, 1, 1, 0], [0, 1, 1, 0, 1, 1], [1, 0, 0, 0, 0, 1], [1, 1, 1, 1, 1, 1],
                [0, 0, 1, 1, 0, 0], [1, 0, 1, 0, 1, 0]]
    sets["adv/gaps"] = adv_set([], [], mask=[[float(v) for v in row] for row in adv_gaps], token_rewards=True)

    # KL: log-prob differences from small to far beyond the +-20 clamp of k3.
    lp = [[-rng.uniform(0.0, 4.0) for _ in range(8)] for _ in range(4)]
    ref = [[v + rng.centred(1.0) for v in row] for row in lp]
    ref[0][0], ref[1][3], ref[2][5], ref[3][7] = lp[0][0] - 30.0, lp[1][3] + 25.0, lp[2][5] + 3.5, lp[3][7] - 12.0
    sets["kl/mixed"] = {"logprob": _tensor(lp), "ref_logprob": _tensor(ref)}
    return sets


# Prompt ids of the advantage sets (verl passes uids as a numpy object array; we pass lists).
ADV_INDEX = {
    "adv/binary": ["p0", "p0", "p0", "p1", "p2", "p1", "p3", "p2", "p2", "p4", "p5", "p5"],
    "adv/real": ["p0", "p1", "p0", "p2", "p1", "p3", "p0", "p1", "p4", "p4", "p0", "p5"],
    "adv/gaps": ["a", "b", "a", "b", "a", "c"],
}


def policy_loss_cases() -> list[dict]:
    """(loss, set, keyword arguments) for each policy-loss case."""
    clip = {"vanilla": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0},
            "gspo": {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4},
            "cispo": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}}
    other_clip = {"vanilla": {"clip_ratio_low": 0.1, "clip_ratio_high": 0.5, "clip_ratio_c": 10.0},
                  "gspo": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28},
                  "cispo": {"clip_ratio_low": 0.9, "clip_ratio_high": 4.0}}
    sets = ("base", "wide", "beyond20", "empty_rows", "gaps", "is_weights", "single_row", "outcome")
    cases = []
    for loss in ("vanilla", "gspo", "cispo"):
        for s in sets:
            for mode in AGG_MODES:
                cases.append({"id": f"{loss}/{s}/{mode}", "loss": loss, "set": f"loss/{s}",
                              "kwargs": {"loss_agg_mode": mode, **clip[loss]}})
        for s in ("base", "wide", "beyond20"):
            cases.append({"id": f"{loss}/{s}/other_clip", "loss": loss, "set": f"loss/{s}",
                          "kwargs": {"loss_agg_mode": "token-mean", **other_clip[loss]}})
        # Data parallel: global counts passed in (this rank holds part of a 2-rank mini-batch).
        for mode, counts in (("token-mean", {"batch_num_tokens": 61}), ("seq-mean-token-mean", {"global_batch_size": 11}),
                             ("seq-mean-token-sum", {"global_batch_size": 11})):
            cases.append({"id": f"{loss}/wide/dp2/{mode}", "loss": loss, "set": "loss/wide",
                          "kwargs": {"loss_agg_mode": mode, "dp_size": 2, **counts, **clip[loss]}})
    return cases


def advantage_cases() -> list[dict]:
    cases = []
    for s in ("adv/binary", "adv/real"):
        for fn in ("grpo", "grpo_vectorized"):
            for norm in (True, False):
                cases.append({"id": f"{fn}/{s}/norm={norm}", "estimator": fn, "set": s,
                              "kwargs": {"norm_adv_by_std_in_grpo": norm}})
        cases.append({"id": f"rloo/{s}", "estimator": "rloo", "set": s, "kwargs": {}})
    for s in ("adv/real", "adv/gaps", "adv/binary"):
        for gamma in (1.0, 0.9):
            cases.append({"id": f"reinforce_plus_plus/{s}/gamma={gamma}", "estimator": "reinforce_plus_plus",
                          "set": s, "kwargs": {"gamma": gamma}})
    return cases


_RC_CONFIGS: dict[str, dict] = {
    "metrics_only": {},
    "token_is": {"rollout_is": "token", "rollout_is_threshold": 2.0},
    "token_is_band": {"rollout_is": "token", "rollout_is_threshold": "0.5_2.0"},
    "token_is_norm": {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": True},
    "seq_is": {"rollout_is": "sequence", "rollout_is_threshold": 2.0},
    "seq_is_norm": {"rollout_is": "sequence", "rollout_is_threshold": 5.0, "rollout_is_batch_normalize": True},
    "rs_token_k1": {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.8_1.25"},
    "rs_seq_mean_k3": {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01},
    "rs_two_modes": {"rollout_rs": "seq_max_k2,token_k3", "rollout_rs_threshold": "0.5,0.2"},
    "rs_seq_sum_k1_and_token_is": {"rollout_is": "token", "rollout_is_threshold": 2.0,
                                   "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0"},
    # IS and RS both on, with batch normalisation: verl normalises over the input mask, rejected tokens in
    "token_is_rs_token_k1": {"rollout_is": "token", "rollout_is_threshold": 2.0,
                             "rollout_rs": "token_k1", "rollout_rs_threshold": "0.8_1.25"},
    "token_is_norm_rs_token_k1": {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": True,
                                  "rollout_rs": "token_k1", "rollout_rs_threshold": "0.8_1.25"},
    "seq_is_norm_rs_seq_mean_k1": {"rollout_is": "sequence", "rollout_is_threshold": 5.0,
                                   "rollout_is_batch_normalize": True, "rollout_rs": "seq_mean_k1",
                                   "rollout_rs_threshold": "0.8_1.25"},
    "band_is_norm_rs_token_k3": {"rollout_is": "token", "rollout_is_threshold": "0.5_2.0",
                                 "rollout_is_batch_normalize": True, "rollout_rs": "token_k3",
                                 "rollout_rs_threshold": 0.05},
}


def rollout_correction_cases() -> list[dict]:
    return [{"id": f"{s}/{name}", "set": s, "kwargs": kwargs}
            for s in ("rc/base", "rc/wide", "rc/beyond20", "rc/empty_rows", "rc/gaps")
            for name, kwargs in _RC_CONFIGS.items()]


KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "abs+", "k2+", "low_var_kl+", "k3+")


def kl_cases() -> list[dict]:
    return [{"id": f"kl/{name}", "set": "kl/mixed", "kwargs": {"kl_penalty": name}} for name in KL_TYPES]


# ---------------------------------------------------------------------------------------------
# Recording verl's outputs (needs the reference venv)
# ---------------------------------------------------------------------------------------------


def _verl_actor_config(kwargs: dict):
    from verl.workers.config import ActorConfig

    info = {k: kwargs[k] for k in ("dp_size", "batch_num_tokens", "global_batch_size") if k in kwargs}
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1,
                       clip_ratio_low=kwargs["clip_ratio_low"], clip_ratio_high=kwargs["clip_ratio_high"],
                       clip_ratio_c=kwargs.get("clip_ratio_c", 3.0), global_batch_info=info)


def record_policy_losses(sets, outputs: dict, meta: list) -> None:
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    for case in policy_loss_cases():
        t = sets[case["set"]]
        log_prob = t["log_prob"].clone().requires_grad_(True)
        loss, metrics = get_policy_loss_fn(case["loss"])(
            old_log_prob=t["old_log_prob"], log_prob=log_prob, advantages=t["advantages"],
            response_mask=t["response_mask"], loss_agg_mode=case["kwargs"]["loss_agg_mode"],
            config=_verl_actor_config(case["kwargs"]), rollout_is_weights=t.get("rollout_is_weights"))
        loss.backward()
        outputs[f"out/{case['id']}/loss"] = loss.detach().reshape(())
        outputs[f"out/{case['id']}/grad"] = log_prob.grad.detach()
        meta.append({**case, "kind": "policy_loss", "metrics": {k: float(v) for k, v in metrics.items()}})


def record_advantages(sets, outputs: dict, meta: list) -> None:
    import numpy as np
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    for case in advantage_cases():
        t = sets[case["set"]]
        kwargs = dict(case["kwargs"])
        index = np.array(ADV_INDEX[case["set"]], dtype=object)
        if case["estimator"] == "reinforce_plus_plus":  # verl reads gamma from its algorithm config
            kwargs = {"config": OmegaConf.create({"gamma": kwargs["gamma"]}), "index": index}
        else:
            kwargs["index"] = index
        adv, ret = get_adv_estimator_fn(case["estimator"])(token_level_rewards=t["token_level_rewards"].clone(),
                                                           response_mask=t["response_mask"], **kwargs)
        outputs[f"out/{case['id']}/advantages"] = adv.detach().float().clone()
        outputs[f"out/{case['id']}/returns"] = ret.detach().float().clone()
        meta.append({**case, "kind": "advantage", "index": ADV_INDEX[case["set"]]})


def record_rollout_correction(sets, outputs: dict, meta: list) -> None:
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    for case in rollout_correction_cases():
        t = sets[case["set"]]
        kwargs = {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
                  "rollout_rs": None, "rollout_rs_threshold": None, **case["kwargs"]}
        proto, new_mask, metrics = compute_rollout_correction_and_rejection_mask(
            t["old_log_prob"], t["rollout_log_prob"], t["response_mask"], **kwargs)
        if proto is not None:
            outputs[f"out/{case['id']}/weights"] = proto.batch["rollout_is_weights"].detach().float().contiguous()
        outputs[f"out/{case['id']}/mask"] = new_mask.detach().float().contiguous()
        meta.append({**case, "kind": "rollout_correction", "metrics": {k: float(v) for k, v in metrics.items()}})


def record_kl(sets, outputs: dict, meta: list) -> None:
    from verl.trainer.ppo.core_algos import kl_penalty

    for case in kl_cases():
        t = sets[case["set"]]
        logprob = t["logprob"].clone().requires_grad_(True)
        value = kl_penalty(logprob, t["ref_logprob"], case["kwargs"]["kl_penalty"])
        value.sum().backward()
        outputs[f"out/{case['id']}/value"] = value.detach()
        outputs[f"out/{case['id']}/grad"] = logprob.grad.detach()
        meta.append({**case, "kind": "kl_penalty"})


def record_math_dapo() -> list[dict]:
    from verl.utils.reward_score.math_dapo import compute_score

    records = []
    for case in math_cases():
        record = dict(case)
        for mode, strict in (("default", False), ("strict", True)):
            result = compute_score(case["solution"], case["ground_truth"], strict_box_verify=strict,
                                   pause_tokens_index=case["pause_tokens_index"])
            record[mode] = {"score": float(result["score"]), "acc": bool(result["acc"]), "pred": result["pred"]}
        records.append(record)
    return records


def record_math_verify() -> list[dict]:
    from verl.utils.reward_score.math_verify import compute_score

    return [{**case, "score": float(compute_score(case["solution"], case["ground_truth"]))}
            for case in math_verify_cases()]


def _write_json(path: pathlib.Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=1, sort_keys=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT, help="output folder")
    args = parser.parse_args(argv)
    import verl  # noqa: F401  (fail early, with verl's own message, outside the reference venv)
    from safetensors.torch import save_file

    version = getattr(verl, "__version__", None)
    if version != VERL_VERSION:
        print(f"expected verl {VERL_VERSION}, found {version}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    header = {"verl_version": VERL_VERSION, "torch_version": torch.__version__.split("+")[0], "seed": SEED}

    _write_json(args.out / "math_dapo.json", {**header, "cases": record_math_dapo()})
    _write_json(args.out / "math_verify.json", {**header, "cases": record_math_verify()})

    sets = tensor_sets()
    outputs = {f"{s}/{k}": v.contiguous().clone() for s, tensors in sets.items() for k, v in tensors.items()}
    meta: list[dict] = []
    record_policy_losses(sets, outputs, meta)
    record_advantages(sets, outputs, meta)
    record_rollout_correction(sets, outputs, meta)
    record_kl(sets, outputs, meta)
    save_file(outputs, str(args.out / "tensors.safetensors"))
    _write_json(args.out / "tensors.json", {**header, "cases": meta})
    print(f"wrote {args.out}: {len(meta)} tensor cases, {len(math_cases())} math_dapo cases, "
          f"{len(math_verify_cases())} math_verify cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
