"""Speculative-decoding (MTP / EAGLE) acceptance metrics from the rollout engine's per-request meta.

Keys read from each sample's engine meta (`rollout.base.SPEC_META_KEYS`; the SGLang engine maps
SGLang's meta_info names onto them):

    spec_draft_tokens       draft tokens proposed for the request
    spec_accepted_tokens    draft tokens the target model accepted
    spec_verify_ct          verification (target forward) rounds the request took

Every verification round emits the accepted drafts plus one token of the target model itself,
so per request

    accept_rate   = accepted / drafts           (0.0 when drafts == 0)
    accept_length = 1 + accepted / verify_ct

accept_length is the number of tokens produced per target forward (SGLang's own
`completion_tokens / spec_verify_ct` for a request decoded entirely under speculation). Both are
averaged over the requests that had a verify step, with equal weight, so a long response does not
outweigh a short one. A request without a verify step (a response of one token, which the prefill
produced) has neither: SGLang 0.5.8+ then sends no counters at all (before, zeros), and either way
it is counted in `spec_decode/num_unverified`, not in the means (a step with one such response
among thousands is still measured; counting it as 0 would pull accept_length below 1).
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
    """`spec_decode/accept_rate`, `spec_decode/accept_length` (means over the requests with a verify
    step), `spec_decode/num_requests` (those requests) and `spec_decode/num_unverified` (the others).

    A key set to None counts as absent. Then:

    - `meta` empty, or no request carries any of the three keys (speculation off, or the engine
      reported nothing): returns {} and nothing is published.
    - a request with all three keys is measured (unverified when verify_ct is 0); one with none
      of them, while others have them, is unverified (SGLang 0.5.8+ omits the counters then).
    - a request with only some of the keys: AssertionError naming the missing keys and requests
      (a half-reported request is an engine/config mismatch that should not go unnoticed).
    - no request had a verify step: only the two counts are published.

    Values must be finite numbers >= 0; anything else is a ValueError naming the request and key.
    """
    if not meta:
        return {}
    for i, row in enumerate(meta):
        if not isinstance(row, Mapping):
            raise ValueError(f"meta[{i}]: expected a dict of meta_info, got {type(row).__name__}")
    present = [[key for key in _KEYS if row.get(key) is not None] for row in meta]
    if not any(present):
        return {}
    partial = [i for i, keys in enumerate(present) if 0 < len(keys) < len(_KEYS)]
    if partial:
        details = ", ".join(
            f"{key} missing in {len(rows)} of {len(meta)} requests (first: meta[{rows[0]}])"
            for key in _KEYS
            if (rows := [i for i in partial if key not in present[i]])
        )
        complete = [key for key in _KEYS if all(key in present[i] for i in partial)]
        # Raised explicitly (not `assert`) so that `python -O` keeps the check.
        raise AssertionError(
            f"speculative-decoding meta is partial: {details}"
            + (f" ({', '.join(complete)} present)" if complete else "")
            + f"; all of {', '.join(_KEYS)} are needed"
        )

    rates: list[float] = []
    lengths: list[float] = []
    for i, row in enumerate(meta):
        if not present[i]:
            continue
        drafts, accepted, verifies = (_count(i, key, row[key]) for key in _KEYS)
        if verifies > 0:
            rates.append(accepted / drafts if drafts > 0 else 0.0)
            lengths.append(1.0 + accepted / verifies)
    out = {"spec_decode/num_requests": float(len(rates)), "spec_decode/num_unverified": float(len(meta) - len(rates))}
    if rates:
        out["spec_decode/accept_rate"] = sum(rates) / len(rates)
        out["spec_decode/accept_length"] = sum(lengths) / len(lengths)
    return out


def _count(row: int, key: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"meta[{row}][{key!r}]: expected a count >= 0, got {value!r}")
    return float(value)
