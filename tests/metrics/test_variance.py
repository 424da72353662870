"""Variance proxies on a 2x3 batch computed by hand.

Row 0: p(y_t) = 0.5, 0.25, [pad]   sum_v p^2 = 0.5, 0.25   mask 1 1 0   A = 2
    W_t = 1 - 2p + sum p^2 = 0.5, 0.75                      W_0 = 1.25
Row 1: p(y_t) = 0.8, 0.5, 0.1      sum_v p^2 = 0.7, 0.5, 0.4   mask 1 1 1   A = -1
    W_t = 0.1, 0.5, 1.2                                    W_1 = 1.8
On-policy: total power = mean(A^2 W) = (4 * 1.25 + 1 * 1.8) / 2 = 3.4
"""

import pytest
import torch

from megatron_dapo.metrics.variance import compute_variance_proxy_metrics

PAD = 99.0


def _inputs(**overrides):
    probs = torch.tensor([[0.5, 0.25, 1.0], [0.8, 0.5, 0.1]])
    inputs = dict(
        old_log_probs=probs.log(),
        sum_sq_probs=torch.tensor([[0.5, 0.25, 0.9], [0.7, 0.5, 0.4]]),
        response_mask=torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool),
        advantages=torch.tensor([[2.0, 2.0, PAD], [-1.0, -1.0, -1.0]]),
    )
    inputs.update(overrides)
    return inputs


def test_on_policy_total_power_and_components_by_hand():
    m = compute_variance_proxy_metrics(**_inputs())
    assert m == pytest.approx(
        {
            "variance_proxy/proxy1_signal_strength": 0.0,
            "variance_proxy/proxy2_total_power": 3.4,
            "variance_proxy/proxy3_pure_noise": 0.0,  # no grad_norm: no signal, no noise estimate
            "variance_proxy/expected_a_squared": 2.5,
            "variance_proxy/expected_w": 1.525,
        },
        rel=1e-6,
    )


def test_signal_is_squared_grad_norm_and_noise_is_the_variance_of_the_mean():
    m = compute_variance_proxy_metrics(**_inputs(), grad_norm=1.0)
    assert m["variance_proxy/proxy1_signal_strength"] == 1.0
    # (proxy2 - proxy1) / (N - 1) with N = 2 sequences
    assert m["variance_proxy/proxy3_pure_noise"] == pytest.approx(2.4, rel=1e-6)


def test_noise_is_clamped_at_zero_when_the_signal_exceeds_the_total_power():
    m = compute_variance_proxy_metrics(**_inputs(), grad_norm=10.0)
    assert m["variance_proxy/proxy1_signal_strength"] == 100.0
    assert m["variance_proxy/proxy3_pure_noise"] == 0.0


def test_token_level_is_weights_enter_squared_per_token():
    w = torch.tensor([[2.0, 1.0, PAD], [0.5, 1.0, 1.0]])
    m = compute_variance_proxy_metrics(**_inputs(is_weights=w))
    # W_0 = 0.5 * 4 + 0.75 * 1 = 2.75; W_1 = 0.1 * 0.25 + 0.5 + 1.2 = 1.725
    assert m["variance_proxy/proxy2_total_power"] == pytest.approx((4 * 2.75 + 1.725) / 2, rel=1e-6)
    assert m["variance_proxy/expected_w"] == pytest.approx((2.75 + 1.725) / 2, rel=1e-6)


def test_sequence_level_is_weights_give_e_w2_a2_w():
    m = compute_variance_proxy_metrics(**_inputs(is_weights=torch.tensor([2.0, 0.5])))
    expected = (2.0**2 * 2.0**2 * 1.25 + 0.5**2 * 1.0 * 1.8) / 2  # E[w^2 A^2 W]
    assert m["variance_proxy/proxy2_total_power"] == pytest.approx(expected, rel=1e-6)
    broadcast = torch.tensor([[2.0, 2.0, 2.0], [0.5, 0.5, 0.5]])
    assert compute_variance_proxy_metrics(**_inputs(is_weights=broadcast)) == pytest.approx(m)


def test_per_sequence_advantages_equal_token_level_ones():
    m_tok = compute_variance_proxy_metrics(**_inputs(), grad_norm=0.5)
    m_seq = compute_variance_proxy_metrics(**_inputs(advantages=torch.tensor([2.0, -1.0])), grad_norm=0.5)
    assert m_seq == pytest.approx(m_tok)


def test_sequence_advantage_is_read_at_the_first_valid_token():
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    probs = torch.tensor([[1.0, 0.5, 0.25], [0.8, 0.5, 0.1]])
    m = compute_variance_proxy_metrics(
        old_log_probs=probs.log(),
        sum_sq_probs=torch.tensor([[0.9, 0.5, 0.25], [0.7, 0.5, 0.4]]),
        response_mask=mask,
        advantages=torch.tensor([[PAD, 2.0, 2.0], [-1.0, -1.0, -1.0]]),
    )
    assert m["variance_proxy/proxy2_total_power"] == pytest.approx(3.4, rel=1e-6)


def test_rows_without_valid_tokens_are_left_out_of_every_mean():
    base = _inputs()
    padded = _inputs(
        old_log_probs=torch.cat([base["old_log_probs"], torch.full((1, 3), -0.1)]),
        sum_sq_probs=torch.cat([base["sum_sq_probs"], torch.full((1, 3), 0.5)]),
        response_mask=torch.cat([base["response_mask"], torch.zeros(1, 3, dtype=torch.bool)]),
        advantages=torch.cat([base["advantages"], torch.full((1, 3), PAD)]),
    )
    assert compute_variance_proxy_metrics(**padded, grad_norm=1.0) == pytest.approx(
        compute_variance_proxy_metrics(**base, grad_norm=1.0)
    )


def test_no_valid_token_reports_zeros():
    m = compute_variance_proxy_metrics(**_inputs(response_mask=torch.zeros(2, 3)), grad_norm=1.0)
    assert set(m.values()) == {0.0}
    assert len(m) == 5


def test_single_sequence_has_no_noise_estimate():
    m = compute_variance_proxy_metrics(
        **_inputs(response_mask=torch.tensor([[1, 1, 0], [0, 0, 0]])), grad_norm=1.0
    )
    assert m["variance_proxy/proxy2_total_power"] == pytest.approx(5.0, rel=1e-6)
    assert m["variance_proxy/proxy3_pure_noise"] == 0.0


def test_negative_round_off_in_w_is_clamped_to_zero():
    # A peaked token: exp(log p) rounds to 1.0 in fp32 while the actor's sum of squares came out
    # just below 1, so 1 - 2p + sum p^2 = -1.2e-7 unclamped. ||e_y - pi||^2 cannot be negative.
    m = compute_variance_proxy_metrics(
        old_log_probs=torch.tensor([[-1e-8]]),
        sum_sq_probs=torch.tensor([[1.0 - 1e-7]]),
        response_mask=torch.ones(1, 1),
        advantages=torch.ones(1),
    )
    assert m["variance_proxy/expected_w"] == 0.0
    assert m["variance_proxy/proxy2_total_power"] == 0.0


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            dict(sum_sq_probs=torch.tensor([[0.5, 1.5, 0.9], [0.7, 0.5, 0.4]])),
            "sum_sq_probs: a sum of squared",
        ),
        (
            dict(old_log_probs=torch.tensor([[0.5, -1.0, 0.0], [-1.0, -1.0, -1.0]])),
            "old_log_probs: log-probabilities",
        ),
        (dict(advantages=torch.zeros(3)), r"advantages: expected a tensor of shape \[2, 3\] or \[2\]"),
        (dict(is_weights=torch.zeros(2, 2)), "is_weights: expected"),
        (dict(sum_sq_probs=torch.zeros(2, 2)), "sum_sq_probs: expected a tensor of shape"),
        (dict(response_mask=torch.ones(6)), r"response_mask: expected a tensor of shape \[B, T\]"),
    ],
)
def test_bad_inputs_name_the_offending_argument(overrides, match):
    with pytest.raises(ValueError, match=match):
        compute_variance_proxy_metrics(**_inputs(**overrides))


def test_padding_values_are_neither_validated_nor_summed():
    # Garbage in padding (log-prob 3.0, sum NaN, weight inf) must neither trip the range checks
    # nor leak into the sums.
    lp = _inputs()["old_log_probs"].clone()
    lp[0, 2] = 3.0
    sq = _inputs()["sum_sq_probs"].clone()
    sq[0, 2] = float("nan")
    w = torch.ones(2, 3)
    w[0, 2] = float("inf")
    m = compute_variance_proxy_metrics(**_inputs(old_log_probs=lp, sum_sq_probs=sq, is_weights=w))
    assert m["variance_proxy/proxy2_total_power"] == pytest.approx(3.4, rel=1e-6)


@pytest.mark.parametrize("grad_norm", [-1.0, float("inf"), "1.0"])
def test_grad_norm_must_be_a_finite_non_negative_number(grad_norm):
    with pytest.raises(ValueError, match="grad_norm"):
        compute_variance_proxy_metrics(**_inputs(), grad_norm=grad_norm)
