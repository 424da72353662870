"""Speculative-decoding metrics from SGLang-style meta_info dicts."""

import pytest

from megatron_dapo.metrics.spec_decode import (
    SPEC_ACCEPT_KEY,
    SPEC_DRAFT_KEY,
    SPEC_VERIFY_KEY,
    compute_spec_decode_metrics,
)


def _req(drafts, accepted, verifies, **extra):
    return {SPEC_DRAFT_KEY: drafts, SPEC_ACCEPT_KEY: accepted, SPEC_VERIFY_KEY: verifies, **extra}


def test_key_names_are_the_engine_meta_keys():
    assert (SPEC_DRAFT_KEY, SPEC_ACCEPT_KEY, SPEC_VERIFY_KEY) == (
        "spec_draft_tokens",
        "spec_accepted_tokens",
        "spec_verify_ct",
    )


def test_per_request_rates_and_lengths_are_averaged_over_requests_with_a_verify_step():
    meta = [_req(10, 6, 4), _req(0, 0, 0), _req(8, 8, 2, finish_reason={"type": "stop"})]
    m = compute_spec_decode_metrics(meta)
    # rates 0.6, 1.0; lengths 1 + 6/4 = 2.5, 1 + 8/2 = 5; the request without a verify step is counted apart
    assert m == pytest.approx(
        {
            "spec_decode/accept_rate": 0.8,
            "spec_decode/accept_length": 3.75,
            "spec_decode/num_requests": 2.0,
            "spec_decode/num_unverified": 1.0,
        }
    )


def test_a_request_without_counters_is_one_without_a_verify_step():
    """SGLang 0.5.8+ sends no counters for a request that never verified (a one-token response); before,
    zeros. Both read the same, and one such request does not blank the step's metrics."""
    with_zeros = compute_spec_decode_metrics([_req(10, 6, 4), _req(0, 0, 0)])
    assert compute_spec_decode_metrics([_req(10, 6, 4), {"finish_reason": {"type": "stop"}}]) == with_zeros
    assert with_zeros["spec_decode/num_requests"] == 1.0 and with_zeros["spec_decode/accept_length"] == 2.5
    only_unverified = compute_spec_decode_metrics([_req(0, 0, 0), {}])
    assert only_unverified == {"spec_decode/num_requests": 0.0, "spec_decode/num_unverified": 2.0}


def test_verified_without_drafts_has_rate_zero_and_length_one():
    m = compute_spec_decode_metrics([_req(0, 0, 3)])
    assert m["spec_decode/accept_rate"] == 0.0
    assert m["spec_decode/accept_length"] == 1.0


def test_requests_weigh_equally_regardless_of_length():
    # A long request (1000 drafts) and a short one (2 drafts) count the same.
    m = compute_spec_decode_metrics([_req(1000, 1000, 250), _req(2, 0, 2)])
    assert m["spec_decode/accept_rate"] == pytest.approx(0.5)


def test_empty_meta_or_no_spec_keys_publishes_nothing():
    assert compute_spec_decode_metrics([]) == {}
    assert compute_spec_decode_metrics([{"finish_reason": {"type": "stop"}}, {}]) == {}
    assert compute_spec_decode_metrics([{SPEC_DRAFT_KEY: None, SPEC_ACCEPT_KEY: None}]) == {}


def test_only_some_quantities_present_is_an_assertion_naming_the_missing_key():
    meta = [{SPEC_DRAFT_KEY: 4, SPEC_ACCEPT_KEY: 2}, {SPEC_DRAFT_KEY: 4, SPEC_ACCEPT_KEY: 1}]
    with pytest.raises(
        AssertionError, match=r"spec_verify_ct missing in 2 of 2 requests \(first: meta\[0\]\)"
    ):
        compute_spec_decode_metrics(meta)


def test_a_key_missing_in_one_request_leaves_that_quantity_incomplete():
    # The draft count is collected only if every request has it: request 1 lacks it, so drafts are
    # unavailable while accepts and verifies are: a partial set.
    meta = [_req(4, 2, 1), {SPEC_ACCEPT_KEY: 1, SPEC_VERIFY_KEY: 1}]
    with pytest.raises(
        AssertionError, match=r"spec_draft_tokens missing in 1 of 2 requests \(first: meta\[1\]\)"
    ):
        compute_spec_decode_metrics(meta)


def test_a_none_value_counts_as_missing():
    with pytest.raises(AssertionError, match="spec_accepted_tokens missing"):
        compute_spec_decode_metrics([_req(4, None, 2)])


@pytest.mark.parametrize("bad", [-1, "3", float("nan"), True])
def test_bad_counts_name_the_request_and_key(bad):
    with pytest.raises(ValueError, match=r"meta\[1\]\['spec_verify_ct'\]"):
        compute_spec_decode_metrics([_req(4, 2, 1), _req(4, 2, bad)])


def test_meta_entries_must_be_dicts():
    with pytest.raises(ValueError, match=r"meta\[0\]: expected a dict"):
        compute_spec_decode_metrics([[4, 2, 1]])
