"""KL penalty estimators (values by hand, straight-through gradients) and KL controllers."""

import math

import pytest
import torch

from megatron_dapo.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    get_kl_controller,
    kl_penalty,
)

F64 = torch.float64
LOGPROB = torch.tensor([-1.0, -2.0, -0.3], dtype=F64)
REF = torch.tensor([-1.5, -1.0, -0.3], dtype=F64)  # d = logprob - ref = [0.5, -1.0, 0.0]

EXPECTED = {
    "k1": [0.5, -1.0, 0.0],
    "abs": [0.5, 1.0, 0.0],
    "k2": [0.125, 0.5, 0.0],
    # k3 with kl = ref - logprob = [-0.5, 1, 0]: exp(kl) - kl - 1
    "k3": [math.exp(-0.5) + 0.5 - 1, math.e - 2, 0.0],
}
ALIASES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_every_kl_variant_by_hand(name):
    out = kl_penalty(LOGPROB, REF, name)
    torch.testing.assert_close(out, torch.tensor(EXPECTED[ALIASES[name]], dtype=F64))


def test_k3_is_clamped_in_log_space_and_in_value():
    logprob = torch.tensor([0.0, 0.0, 0.0], dtype=F64)
    ref = torch.tensor([30.0, -30.0, 2.0], dtype=F64)
    # ref - logprob: 30 -> 20 -> exp(20) - 21 -> 10; -30 -> -20 -> exp(-20) + 19 -> 10; 2 -> e^2 - 3.
    torch.testing.assert_close(
        kl_penalty(logprob, ref, "k3"), torch.tensor([10.0, 10.0, math.exp(2) - 3], dtype=F64)
    )


def _value_and_grads(name):
    logprob = LOGPROB.clone().requires_grad_(True)
    ref = REF.clone().requires_grad_(True)
    out = kl_penalty(logprob, ref, name)
    out.sum().backward()
    return out.detach(), logprob.grad, ref.grad


@pytest.mark.parametrize("name", ["kl", "k1", "abs", "low_var_kl", "k3", "mse", "k2"])
def test_plus_suffix_keeps_base_value_and_takes_k2_gradient(name):
    value, grad_lp, grad_ref = _value_and_grads(name + "+")
    base_value, _, _ = _value_and_grads(name)
    _, k2_grad_lp, k2_grad_ref = _value_and_grads("k2")
    torch.testing.assert_close(value, base_value)
    torch.testing.assert_close(grad_lp, k2_grad_lp)
    torch.testing.assert_close(grad_ref, k2_grad_ref)
    # k2's gradient by hand: d/d logprob of (logprob - ref)^2 / 2 = logprob - ref.
    torch.testing.assert_close(grad_lp, LOGPROB - REF)


def test_plain_k3_gradient_differs_from_k2():
    """The control case: without '+' the gradient is the estimator's own."""
    _, grad_k3, _ = _value_and_grads("k3")
    torch.testing.assert_close(grad_k3, 1 - torch.exp(REF - LOGPROB))


@pytest.mark.parametrize("name", ["full", "full+"])
def test_full_kl_is_not_implemented(name):
    with pytest.raises(NotImplementedError):
        kl_penalty(LOGPROB, REF, name)


@pytest.mark.parametrize("name", ["k4", "K3", "k3++", "", "+"])
def test_unknown_kl_variant_raises_listing_valid(name):
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(LOGPROB, REF, name)


def test_kl_shape_mismatch_raises():
    with pytest.raises(ValueError, match="ref_logprob"):
        kl_penalty(LOGPROB, REF[:2], "k1")


def test_fixed_controller_never_changes():
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=100.0, n_steps=1000)
    assert ctl.value == 0.05


def test_adaptive_controller_updates_by_hand():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10_000)
    ctl.update(current_kl=9.0, n_steps=256)  # error 0.5 clipped to 0.2 -> x(1 + 0.2*256/1e4)
    assert ctl.value == pytest.approx(0.1 * 1.00512)
    ctl.update(current_kl=torch.tensor(3.0), n_steps=100)  # error -0.5 clipped to -0.2 -> x0.998
    assert ctl.value == pytest.approx(0.1 * 1.00512 * 0.998)
    ctl.update(current_kl=6.6, n_steps=1000)  # error 0.1 unclipped -> x1.01
    assert ctl.value == pytest.approx(0.1 * 1.00512 * 0.998 * 1.01)


def test_get_kl_controller_builds_both_types():
    assert isinstance(get_kl_controller("fixed", 0.01), FixedKLController)
    ctl = get_kl_controller("adaptive", 0.01, target_kl=0.1, horizon=100)
    assert isinstance(ctl, AdaptiveKLController)
    assert (ctl.value, ctl.target, ctl.horizon) == (0.01, 0.1, 100.0)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({}, "target_kl"),
        ({"target_kl": 0.0, "horizon": 10}, "target_kl"),
        ({"target_kl": 0.1}, "horizon"),
        ({"target_kl": 0.1, "horizon": -1}, "horizon"),
    ],
)
def test_adaptive_controller_needs_positive_target_and_horizon(kwargs, name):
    with pytest.raises(ValueError, match=name):
        get_kl_controller("adaptive", 0.01, **kwargs)


def test_unknown_controller_type_and_negative_coef_raise():
    with pytest.raises(ValueError, match="adaptive"):
        get_kl_controller("linear", 0.01)
    with pytest.raises(ValueError, match="kl_coef"):
        get_kl_controller("fixed", -0.01)
