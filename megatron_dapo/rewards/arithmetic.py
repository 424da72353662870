"""Reward of the synthetic arithmetic task (prompts like ``12+7=``, see megatron_dapo.data.arithmetic).

The response is the answer itself: an integer, optionally with a leading ``-``, then EOS. The
rollout decodes with special tokens skipped, so the text normally ends at the answer; if an
explicit ``<eos>`` marker is present, whatever follows it is ignored.

Score scale: 1.0 for the right integer, 0.0 otherwise (unlike math_dapo's +1/-1). On this task
a malformed answer and a wrong number are equally wrong, and 0/1 makes the mean score read
directly as accuracy in the logs; GRPO advantages are invariant to the shift and, with std
normalisation, to the scale, so the choice does not change training.
"""

from __future__ import annotations

import re

INVALID_PRED = "[INVALID]"

# Literal EOS text the built-in tokenizer renders when special tokens are not skipped.
_EOS_TEXT = "<eos>"
_INTEGER_RE = re.compile(r"-?\d+")


def parse_integer_answer(text: str) -> int | None:
    """The integer a response states, or None when the text is not exactly one integer."""
    body = text.split(_EOS_TEXT, 1)[0].strip()
    if not _INTEGER_RE.fullmatch(body):
        return None
    return int(body)


def compute_score(solution_str: str, ground_truth: str | int) -> dict:
    """``{"score": 1.0 | 0.0, "acc": bool, "pred": str}``; ``pred`` is the parsed integer as text
    (leading zeros dropped) or ``"[INVALID]"``. Values are compared as integers, so ``"019"``
    matches ``"19"``.

    A ground truth that is not an integer is a data error (ValueError), not a wrong answer.
    """
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str must be a str, got {type(solution_str).__name__}")
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, (str, int)):
        raise TypeError(f"ground_truth must be a str or int, got {type(ground_truth).__name__}")
    truth = ground_truth if isinstance(ground_truth, int) else parse_integer_answer(ground_truth)
    if truth is None:
        raise ValueError(f"ground_truth {ground_truth!r} is not an integer")
    value = parse_integer_answer(solution_str)
    if value is None:
        return {"score": 0.0, "acc": False, "pred": INVALID_PRED}
    correct = value == truth
    return {"score": 1.0 if correct else 0.0, "acc": correct, "pred": str(value)}
