"""GSPO and CISPO on hand-computed cases (their equality with verl is in test_verl_parity.py)."""

import math

import pytest
import torch

from megatron_dapo.algos.policy_loss import (
    compute_policy_loss_cispo,
    compute_policy_loss_gspo,
    compute_policy_loss_vanilla,
    get_policy_loss_fn,
)

F64 = torch.float64
CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}


def _run(fn, old, log_prob, adv, mask, **kwargs):
    leaf = torch.tensor(log_prob, dtype=F64, requires_grad=True)
    loss, metrics = fn(torch.tensor(old, dtype=F64), leaf, torch.tensor(adv, dtype=F64),
                       torch.tensor(mask, dtype=F64), **kwargs)
    loss.backward()
    return loss.item(), {k: float(v) for k, v in metrics.items()}, leaf.grad.flatten().tolist()  # grad row-major


def test_registry_resolves_gspo_and_cispo():
    assert get_policy_loss_fn("gspo") is compute_policy_loss_gspo
    assert get_policy_loss_fn("cispo") is compute_policy_loss_cispo


def test_gspo_gives_every_token_the_sequence_ratio_and_its_own_gradient():
    # Row 0: log ratios 0.2 and 0.4 (mean 0.3); the third position is padding holding a huge value.
    s = math.exp(0.3)
    loss, metrics, grad = _run(compute_policy_loss_gspo, [[0.0, 0.0, 0.0]], [[0.2, 0.4, 9.0]], [[-1.0] * 3],
                               [[1.0, 1.0, 0.0]], loss_agg_mode="token-mean", **CLIP)
    # A < 0 and s > 1 + 0.28: max(-A*s, -A*1.28) = s, unclipped; token-mean over 2 tokens.
    assert loss == pytest.approx(s)
    assert grad == pytest.approx([s / 2, s / 2, 0.0])  # d(-A * s_t) / d log_prob_t = s, halved
    assert metrics == pytest.approx({"actor/pg_clipfrac": 0.0, "actor/ppo_kl": -0.3, "actor/pg_clipfrac_lower": 0.0})


def test_gspo_clips_the_sequence_ratio_and_then_gives_no_gradient():
    loss, metrics, grad = _run(compute_policy_loss_gspo, [[0.0, 0.0]], [[0.2, 0.4]], [[1.0, 1.0]], [[1.0, 1.0]],
                               loss_agg_mode="token-mean", **CLIP)
    assert loss == pytest.approx(-1.28) and grad == [0.0, 0.0]
    assert metrics["actor/pg_clipfrac"] == 1.0


def test_gspo_default_clip_band_is_the_papers_3e_4_and_4e_4():
    # A sequence ratio of exp(5e-4) ~ 1 + 5e-4 is outside [1 - 3e-4, 1 + 4e-4] for A > 0: clipped.
    loss, metrics, _ = _run(compute_policy_loss_gspo, [[0.0]], [[5e-4]], [[1.0]], [[1.0]])
    assert loss == pytest.approx(-(1 + 4e-4)) and metrics["actor/pg_clipfrac"] == 1.0


def test_gspo_row_without_valid_tokens_adds_nothing():
    one = _run(compute_policy_loss_gspo, [[0.0, 0.0]], [[0.1, -0.3]], [[0.5, 0.5]], [[1.0, 1.0]],
               loss_agg_mode="seq-mean-token-mean", **CLIP)
    two = _run(compute_policy_loss_gspo, [[0.0, 0.0], [3.0, -7.0]], [[0.1, -0.3], [40.0, 2.0]],
               [[0.5, 0.5], [9.0, 9.0]], [[1.0, 1.0], [0.0, 0.0]], loss_agg_mode="seq-mean-token-mean", **CLIP)
    assert two[0] == pytest.approx(one[0]) and two[2] == pytest.approx(one[2] + [0.0, 0.0])


def test_gspo_log_ratio_is_clamped_at_10_with_no_gradient_past_it():
    loss, _, grad = _run(compute_policy_loss_gspo, [[0.0]], [[15.0]], [[-1.0]], [[1.0]], **CLIP)
    assert loss == pytest.approx(math.exp(10.0)) and grad == [0.0]


@pytest.mark.parametrize(
    "log_ratio,weight",
    [pytest.param(0.5, 1.28, id="above_band"), pytest.param(-0.5, 0.8, id="below_band"),
     pytest.param(0.1, math.exp(0.1), id="inside_band")],
)
def test_cispo_weight_is_the_clipped_stopped_ratio_and_the_gradient_survives(log_ratio, weight):
    log_prob, adv = -1.0, 2.0
    loss, metrics, grad = _run(compute_policy_loss_cispo, [[log_prob - log_ratio]], [[log_prob]], [[adv]],
                               [[1.0]], **CLIP)
    assert loss == pytest.approx(-weight * adv * log_prob)
    assert grad == pytest.approx([-weight * adv])  # the weight is a constant: no d ratio / d log_prob
    assert metrics["actor/pg_clipfrac"] == (0.0 if log_ratio == 0.1 else 1.0)
    assert metrics["actor/ppo_kl"] == pytest.approx(-log_ratio)


def test_cispo_gradient_equals_ppo_inside_the_band_and_not_where_ppo_clips():
    old, adv, mask = [[0.0, 0.0]], [[1.5, 1.5]], [[1.0, 1.0]]
    log_prob = [[0.1, 0.6]]  # ratio e^0.1 inside the band, e^0.6 above it
    _, _, cispo = _run(compute_policy_loss_cispo, old, log_prob, adv, mask, **CLIP)
    _, _, ppo = _run(compute_policy_loss_vanilla, old, log_prob, adv, mask, clip_ratio_c=3.0, **CLIP)
    assert cispo[0] == pytest.approx(ppo[0])
    assert ppo[1] == 0.0 and cispo[1] == pytest.approx(-1.28 * 1.5 / 2)


def test_cispo_and_gspo_multiply_by_detached_rollout_weights():
    weights = torch.tensor([[0.5, 2.0]], dtype=F64, requires_grad=True)
    for fn in (compute_policy_loss_cispo, compute_policy_loss_gspo):
        plain = _run(fn, [[0.0, 0.0]], [[-0.5, -1.0]], [[1.0, -1.0]], [[1.0, 1.0]], loss_agg_mode="token-sum", **CLIP)
        leaf = torch.tensor([[-0.5, -1.0]], dtype=F64, requires_grad=True)
        loss, _ = fn(torch.zeros(1, 2, dtype=F64), leaf, torch.tensor([[1.0, -1.0]], dtype=F64),
                     torch.ones(1, 2, dtype=F64), loss_agg_mode="token-sum", rollout_is_weights=weights, **CLIP)
        loss.backward()
        assert leaf.grad.flatten().tolist() == pytest.approx([0.5 * plain[2][0], 2.0 * plain[2][1]])
        assert weights.grad is None


@pytest.mark.parametrize("fn", [compute_policy_loss_gspo, compute_policy_loss_cispo])
def test_bad_clip_ratios_raise_naming_the_argument(fn):
    args = [torch.zeros(1, 1)] * 3 + [torch.ones(1, 1)]
    with pytest.raises(ValueError, match="clip_ratio_low"):
        fn(*args, clip_ratio_low=1.0, clip_ratio_high=0.28)
    with pytest.raises(ValueError, match="clip_ratio_high"):
        fn(*args, clip_ratio_low=0.2, clip_ratio_high=-0.1)
