"""The DAPO recipe's rule-based math reward, scoring exactly as verl 0.9.1's ``math_dapo`` does.

Users compare our reward curves and validation scores with verl's, so ``compute_score`` returns the
same ``score``, ``acc`` and ``pred`` as ``verl.utils.reward_score.math_dapo.compute_score`` on every
string input; ``tests/rewards/test_verl_parity.py`` checks this on the verl outputs recorded in
``tests/assets/verl/`` (``tools/verl_reference.py``). The rules:

- Only the final ``TAIL_CHARS`` (300) characters of the response are read.
- Default mode: the text of the last ``Answer: ...`` line (``(?i)Answer\\s*:\\s*([^\\n]+)``) and the
  ground truth both go through ``normalize_final_answer`` and must then be equal strings. When
  there is no such line (or its text normalises to ``"[INVALID]"``), the last ``\\boxed{...}`` of
  the final 100 characters is compared with the ground truth exactly as written (no strip, no
  normalisation); with neither, ``pred`` is ``"[INVALID]"``.
- ``strict_box_verify=True``: only that boxed check; ``pred`` is None without a box.
- ``pause_tokens_index`` (four character offsets into the 300-character tail, as verl takes them):
  the boxed check reads from 100 characters before the last offset instead of the final 100.

The normalisation is Minerva's (Lewkowycz et al. 2022, appendix D), and verl keeps its quirks, so we
keep them too: ``\\fbox`` is not a box; ``"an "`` and ``"a "`` are deleted anywhere (``"\\tan x"``
becomes ``"\\tx"``) before every space is; unit words are deleted inside longer words; ``\\dfrac``,
``\\left``/``\\right``, ``\\%``, ``\\,`` and ``-1,000`` are left as they are; ``\\text{...}``
unwraps only up to its first ``}``; an ``Answer:`` line holding ``\\boxed{x=5}`` becomes ``"5}"``.
``reward.function=math_dapo_plus`` (``math_dapo_plus.py``) normalises these the way a grader would.

Score scale: 1.0 correct, -1.0 otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["INVALID_PRED", "compute_score", "last_boxed_content", "normalize_final_answer"]

# How much of the response is read at all, and how much of it the boxed check looks at.
TAIL_CHARS = 300
BOXED_TAIL_CHARS = 100

INVALID_PRED = "[INVALID]"

_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_BOX_OPEN = "\\boxed{"

# Minerva's literal rewrites, applied in this order: the articles go before the spaces do.
_SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)

# Minerva's deleted substrings (units and markup), in this order, wherever they occur.
# fmt: off
_REMOVED: tuple[str, ...] = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
    ",\\!", "{,}", '"', "\\dots",
)
# fmt: on

# Regex rewrites after the deletions, in this order. `.` never crosses a newline, so each line of a
# multi-line ground truth is rewritten on its own.
_REWRITES: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r".*?\$(.*?)\$.*"), r"$\1$"),  # keep only the first $...$ span of a line
    (re.compile(r"\\text\{(.*?)\}"), r"\1"),  # up to the first "}", even inside nested braces
    (re.compile(r"\\textbf\{(.*?)\}"), r"\1"),
    (re.compile(r"\\overline\{(.*?)\}"), r"\1"),
    (re.compile(r"\\boxed\{(.*)\}"), r"\1"),  # up to the last "}" of the line
    (re.compile(r"frac([^{])(.)"), r"frac{\1}{\2}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"sqrt([^{])"), r"sqrt{\1}"),  # \sqrt3 -> \sqrt{3}
)


def normalize_final_answer(answer: str) -> str:
    """Minerva's canonical form of a final answer, as verl 0.9.1 computes it.

    Keep what follows the last ``=``; literal substitutions (articles, spaces, ``\\$``, ``mbox``);
    delete unit words and markup; keep the first ``$...$`` span; unwrap ``\\text{}``,
    ``\\textbf{}``, ``\\overline{}``, ``\\boxed{}``; expand ``\\frac12`` and ``\\sqrt3``; drop ``$``;
    drop the commas of a string that is digits once they are gone (``str.isdigit``, so Unicode
    digits count); strip.
    """
    text = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        text = text.replace(before, after)
    for removed in _REMOVED:
        text = text.replace(removed, "")
    for pattern, replacement in _REWRITES:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def last_boxed_content(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text``, its braces matched; None without one.

    Only the literal ``\\boxed{`` opens a box (not ``\\fbox``, not ``\\boxed 5``); a box whose braces
    never close counts as no box.
    """
    start = text.rfind(_BOX_OPEN)
    if start < 0:
        return None
    depth = 0
    for i in range(start + len(_BOX_OPEN) - 1, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(_BOX_OPEN) : i]
    return None


def _boxed_check(
    tail: str, ground_truth: str, pause_tokens_index: Sequence[int] | None
) -> tuple[bool, str | None]:
    """The last box of the window before the answer vs the ground truth as written."""
    if pause_tokens_index is None:
        window = tail[-BOXED_TAIL_CHARS:]
    else:
        if len(pause_tokens_index) != 4:
            raise ValueError(
                f"pause_tokens_index must hold 4 offsets (verl's convention), got {list(pause_tokens_index)!r}"
            )
        # Python slicing on purpose: an offset below 100 starts the window from the end, as in verl.
        window = tail[pause_tokens_index[-1] - BOXED_TAIL_CHARS :]
    content = last_boxed_content(window)
    return content == ground_truth, content


def _answer_line_check(tail: str, ground_truth: str) -> tuple[bool, str]:
    answers = _ANSWER_RE.findall(tail)
    pred = normalize_final_answer(answers[-1] if answers else INVALID_PRED)
    return pred == normalize_final_answer(ground_truth), pred


def _as_text(ground_truth: str | int) -> str:
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, (str, int)):
        raise TypeError(
            f"ground_truth must be a str (or an int), got {type(ground_truth).__name__}: {ground_truth!r}"
        )
    return str(ground_truth)


def compute_score(
    solution_str: str,
    ground_truth: str,
    strict_box_verify: bool = False,
    pause_tokens_index: Sequence[int] | None = None,
) -> dict:
    """Score one response against its ground truth (see the module docstring for the rules).

    Returns ``{"score": 1.0 | -1.0, "acc": bool, "pred": str | None}``: ``pred`` is the normalised
    ``Answer:`` text, the raw box content when the boxed check decided, ``"[INVALID]"`` when the
    default mode finds neither, and None in strict mode without a box. An int ground truth is
    compared as its decimal text (verl accepts only strings).
    """
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str must be a str, got {type(solution_str).__name__}")
    truth = _as_text(ground_truth)
    tail = solution_str[-TAIL_CHARS:]

    if strict_box_verify:
        correct, pred = _boxed_check(tail, truth, pause_tokens_index)
    else:
        correct, pred = _answer_line_check(tail, truth)
        if pred == INVALID_PRED:
            box_correct, box_pred = _boxed_check(tail, truth, pause_tokens_index)
            if box_pred is not None:
                correct, pred = box_correct, box_pred
    return {"score": 1.0 if correct else -1.0, "acc": bool(correct), "pred": pred}
