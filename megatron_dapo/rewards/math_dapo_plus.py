"""``math_dapo_plus``: the DAPO math reward with a grader's normalisation (not verl's scores).

``math_dapo`` scores exactly as verl 0.9.1 does, quirks included, so curves compare. This reward
reads the answer the same way but normalises it the way a human grader would; select it with
``reward.function=math_dapo_plus``. Where the two differ (each case is in
``tests/rewards/test_math_dapo_plus.py``):

- ``\\fbox{...}`` and ``\\boxed 5`` count as boxes (math_dapo: only ``\\boxed{...}``).
- "a"/"an" are dropped only as words before a word ("an integer"), never inside one (math_dapo
  turns ``\\tan x`` into ``\\tx`` and ``a + b`` into ``+b``); unit words only stand alone.
- ``\\dfrac``/``\\tfrac`` -> ``\\frac``; ``\\left``/``\\right``, ``\\%``/``%``, ``\\,``/``\\!`` dropped;
  ``\\text{}``, ``\\textbf{}``, ``\\mathrm{}``, ``\\mathbf{}``, ``\\overline{}`` unwrapped with their braces
  matched (math_dapo stops at the first ``}``).
- Thousands separators go from any number of digit groups: ``-1,000``, ``1,234.5``, ``5\\,000``
  (math_dapo: only unsigned integers written with commas); a tuple such as ``1,2`` is kept.
- An ``Answer:`` line holding ``\\boxed{x=5}`` reads the box first, then what follows its last ``=``.
- The boxed fallback (no ``Answer:`` line) normalises both sides like the ``Answer:`` line
  (math_dapo compares the raw box content with the ground truth as written).
- An answer that normalises to the empty string (only unit words, say) is never correct
  (math_dapo counts ``Answer: integers`` correct for a ground truth of ``digits``).

Two ways to read the answer (``compute_score``):

- default: the last ``Answer: ...`` line of the response. Both that line and the ground truth go
  through ``normalize_final_answer`` (Minerva-style: keep what follows the last ``=``, drop units,
  articles, ``$``, ``\\text{}`` wrappers, thousands commas, ...), then must be equal as strings.
  With no ``Answer:`` line, the last ``\\boxed{...}`` in the final 100 characters is used instead,
  normalised the same way.
- ``strict_box_verify=True``: only the boxed check, comparing the box content with the ground truth
  as written (only surrounding whitespace stripped).

Only the final 300 characters of the response are read (the DAPO prompt asks for the answer on
the last line, and a long reasoning trace must not smuggle in an earlier guess).
Score scale: 1.0 correct, -1.0 otherwise (the DAPO recipe's scale; the arithmetic reward uses 0/1).
"""

from __future__ import annotations

import re

# How much of the response is read at all, and where the boxed fallback looks.
TAIL_CHARS = 300
BOXED_TAIL_CHARS = 100

INVALID_PRED = "[INVALID]"

_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Literal rewrites applied before anything else looks at the string (order matters: ".$" must be
# seen before "$" handling, "\text{m}" (metres) before units are dropped).
_SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    (".$", "$"),
    ("\\$", ""),  # an escaped dollar is a currency sign, not math mode
    ("\\ ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)

# Unit words, removed when they stand alone (not inside a longer word such as "Monday" or
# "\seconds"), in singular or plural form.
_UNIT_WORDS: tuple[str, ...] = tuple(
    """
    degree radian cm mm km centimeter millimeter kilometer meter metre mile mph second minute hour
    day week month year foot feet inch inches yard liter litre gram kg pound ounce dollar cent unit
    square sq point way integer digit student edge meal
    """.split()
)
_UNIT_RE = re.compile(
    r"(?<![A-Za-z\\])(?:" + "|".join(sorted(_UNIT_WORDS, key=len, reverse=True)) + r")(?:e?s)?(?![A-Za-z])"
)

# An article before a word ("an integer" -> "integer"), but not inside words such as "\tan" nor a
# variable named a ("a + b").
_ARTICLE_RE = re.compile(r"(?<![A-Za-z\\])(?:an|a)\s+(?=[A-Za-z])")

# Markup that carries no value.
# fmt: off
_REMOVED_EXPRESSIONS: tuple[str, ...] = (
    "\\ldots", "\\dots", "^\\circ", "^{\\circ}", "\\;", "\\,", ",\\!", "\\!", "{,}", '"',
    "\\%", "%", "\\text{}^2", "\\text{}^3", "\\text{}", "\\mathrm{th}", "\\left", "\\right",
)
# fmt: on

# "1,000" / "-12,345.5": digit groups of three separated by commas (and nothing else), so a
# tuple such as "1,2" is left alone.
_THOUSANDS_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def last_boxed_content(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces matched.

    Returns None when there is no box or its braces never close. ``\\boxed 5`` (no braces) gives "5".
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    head = "\\boxed" if rest.startswith("\\boxed") else "\\fbox"
    rest = rest[len(head) :]
    if rest.startswith(" "):
        # "\boxed 5": the argument is the next token, up to "$" or whitespace.
        token = rest.lstrip().split("$")[0].split()
        return token[0] if token else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None


def _unwrap_command(text: str, command: str) -> str:
    """Replace every ``\\command{inner}`` by ``inner``, its braces matched (an unclosed one is kept)."""
    head = command + "{"
    pieces = []
    start = 0
    while (open_at := text.find(head, start)) >= 0:
        depth, close_at = 0, None
        for i in range(open_at + len(head) - 1, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    close_at = i
                    break
        if close_at is None:
            break
        pieces += [text[start:open_at], text[open_at + len(head) : close_at]]
        start = close_at + 1
    pieces.append(text[start:])
    return "".join(pieces)


def _fix_shorthand_tex(text: str) -> str:
    """Expand brace-less TeX arguments: ``\\frac12`` -> ``\\frac{1}{2}``, ``\\sqrt3`` -> ``\\sqrt{3}``."""
    text = re.sub(r"\\frac([^{\\\s])([^{\\\s])", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\frac(\{[^{}]*\})([^{\\\s])", r"\\frac\1{\2}", text)
    text = re.sub(r"\\frac([^{\\\s])\{", r"\\frac{\1}{", text)
    text = re.sub(r"\\sqrt([^{\[\\\s])", r"\\sqrt{\1}", text)
    return text


def normalize_final_answer(answer: str) -> str:
    """Canonical form of a final answer, so that equivalent ways of writing it compare equal.

    Steps, in order: take the content of the last ``\\boxed{}`` if any; keep what follows the last
    ``=``; literal substitutions (``\\$`` dropped, ``mbox`` -> ``text``, ...); drop articles and unit
    words; drop valueless markup (``^\\circ``, ``\\%``, ``\\dots``, ...); remove all whitespace;
    keep the first ``$...$`` span when there is one; unwrap ``\\text{}``, ``\\textbf{}``,
    ``\\overline{}``, ``\\mathrm{}``; ``\\dfrac``/``\\tfrac`` -> ``\\frac``; expand shorthand
    ``\\frac12``/``\\sqrt3``; drop remaining ``$``; remove thousands separators from a plain number.
    """
    text = answer
    boxed = last_boxed_content(text)
    if boxed is not None:
        text = boxed
    text = text.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        text = text.replace(before, after)
    text = _ARTICLE_RE.sub("", text)
    text = _UNIT_RE.sub("", text)
    for expression in _REMOVED_EXPRESSIONS:
        text = text.replace(expression, "")
    text = re.sub(r"\s+", "", text)
    # Text around a math span ("is $5$ apples") is prose: keep the first math span only.
    span = re.search(r"\$(.*?)\$", text)
    if span is not None:
        text = span.group(1)
    while True:  # unwrap innermost first, until nested wrappers are gone
        unwrapped = text
        for command in ("\\text", "\\textbf", "\\overline", "\\mathrm", "\\mathbf"):
            unwrapped = _unwrap_command(unwrapped, command)
        if unwrapped == text:
            break
        text = unwrapped
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = _fix_shorthand_tex(text)
    text = text.replace("$", "")
    if _THOUSANDS_RE.fullmatch(text):
        text = text.replace(",", "")
    return text.strip()


def _boxed_check(tail: str, ground_truth: str) -> tuple[bool, str | None]:
    """Last ``\\boxed{}`` of the final BOXED_TAIL_CHARS characters vs the ground truth as written."""
    content = last_boxed_content(tail[-BOXED_TAIL_CHARS:])
    if content is None:
        return False, None
    return content.strip() == ground_truth.strip(), content


def _as_text(ground_truth: str | int) -> str:
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, (str, int)):
        raise TypeError(
            f"ground_truth must be a str (or an int), got {type(ground_truth).__name__}: {ground_truth!r}"
        )
    return str(ground_truth)


def compute_score(solution_str: str, ground_truth: str, strict_box_verify: bool = False) -> dict:
    """Score one response against its ground truth (see the module docstring for the rules).

    Returns ``{"score": 1.0 | -1.0, "acc": bool, "pred": str | None}``. ``pred`` is the normalised
    ``Answer:`` text or box content in the default mode (``"[INVALID]"`` when it finds neither), the
    raw box content in strict mode, and None in strict mode without a box.
    """
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str must be a str, got {type(solution_str).__name__}")
    truth = _as_text(ground_truth)
    tail = solution_str[-TAIL_CHARS:]

    if strict_box_verify:
        correct, pred = _boxed_check(tail, truth)
    else:
        answers = _ANSWER_RE.findall(tail)
        if answers:
            pred = normalize_final_answer(answers[-1])
        else:
            content = last_boxed_content(tail[-BOXED_TAIL_CHARS:])
            pred = INVALID_PRED if content is None else normalize_final_answer(content)
        # An answer that normalises to nothing ("integers") says nothing: never correct.
        correct = pred not in ("", INVALID_PRED) and pred == normalize_final_answer(truth)
    return {"score": 1.0 if correct else -1.0, "acc": bool(correct), "pred": pred}
