"""Speculative-decoding (MTP / EAGLE) acceptance metrics from the rollout engine's per-request meta.

Keys read from each sample's engine meta (`rollout.base.SPEC_META_KEYS`; the SGLang engine maps
SGLang's meta_info names onto them):

    spec_draft_tokens       draft tokens proposed for the request
    spec_accepted_tokens    draft tokens the target model accepted
    spec_verify_ct          verification (target forward) rounds the request took

Every verification round emits the accepted drafts plus one token of the target model itself,
so per request

    accept_rate   = accepted / drafts           (0.0 when drafts == 0)
    accept_length = 1 + accepted / verify_ct    (0.0 when verify_ct == 0)

accept_length is the number of tokens produced per target forward (SGLang's own
`completion_tokens / spec_verify_ct` for a request decoded entirely under speculation). Both are
averaged over requests with equal weight, so a long response does not outweigh a short one.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

__all__ = ["SPEC_ACCEPT_KEY", "SPEC_DRAFT_KEY", "SPEC_VERIFY_KEY", "compute_spec_decode_metrics"]

from megatron_dapo.rollout.base import SPEC_META_KEYS  # noqa: E402  (one definition of the names)

SPEC_DRAFT_KEY, SPEC_ACCEPT_KEY, SPEC_VERIFY_KEY = SPEC_META_KEYS
_KEYS = (SPEC_DRAFT_KEY, SPEC_ACCEPT_KEY, SPEC_VERIFY_KEY)


def compute_spec_decode_metrics(meta: Sequence[Mapping[str, object]]) -> dict[str, float]:
    """`spec_decode/accept_rate`, `spec_decode/accept_length` (means) and `spec_decode/num_requests`.

    A quantity counts as available only when every request carries its key with a value (a
    key set to None counts as absent). Then:

    - `meta` empty, or none of the three quantities available (speculation off, or the engine
      reported nothing): returns {} and nothing is published.
    - all three available: the metrics above.
    - only some available: AssertionError naming the complete and the incomplete keys (a
      half-reported batch is an engine/config mismatch that should not go unnoticed).

    Values must be finite numbers >= 0; anything else is a ValueError naming the request and key.
    """
    if not meta:
        return {}
    for i, row in enumerate(meta):
        if not isinstance(row, Mapping):
            raise ValueError(f"meta[{i}]: expected a dict of meta_info, got {type(row).__name__}")
    missing = {key: [i for i, row in enumerate(meta) if row.get(key) is None] for key in _KEYS}
    complete = [key for key in _KEYS if not missing[key]]
    if not complete:
        return {}
    if len(complete) < len(_KEYS):
        details = ", ".join(
            f"{key} missing in {len(rows)} of {len(meta)} requests (first: meta[{rows[0]}])"
            for key, rows in missing.items()
            if rows
        )
        # Raised explicitly (not `assert`) so that `python -O` keeps the check.
        raise AssertionError(
            f"speculative-decoding meta is partial: {', '.join(complete)} present in every request but "
            f"{details}; all of {', '.join(_KEYS)} are needed"
        )

    rates: list[float] = []
    lengths: list[float] = []
    for i, row in enumerate(meta):
        drafts, accepted, verifies = (_count(i, key, row[key]) for key in _KEYS)
        rates.append(accepted / drafts if drafts > 0 else 0.0)
        lengths.append(1.0 + accepted / verifies if verifies > 0 else 0.0)
    n = len(meta)
    return {
        "spec_decode/accept_rate": sum(rates) / n,
        "spec_decode/accept_length": sum(lengths) / n,
        "spec_decode/num_requests": float(n),
    }


def _count(row: int, key: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"meta[{row}][{key!r}]: expected a count >= 0, got {value!r}")
    return float(value)
