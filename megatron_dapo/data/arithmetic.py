"""The synthetic arithmetic task: prompts ``a<op>b=``, answer the integer result.

The problem space is every ``a op b`` with ``op`` in ``operators`` and both operands integers
whose decimal length is in ``[min_digits, max_digits]`` (0 counts as one digit). Problems are
numbered ``k = op_index * n**2 + a_index * n + b_index`` (n = operands available).

Train/val split: a problem belongs to val when a keyed hash of ``(seed, k)`` falls in the lowest
``1/VAL_FRACTION_INV`` of its range, else to train. So the two splits are disjoint by construction
for any ``num_samples``, and neither needs to know the other's size. Within a split, problems
are drawn without replacement in an order fixed by ``(seed, split)``: the same arguments always
give the same dataset, on any machine.
"""

from __future__ import annotations

import numpy as np

from megatron_dapo.data.dataset import PromptDataset, PromptRecord
from megatron_dapo.data.tokenizer import Tokenizer

DATA_SOURCE = "arithmetic"
ALLOWED_OPERATORS = "+-*"
MAX_DIGITS = 9  # keeps problem ids (up to 3 * 10**18) and results inside int64
VAL_FRACTION_INV = 10  # one problem in ten is reserved for val
_SPLIT_IDS = {"train": 0, "val": 1}
# Spaces up to this size are enumerated exactly (a few MB of uint64); larger ones are sampled.
_ENUMERATE_LIMIT = 2_000_000


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a fixed, well-mixed bijection of uint64 (wrapping arithmetic)."""
    x = x.copy()
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _is_val(problem_ids: np.ndarray, seed: int) -> np.ndarray:
    key = _mix64(np.array([seed], dtype=np.uint64))[0]
    return _mix64(problem_ids.astype(np.uint64) ^ key) % np.uint64(VAL_FRACTION_INV) == 0


def _operand_range(min_digits: int, max_digits: int) -> tuple[int, int]:
    low = 0 if min_digits == 1 else 10 ** (min_digits - 1)
    return low, 10**max_digits - 1


def _draw_problem_ids(
    total: int, in_split, num_samples: int, rng: np.random.Generator, split: str
) -> np.ndarray:
    """``num_samples`` distinct problem ids of the split, in a random order fixed by ``rng``."""
    if total <= _ENUMERATE_LIMIT:
        candidates = np.arange(total, dtype=np.uint64)
        candidates = candidates[in_split(candidates)]
        if len(candidates) < num_samples:
            raise ValueError(
                f"num_samples={num_samples} exceeds the {len(candidates)} distinct {split} problems "
                "these digits and operators allow; widen max_digits or operators"
            )
        return rng.permutation(candidates)[:num_samples]
    chosen: dict[int, None] = {}  # insertion-ordered set
    for _ in range(1000):
        draw = rng.integers(0, total, size=2 * num_samples + 64, dtype=np.uint64)
        for problem in draw[in_split(draw)].tolist():
            chosen.setdefault(problem)
            if len(chosen) == num_samples:
                return np.array(list(chosen), dtype=np.uint64)
    raise ValueError(f"could not draw num_samples={num_samples} distinct {split} problems; lower it")


def make_arithmetic_dataset(
    split: str,
    *,
    num_samples: int,
    seed: int,
    min_digits: int = 1,
    max_digits: int = 2,
    operators: str = "+-",
    tokenizer: Tokenizer,
) -> PromptDataset:
    """Arithmetic prompts for ``split`` ("train" or "val"); see the module docstring.

    Each record: raw_prompt ``"12+7="``, prompt_ids ``[bos_id] + encode(raw_prompt)`` (the BOS is
    left out when the tokenizer has none), ground_truth ``"19"``, data_source "arithmetic",
    uid ``"arith-<split>-<i>"``, extra_info ``{"a", "b", "op"}``.
    """
    if split not in _SPLIT_IDS:
        raise ValueError(f"split must be one of {list(_SPLIT_IDS)}, got {split!r}")
    for name, value in (
        ("num_samples", num_samples),
        ("seed", seed),
        ("min_digits", min_digits),
        ("max_digits", max_digits),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if num_samples <= 0:
        raise ValueError(f"num_samples must be > 0, got {num_samples}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if not 1 <= min_digits <= MAX_DIGITS:
        raise ValueError(f"min_digits must be in [1, {MAX_DIGITS}], got {min_digits}")
    if not min_digits <= max_digits <= MAX_DIGITS:
        raise ValueError(f"max_digits must be in [min_digits={min_digits}, {MAX_DIGITS}], got {max_digits}")
    if (
        not isinstance(operators, str)
        or not operators
        or any(op not in ALLOWED_OPERATORS for op in operators)
        or len(set(operators)) != len(operators)
    ):
        raise ValueError(
            f"operators must be distinct characters from {ALLOWED_OPERATORS!r}, got {operators!r}"
        )

    low, high = _operand_range(min_digits, max_digits)
    n = high - low + 1
    total = len(operators) * n * n
    want_val = split == "val"
    rng = np.random.default_rng(np.random.SeedSequence([seed, _SPLIT_IDS[split]]))
    problem_ids = _draw_problem_ids(
        total, lambda ids: _is_val(ids, seed) == want_val, num_samples, rng, split
    )

    records = []
    for i, problem in enumerate(problem_ids.tolist()):
        op = operators[problem // (n * n)]
        a, b = low + (problem % (n * n)) // n, low + problem % n
        result = a + b if op == "+" else a - b if op == "-" else a * b
        raw_prompt = f"{a}{op}{b}="
        prefix = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
        records.append(
            PromptRecord(
                uid=f"arith-{split}-{i}",
                prompt_ids=prefix + tokenizer.encode(raw_prompt),
                raw_prompt=raw_prompt,
                ground_truth=str(result),
                data_source=DATA_SOURCE,
                extra_info={"a": a, "b": b, "op": op},
            )
        )
    return PromptDataset(records)


def arithmetic_sft_examples(
    dataset: PromptDataset, tokenizer: Tokenizer
) -> list[tuple[list[int], list[int]]]:
    """(prompt_ids, response_ids) pairs with the correct answer: ``encode(ground_truth) + [eos_id]``.

    Used by the trainer's supervised warm-up, so the tiny model starts from a policy that
    sometimes answers right and RL has a signal to work with.
    """
    if tokenizer.eos_id is None:
        raise ValueError("the tokenizer has no eos_id; SFT responses must end with EOS")
    return [
        (list(record.prompt_ids), tokenizer.encode(record.ground_truth) + [tokenizer.eos_id])
        for record in dataset
    ]
