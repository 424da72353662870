"""Policy losses and aggregation: hand-computed values, clip boundaries, split invariance."""

import math

import pytest
import torch

from megatron_dapo.algos.policy_loss import (
    AGG_MODES,
    POLICY_LOSS_KWARGS,
    agg_loss,
    compute_policy_loss_reinforce,
    compute_policy_loss_vanilla,
    get_policy_loss_fn,
    register_policy_loss,
)

F64 = torch.float64


def _one_token(ratio: float, adv: float, **kwargs):
    """Loss, metrics and d loss / d log_prob for a single valid token with the given ratio."""
    old = torch.zeros(1, 1, dtype=F64)
    log_prob = torch.full((1, 1), math.log(ratio), dtype=F64, requires_grad=True)
    loss, metrics = compute_policy_loss_vanilla(
        old, log_prob, torch.full((1, 1), adv, dtype=F64), torch.ones(1, 1), **kwargs
    )
    loss.backward()
    return loss.item(), {k: float(v) for k, v in metrics.items()}, log_prob.grad.item()


def test_ratio_one_token_mean_loss_is_minus_mean_advantage():
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(4, 7, generator=gen)
    adv = torch.randn(4, 7, generator=gen)
    mask = (torch.rand(4, 7, generator=gen) > 0.3).float()
    loss, metrics = compute_policy_loss_vanilla(old, old.clone(), adv, mask)
    torch.testing.assert_close(loss, -(adv * mask).sum() / mask.sum())
    assert float(metrics["actor/pg_clipfrac"]) == 0.0
    assert float(metrics["actor/ppo_kl"]) == 0.0
    assert float(metrics["actor/pg_clipfrac_lower"]) == 0.0


@pytest.mark.parametrize(
    "ratio, adv, expected_loss, expected_grad, clipfrac, clipfrac_lower",
    [
        (1.27, 1.0, -1.27, -1.27, 0.0, 0.0),  # just inside 1 + 0.28: unclipped
        (1.30, 1.0, -1.28, 0.0, 1.0, 0.0),  # just outside: clipped, no gradient
        (0.50, 1.0, -0.50, -0.50, 0.0, 0.0),  # below 1 - 0.2 with A > 0: pessimistic unclipped term
        (0.81, -1.0, 0.81, 0.81, 0.0, 0.0),  # just inside 1 - 0.2 with A < 0
        (0.79, -1.0, 0.80, 0.0, 1.0, 0.0),  # just outside: clipped
        (1.50, -1.0, 1.50, 1.50, 0.0, 0.0),  # above 1 + 0.28 with A < 0: unclipped, below c = 3
        (2.90, -2.0, 5.80, 5.80, 0.0, 0.0),  # ratio just below c: dual clip idle
        (3.50, -1.0, 3.00, 0.0, 0.0, 1.0),  # ratio above c: dual clip caps -A*c, no gradient
        (3.50, 1.0, -1.28, 0.0, 1.0, 0.0),  # dual clip never applies to A > 0
    ],
)
def test_clip_boundaries_by_hand(ratio, adv, expected_loss, expected_grad, clipfrac, clipfrac_lower):
    loss, metrics, grad = _one_token(ratio, adv)
    assert loss == pytest.approx(expected_loss, abs=1e-12)
    # d(-A * ratio)/d log_prob = -A * ratio; clipped branches are constant in log_prob.
    assert grad == pytest.approx(expected_grad, abs=1e-12)
    assert metrics["actor/pg_clipfrac"] == clipfrac
    assert metrics["actor/pg_clipfrac_lower"] == clipfrac_lower
    assert metrics["actor/ppo_kl"] == pytest.approx(-math.log(ratio), abs=1e-12)


def test_metrics_by_hand_are_detached_scalar_tensors_over_valid_tokens():
    ratios = torch.tensor([[1.3, 3.5, 1.0, 5.0]], dtype=F64)  # last token is padding
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    log_prob = ratios.log().requires_grad_(True)
    loss, metrics = compute_policy_loss_vanilla(torch.zeros_like(log_prob), log_prob, adv, mask)
    assert loss.item() == pytest.approx((-1.28 + 3.0 - 1.0) / 3, abs=1e-12)
    for value in metrics.values():
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad
    assert float(metrics["actor/pg_clipfrac"]) == pytest.approx(1 / 3)
    assert float(metrics["actor/pg_clipfrac_lower"]) == pytest.approx(1 / 3)
    assert float(metrics["actor/ppo_kl"]) == pytest.approx(-(math.log(1.3) + math.log(3.5)) / 3)


def test_log_ratio_is_clamped_to_20():
    loss, metrics, _ = _one_token(math.exp(50.0), -1.0, clip_ratio_c=1e12)
    assert loss == pytest.approx(math.exp(20.0), rel=1e-12)
    assert metrics["actor/ppo_kl"] == pytest.approx(-20.0)


def test_rollout_is_weights_scale_per_token_loss_and_get_no_gradient():
    log_prob = torch.tensor([[0.0, 0.1, -0.2]], dtype=F64, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=F64)
    weights = torch.tensor([[0.5, 2.0, 1.5]], dtype=F64, requires_grad=True)
    mask = torch.ones(1, 3)
    weighted, _ = compute_policy_loss_vanilla(
        log_prob.detach(), log_prob, adv, mask, rollout_is_weights=weights, loss_agg_mode="token-sum"
    )
    weighted.backward()
    # ratio == 1 everywhere, so each token's loss is -A.
    assert weighted.item() == pytest.approx(-(0.5 * 1.0 - 2.0 * 1.0 + 1.5 * 2.0))
    assert weights.grad is None
    torch.testing.assert_close(log_prob.grad, -adv * weights.detach())


@pytest.mark.parametrize("clip_ratio_c", [1.0, 0.5, -3.0])
def test_dual_clip_bound_not_above_one_raises(clip_ratio_c):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss_vanilla(x, x, x, torch.ones(1, 2), clip_ratio_c=clip_ratio_c)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"clip_ratio_low": 1.0}, "clip_ratio_low"),
        ({"clip_ratio_low": -0.1}, "clip_ratio_low"),
        ({"clip_ratio_high": -0.1}, "clip_ratio_high"),
    ],
)
def test_bad_clip_ratios_raise(kwargs, name):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=name):
        compute_policy_loss_vanilla(x, x, x, torch.ones(1, 2), **kwargs)


def test_mismatched_shapes_raise_naming_the_tensor():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages"):
        compute_policy_loss_vanilla(x, x, torch.zeros(2, 4), torch.ones(2, 3))


# ---------------------------------------------------------------------------------------------
# agg_loss
# ---------------------------------------------------------------------------------------------

LOSS_MAT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=F64)
LOSS_MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)  # row 2 has no token


@pytest.mark.parametrize(
    "mode, kwargs, expected",
    [
        ("token-mean", {}, 7 / 3),
        ("token-sum", {}, 7.0),
        ("seq-mean-token-sum", {}, (3 + 4) / 2),
        ("seq-mean-token-mean", {}, (3 / 2 + 4 / 1) / 2),
        ("seq-mean-token-sum-norm", {}, (3 + 4) / 2 / 3),
        ("token-mean", {"dp_size": 2, "batch_num_tokens": 6}, 7 / 6 * 2),
        ("token-mean", {"batch_num_tokens": torch.tensor(14.0, dtype=F64)}, 7 / 14),
        ("token-sum", {"dp_size": 2}, 14.0),
        ("seq-mean-token-sum", {"dp_size": 2, "global_batch_size": 4}, 7 / 4 * 2),
        ("seq-mean-token-mean", {"dp_size": 4, "global_batch_size": 8}, 5.5 / 8 * 4),
        ("seq-mean-token-sum-norm", {"global_batch_size": 7}, 7 / 7 / 3),
    ],
)
def test_agg_modes_by_hand(mode, kwargs, expected):
    assert agg_loss(LOSS_MAT, LOSS_MASK, mode, **kwargs).item() == pytest.approx(expected, rel=1e-7)


def test_agg_of_micro_batch_without_valid_tokens_is_zero_not_nan():
    for mode in AGG_MODES:
        assert agg_loss(LOSS_MAT, torch.zeros(3, 3), mode).item() == 0.0


def test_unknown_agg_mode_lists_valid_modes():
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        agg_loss(LOSS_MAT, LOSS_MASK, "token_mean")


@pytest.mark.parametrize(
    "mode, missing",
    [
        ("token-mean", "batch_num_tokens"),
        ("seq-mean-token-sum", "global_batch_size"),
        ("seq-mean-token-mean", "global_batch_size"),
    ],
)
def test_global_counts_required_under_data_parallel(mode, missing):
    with pytest.raises(ValueError, match=missing):
        agg_loss(LOSS_MAT, LOSS_MASK, mode, dp_size=2)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_num_tokens": 0},
        {"batch_num_tokens": -3.0},
        {"dp_size": 0},
        {"batch_num_tokens": torch.ones(2)},
    ],
)
def test_bad_counts_raise(kwargs):
    with pytest.raises(ValueError):
        agg_loss(LOSS_MAT, LOSS_MASK, "token-mean", **kwargs)


def _random_batch(seed=0, batch=8, length=6):
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(batch, length, generator=gen, dtype=F64) * 0.3
    log_prob = old + torch.randn(batch, length, generator=gen, dtype=F64) * 0.3
    adv = torch.randn(batch, length, generator=gen, dtype=F64)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    return old, log_prob, adv, mask


def _grad_of_split(old, log_prob, adv, mask, splits, mode, dp_size=1, **counts):
    """Sum of micro-batch losses (as gradient accumulation does) and the gradient it gives."""
    leaf = log_prob.clone().requires_grad_(True)
    total = 0.0
    for rows in splits:
        loss, _ = compute_policy_loss_vanilla(
            old[rows], leaf[rows], adv[rows], mask[rows], loss_agg_mode=mode, dp_size=dp_size, **counts
        )
        total = total + loss
    total.backward()
    return total.detach(), leaf.grad


SPLITS = [
    [[0, 1, 2, 3, 4, 5, 6, 7]],
    [[0, 1, 2], [3, 4, 5, 6, 7]],
    [[0], [1, 2, 3], [4, 5], [6, 7]],
    [[7, 0], [3, 5, 1], [2, 4, 6]],
]


@pytest.mark.parametrize("splits", SPLITS)
def test_token_mean_grad_is_invariant_to_microbatch_split(splits):
    old, log_prob, adv, mask = _random_batch()
    full_loss, full_grad = _grad_of_split(old, log_prob, adv, mask, [list(range(8))], "token-mean")
    loss, grad = _grad_of_split(old, log_prob, adv, mask, splits, "token-mean", batch_num_tokens=mask.sum())
    torch.testing.assert_close(loss, full_loss)
    torch.testing.assert_close(grad, full_grad)


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_seq_mean_grad_is_invariant_to_microbatch_split(mode):
    old, log_prob, adv, mask = _random_batch(seed=1)
    _, full_grad = _grad_of_split(old, log_prob, adv, mask, [list(range(8))], mode)
    _, grad = _grad_of_split(old, log_prob, adv, mask, SPLITS[2], mode, global_batch_size=8)
    torch.testing.assert_close(grad, full_grad)


def test_local_token_counts_would_break_split_invariance():
    """The control case: per-micro-batch denominators change the objective (verl #7200)."""
    old, log_prob, adv, mask = _random_batch()
    _, full_grad = _grad_of_split(old, log_prob, adv, mask, [list(range(8))], "token-mean")
    _, grad = _grad_of_split(old, log_prob, adv, mask, SPLITS[2], "token-mean")
    assert not torch.allclose(grad, full_grad)


@pytest.mark.parametrize(
    "rank_splits", [([[0, 1, 2, 3]], [[4, 5, 6, 7]]), ([[0], [1, 2]], [[3, 4], [5], [6, 7]])]
)
def test_token_mean_dp2_rank_average_equals_full_batch_grad(rank_splits):
    """Two simulated DP ranks with dp_size=2 and the global count; DDP averages their grads."""
    old, log_prob, adv, mask = _random_batch(seed=2)
    _, full_grad = _grad_of_split(old, log_prob, adv, mask, [list(range(8))], "token-mean")
    global_tokens = mask.sum()
    rank_grads = [
        _grad_of_split(
            old, log_prob, adv, mask, splits, "token-mean", dp_size=2, batch_num_tokens=global_tokens
        )[1]
        for splits in rank_splits
    ]
    torch.testing.assert_close((rank_grads[0] + rank_grads[1]) / 2, full_grad)


# ---------------------------------------------------------------------------------------------
# REINFORCE and the registry
# ---------------------------------------------------------------------------------------------


def test_reinforce_loss_and_gradient_by_hand():
    log_prob = torch.tensor([[-0.5, -1.0, -2.0]], dtype=F64, requires_grad=True)
    adv = torch.tensor([[2.0, -1.0, 3.0]], dtype=F64)
    weights = torch.tensor([[0.5, 1.0, 9.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = compute_policy_loss_reinforce(log_prob, adv, mask, rollout_is_weights=weights)
    loss.backward()
    assert loss.item() == pytest.approx(-(2.0 * -0.5 * 0.5 + -1.0 * -1.0 * 1.0) / 2)
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-0.5, 0.5, 0.0]], dtype=F64))
    assert weights.grad is None
    assert metrics == {}


def test_reinforce_ignores_clip_ratios_and_reports_ppo_kl_when_old_log_prob_given():
    log_prob = torch.tensor([[-0.5, -1.0]], dtype=F64)
    adv = torch.tensor([[1.0, 2.0]], dtype=F64)
    mask = torch.ones(1, 2)
    a, _ = compute_policy_loss_reinforce(log_prob, adv, mask, clip_ratio_low=0.1, clip_ratio_c=9.0)
    b, metrics = compute_policy_loss_reinforce(log_prob, adv, mask, old_log_prob=log_prob - 0.25)
    assert a.item() == b.item()
    assert float(metrics["actor/ppo_kl"]) == pytest.approx(-0.25)


def test_registry_resolves_builtin_losses():
    assert get_policy_loss_fn("vanilla") is compute_policy_loss_vanilla
    assert get_policy_loss_fn("reinforce") is compute_policy_loss_reinforce


def test_unknown_policy_loss_lists_registered_names():
    with pytest.raises(ValueError, match=r"\['cispo', 'gspo', 'reinforce', 'vanilla'"):
        get_policy_loss_fn("ppo")


def test_registering_a_different_function_under_a_taken_name_raises():
    with pytest.raises(ValueError, match="vanilla"):
        register_policy_loss("vanilla")(lambda **kwargs: None)


@pytest.mark.parametrize("name", ["vanilla", "reinforce", "gspo", "cispo"])
def test_every_registered_loss_accepts_the_shared_keyword_set(name):
    old, log_prob, adv, mask = _random_batch()
    kwargs = dict(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode="token-mean",
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        rollout_is_weights=torch.ones_like(adv),
        dp_size=1,
        batch_num_tokens=mask.sum(),
        global_batch_size=8,
    )
    assert set(kwargs) == set(POLICY_LOSS_KWARGS)
    loss, metrics = get_policy_loss_fn(name)(**kwargs)
    assert loss.dim() == 0 and torch.isfinite(loss)
    with pytest.raises(TypeError):
        get_policy_loss_fn(name)(**kwargs, clip_ratio_cc=3.0)  # a typo must not vanish
