"""``math_verify``: symbolic answer checking with Hugging Face's Math-Verify, as verl and TRL offer it.

Where ``math_dapo`` compares normalised strings, Math-Verify parses both answers into SymPy and
compares them as mathematics (``0.5`` equals ``\\frac{1}{2}``, ``x=5`` equals ``5``, sets and
intervals compare as sets), so it accepts correct answers that string matching rejects.

``compute_score`` scores exactly as verl 0.9.1's wrapper ``verl.utils.reward_score.math_verify``
(checked on the verl outputs recorded in ``tests/assets/verl/``):

- the ground truth is wrapped as ``\\boxed{<ground truth>}`` and parsed as LaTeX;
- the whole response is parsed as a plain expression and as LaTeX (Math-Verify's own rules pick
  the final answer: boxed first, then the last ``$...$`` span, then an "answer is" phrase, ...);
- score 1.0 when any parsed prediction verifies against any parsed gold, else 0.0 (verl's scale:
  0/1, where math_dapo is +-1).

Timeouts. Math-Verify bounds each parse and each comparison by ``parsing_timeout_s`` /
``verify_timeout_s`` seconds (5, its defaults and verl's) with SIGALRM, so it must run in a
process's main thread: the reward manager's worker processes (``reward.timeout_s > 0``) or the
trainer's main thread (``reward.timeout_s <= 0``). An expired alarm makes that parse or comparison
fail, which scores 0.0 as in verl. A call that still overruns ``reward.timeout_s`` (SymPy can spend
long in C code that an alarm does not interrupt) is killed by the manager and handled per
``reward.on_error``; verl scores such a call ``timeout_score`` = 0.0, which
``reward.on_error=penalize reward.error_score=0.0`` reproduces.

Math-Verify (``math-verify`` on PyPI, a project dependency) is imported with this module, so the
reward manager's worker processes have it loaded before their first call is timed.
"""

from __future__ import annotations

try:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
except ImportError as _exc:  # only an install that predates the dependency lacks it
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None

__all__ = ["compute_score"]


def _require_math_verify() -> None:
    if _IMPORT_ERROR is not None:
        raise ImportError(
            "reward.function=math_verify needs the math-verify package, a dependency of this project: "
            f"re-run `make install` (or pip install 'math-verify>=0.9,<0.10'); import failed: {_IMPORT_ERROR}"
        )


def compute_score(
    solution_str: str,
    ground_truth: str,
    *,
    parsing_timeout_s: int = 5,
    verify_timeout_s: int = 5,
) -> dict:
    """Score one response with Math-Verify (rules in the module docstring).

    Returns ``{"score": 1.0 | 0.0, "acc": bool, "pred": str | None}``; ``pred`` is the text
    Math-Verify extracted as the answer (None when it found none). An int ground truth is compared
    as its decimal text.
    """
    _require_math_verify()
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str must be a str, got {type(solution_str).__name__}")
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, (str, int)):
        raise TypeError(
            f"ground_truth must be a str (or an int), got {type(ground_truth).__name__}: {ground_truth!r}"
        )
    gold = parse("\\boxed{" + str(ground_truth) + "}", (LatexExtractionConfig(),), parsing_timeout=parsing_timeout_s)
    preds = parse(
        solution_str, (ExprExtractionConfig(), LatexExtractionConfig()), parsing_timeout=parsing_timeout_s
    )
    correct = bool(gold) and any(
        verify(g, p, timeout_seconds=verify_timeout_s) for p in preds for g in gold
    )
    # parse() returns [parsed, matched text]; never str() the parsed SymPy object (it can hang).
    pred = next((p for p in preds if isinstance(p, str)), None)
    return {"score": 1.0 if correct else 0.0, "acc": correct, "pred": pred}
