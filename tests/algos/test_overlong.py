"""Overlong reward shaping (closed form at the boundaries) and the overlong filter mask."""

import pytest
import torch

from megatron_dapo.algos.overlong import overlong_filter_mask, overlong_penalty

MAX, BUF = 20, 4  # the penalty ramps over lengths 16..20


@pytest.mark.parametrize(
    "length, expected", [(0, 0.0), (10, 0.0), (16, 0.0), (17, -0.25), (18, -0.5), (20, -1.0)]
)
def test_penalty_by_hand_on_ints(length, expected):
    out = overlong_penalty(length, MAX, BUF)
    assert isinstance(out, float)
    assert out == pytest.approx(expected)


def test_penalty_factor_scales_and_reaches_minus_factor_at_max():
    assert overlong_penalty(MAX, MAX, BUF, penalty_factor=0.5) == pytest.approx(-0.5)
    assert overlong_penalty(MAX - BUF, MAX, BUF, penalty_factor=0.5) == 0.0


def test_penalty_closed_form_on_a_tensor_of_every_length():
    lengths = torch.arange(0, MAX + 1)
    out = overlong_penalty(lengths, MAX, BUF, penalty_factor=2.0)
    assert out.dtype == torch.float32
    expected = [min(-(n - (MAX - BUF)) / BUF * 2.0, 0.0) for n in range(MAX + 1)]
    torch.testing.assert_close(out, torch.tensor(expected))
    # Every length within the budget gets 0, the maximum length gets -factor.
    assert (out[: MAX - BUF + 1] == 0).all() and out[-1].item() == -2.0


def test_penalty_keeps_a_floating_tensor_dtype():
    out = overlong_penalty(torch.tensor([18.0], dtype=torch.float64), MAX, BUF)
    assert out.dtype == torch.float64 and out.item() == -0.5


@pytest.mark.parametrize(
    "args, name",
    [
        ((10, 20, 0), "overlong_buffer_len"),
        ((10, 3, 4), "max_response_length"),
        ((True, 20, 4), "response_length"),
        ((10.5, 20, 4), "response_length"),
    ],
)
def test_penalty_bad_arguments_raise(args, name):
    with pytest.raises(ValueError, match=name):
        overlong_penalty(*args)


def test_penalty_negative_factor_raises():
    with pytest.raises(ValueError, match="penalty_factor"):
        overlong_penalty(18, MAX, BUF, penalty_factor=-1.0)


def test_filter_mask_keeps_untruncated_and_eos_at_the_limit():
    lengths = torch.tensor([5, 20, 20, 19])
    assert overlong_filter_mask(lengths, 20).tolist() == [True, False, False, True]
    eos = torch.tensor([False, False, True, False])
    assert overlong_filter_mask(lengths, 20, ended_with_eos=eos).tolist() == [True, False, True, True]
    assert overlong_filter_mask([5, 20], 20).dtype == torch.bool


def test_filter_mask_shape_mismatch_raises():
    with pytest.raises(ValueError, match="ended_with_eos"):
        overlong_filter_mask(torch.tensor([5, 20]), 20, ended_with_eos=torch.tensor([True]))
