"""Rollout correction: IS weights, rejection sampling modes, metrics, errors and presets by hand."""

import inspect
import math

import pytest
import torch

from megatron_dapo.algos.rollout_correction import (
    ROLLOUT_CORRECTION_PRESETS,
    ROLLOUT_RS_MODES,
    compute_rollout_correction,
    get_rollout_correction_preset,
)

F64 = torch.float64
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


def _inputs(log_ratio):
    """old_log_prob, rollout_log_prob with the given per-token lr = old - rollout; garbage on padding."""
    lr = torch.tensor(log_ratio, dtype=F64)
    old = torch.full_like(lr, -1.0)
    rollout = old - lr
    rollout[MASK == 0] = float("-inf")  # padding may hold anything
    return old, rollout


# ---------------------------------------------------------------------------------------------
# Importance weights. Valid ratios: row 0 [1.5, 0.5], row 1 [3, 1, 2], row 2 [0.9].
# ---------------------------------------------------------------------------------------------

IS_LR = [[math.log(1.5), math.log(0.5), 0.0], [math.log(3.0), 0.0, math.log(2.0)], [math.log(0.9), 0.0, 0.0]]


def test_no_correction_returns_no_weights_and_the_same_mask():
    old, rollout = _inputs(IS_LR)
    weights, mask, metrics = compute_rollout_correction(old, rollout, MASK)
    assert weights is None
    assert torch.equal(mask, MASK)
    assert not any(name.startswith("rollout_corr/is_") or "rs_" in name for name in metrics)


def test_token_is_truncated_by_hand():
    old, rollout = _inputs(IS_LR)
    weights, mask, metrics = compute_rollout_correction(
        old, rollout, MASK, rollout_is="token", rollout_is_threshold=2.0
    )
    expected = torch.tensor([[1.5, 0.5, 0.0], [2.0, 1.0, 2.0], [0.9, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(weights, expected)
    assert torch.equal(mask, MASK)
    assert float(metrics["rollout_corr/is_weight_mean"]) == pytest.approx(7.9 / 6)
    assert float(metrics["rollout_corr/is_weight_max"]) == pytest.approx(2.0)
    assert float(metrics["rollout_corr/is_weight_min"]) == pytest.approx(0.5)
    assert float(metrics["rollout_corr/is_clip_frac"]) == pytest.approx(1 / 6)  # only the 3.0
    sq = 1.5**2 + 0.5**2 + 4 + 1 + 4 + 0.81
    assert float(metrics["rollout_corr/is_ess"]) == pytest.approx((7.9 / 6) ** 2 / (sq / 6))


def test_sequence_is_truncated_by_hand():
    old, rollout = _inputs(IS_LR)
    weights, _, _ = compute_rollout_correction(
        old, rollout, MASK, rollout_is="sequence", rollout_is_threshold=2.0
    )
    # Products of ratios: 0.75, 6 -> truncated to 2, 0.9; broadcast over each sequence's valid tokens.
    torch.testing.assert_close(weights, torch.tensor([[0.75], [2.0], [0.9]], dtype=F64) * MASK.to(F64))


def test_sequence_log_ratio_sum_is_clamped_to_20():
    old = torch.zeros(1, 3, dtype=F64)
    rollout = torch.full((1, 3), -15.0, dtype=F64)  # sum of lr = 45
    weights, _, _ = compute_rollout_correction(
        old, rollout, torch.ones(1, 3), rollout_is="sequence", rollout_is_threshold=1e12
    )
    torch.testing.assert_close(weights, torch.full((1, 3), math.exp(20.0), dtype=F64))


def test_band_threshold_zeroes_weights_outside_and_keeps_the_rest():
    old, rollout = _inputs(IS_LR)
    weights, _, metrics = compute_rollout_correction(
        old, rollout, MASK, rollout_is="token", rollout_is_threshold="0.6_2.5"
    )
    torch.testing.assert_close(
        weights, torch.tensor([[1.5, 0.0, 0.0], [0.0, 1.0, 2.0], [0.9, 0.0, 0.0]], dtype=F64)
    )
    assert float(metrics["rollout_corr/is_clip_frac"]) == pytest.approx(2 / 6)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalize_makes_the_mean_weight_one(level):
    old, rollout = _inputs(IS_LR)
    raw, _, _ = compute_rollout_correction(old, rollout, MASK, rollout_is=level)
    weights, _, metrics = compute_rollout_correction(
        old, rollout, MASK, rollout_is=level, rollout_is_batch_normalize=True
    )
    if level == "token":
        mean = (weights * MASK).sum() / MASK.sum()
        expected_scale = 6 / 7.9
    else:
        mean = weights[:, 0].mean()  # one weight per sequence
        expected_scale = 3 / (0.75 + 2.0 + 0.9)
    assert mean.item() == pytest.approx(1.0)
    assert float(metrics["rollout_corr/is_weight_mean"]) == pytest.approx(1.0)
    torch.testing.assert_close(weights, raw * expected_scale)


def test_mismatch_metrics_by_hand():
    old, rollout = _inputs(IS_LR)
    _, _, metrics = compute_rollout_correction(old, rollout, MASK)
    ratios = [1.5, 0.5, 3.0, 1.0, 2.0, 0.9]
    lrs = [math.log(r) for r in ratios]
    assert float(metrics["rollout_corr/log_ratio_mean"]) == pytest.approx(sum(lrs) / 6)
    assert float(metrics["rollout_corr/kl"]) == pytest.approx(-sum(lrs) / 6)
    assert float(metrics["rollout_corr/k3_kl"]) == pytest.approx(
        sum(r - 1 - lr for r, lr in zip(ratios, lrs, strict=True)) / 6
    )
    assert float(metrics["rollout_corr/chi2_token"]) == pytest.approx(sum(r * r for r in ratios) / 6 - 1)
    assert float(metrics["rollout_corr/chi2_seq"]) == pytest.approx((0.75**2 + 6.0**2 + 0.9**2) / 3 - 1)
    assert float(metrics["rollout_corr/training_ppl"]) == pytest.approx(math.e)  # old_log_prob == -1
    for value in metrics.values():
        assert value.dim() == 0 and torch.isfinite(value)


# ---------------------------------------------------------------------------------------------
# Rejection sampling. Valid lr: row 0 [0.1, -0.1], row 1 [1, 0, 0], row 2 [-2].
#   k1 = -lr: row 0 [-0.1, 0.1], row 1 [-1, 0, 0], row 2 [2]
#   k2 = lr^2/2: row 0 [0.005, 0.005], row 1 [0.5, 0, 0], row 2 [2]
#   k3 = e^lr - 1 - lr: row 0 [0.00517, 0.00484], row 1 [0.718, 0, 0], row 2 [1.135]
# ---------------------------------------------------------------------------------------------

RS_LR = [[0.1, -0.1, 0.0], [1.0, 0.0, 0.0], [-2.0, 0.0, 0.0]]
KEEP_ALL = [[1, 1, 0], [1, 1, 1], [1, 0, 0]]
ROW0 = [[1, 1, 0], [0, 0, 0], [0, 0, 0]]
ROWS01 = [[1, 1, 0], [1, 1, 1], [0, 0, 0]]
TOKEN_REJECT = [[1, 1, 0], [0, 1, 1], [0, 0, 0]]  # row 1 token 0 and row 2 rejected


@pytest.mark.parametrize(
    "mode, threshold, expected",
    [
        ("token_k1", "0.5_2", TOKEN_REJECT),  # band [-0.69, 0.69] on k1
        ("token_k1", 2.0, TOKEN_REJECT),  # a single u means [1/u, u]
        ("token_k1", "0.3_2", ROWS01),  # band [-1.20, 0.69]: keeps k1 = -1, rejects k1 = 2
        ("token_k2", 0.1, TOKEN_REJECT),
        ("token_k3", "0.6", TOKEN_REJECT),
        ("token_k3", 1.0, ROWS01),  # 0.718 kept, 1.135 rejected
        ("seq_sum_k1", "0.5_2", ROW0),  # sums 0, -1, 2
        ("seq_sum_k2", 0.4, ROW0),  # sums 0.01, 0.5, 2
        ("seq_sum_k3", 1.0, ROWS01),  # sums 0.01, 0.718, 1.135
        ("seq_mean_k1", "0.5_2", ROWS01),  # means 0, -1/3, 2
        ("seq_mean_k2", 0.1, ROW0),  # means 0.005, 0.167, 2
        ("seq_mean_k3", 0.3, ROWS01),  # means 0.005, 0.239, 1.135
        ("seq_max_k2", 0.4, ROW0),  # maxima 0.005, 0.5, 2
        ("seq_max_k3", 1.0, ROWS01),  # maxima 0.0052, 0.718, 1.135
        ("seq_max_k3", 2.0, KEEP_ALL),
    ],
)
def test_rejection_mode_by_hand(mode, threshold, expected):
    old, rollout = _inputs(RS_LR)
    mask_in = MASK.clone()
    _, mask, metrics = compute_rollout_correction(
        old, rollout, mask_in, rollout_rs=mode, rollout_rs_threshold=threshold
    )
    assert mask.tolist() == torch.tensor(expected, dtype=MASK.dtype).tolist()
    assert torch.equal(mask_in, MASK)  # the input mask is not modified
    rejected = (MASK.sum() - torch.tensor(expected).sum()).item()
    assert float(metrics["rollout_corr/rs_reject_frac"]) == pytest.approx(rejected / 6)
    assert float(metrics[f"rollout_corr/rs_reject_frac/{mode}"]) == pytest.approx(rejected / 6)


def test_every_rs_mode_is_covered_by_the_hand_cases():
    covered = {
        "token_k1",
        "token_k2",
        "token_k3",
        "seq_sum_k1",
        "seq_sum_k2",
        "seq_sum_k3",
        "seq_mean_k1",
        "seq_mean_k2",
        "seq_mean_k3",
        "seq_max_k2",
        "seq_max_k3",
    }
    assert covered == set(ROLLOUT_RS_MODES)


def test_comma_joined_modes_keep_only_tokens_every_mode_keeps():
    old, rollout = _inputs(RS_LR)
    # token_k3 <= 1.0 keeps rows 0, 1; seq_mean_k2 <= 0.1 keeps row 0 only.
    _, mask, metrics = compute_rollout_correction(
        old, rollout, MASK, rollout_rs="token_k3, seq_mean_k2", rollout_rs_threshold="1.0,0.1"
    )
    assert mask.tolist() == [[1, 1, 0], [0, 0, 0], [0, 0, 0]]
    assert float(metrics["rollout_corr/rs_reject_frac/token_k3"]) == pytest.approx(1 / 6)
    assert float(metrics["rollout_corr/rs_reject_frac/seq_mean_k2"]) == pytest.approx(4 / 6)
    assert float(metrics["rollout_corr/rs_reject_frac"]) == pytest.approx(4 / 6)
    assert float(metrics["rollout_corr/rs_seq_reject_frac"]) == pytest.approx(2 / 3)
    # One shared threshold for several modes.
    _, mask, _ = compute_rollout_correction(
        old, rollout, MASK, rollout_rs="seq_max_k3,token_k3", rollout_rs_threshold=1.0
    )
    assert mask.tolist() == ROWS01


def test_returned_mask_keeps_a_bool_input_dtype():
    old, rollout = _inputs(RS_LR)
    _, mask, _ = compute_rollout_correction(
        old, rollout, MASK.bool(), rollout_rs="seq_max_k2", rollout_rs_threshold=0.4
    )
    assert mask.dtype == torch.bool and mask.tolist() == torch.tensor(ROW0, dtype=torch.bool).tolist()


def test_is_weights_are_computed_over_the_input_mask_as_verl_does():
    old, rollout = _inputs(RS_LR)
    weights, mask, _ = compute_rollout_correction(
        old,
        rollout,
        MASK,
        rollout_is="token",
        rollout_is_batch_normalize=True,
        rollout_rs="seq_max_k2",
        rollout_rs_threshold=0.4,
    )
    # Only row 0 survives rejection, but the weights are verl 0.9.1's: every valid input token keeps its
    # weight (e^1 truncated at the default 2.0), normalised over all six of them; the mask drops rows 1-2.
    raw = torch.tensor([math.exp(0.1), math.exp(-0.1), 2.0, 1.0, 1.0, math.exp(-2.0)], dtype=F64)
    torch.testing.assert_close(weights[MASK.bool()], raw / raw.mean())
    assert (weights[MASK == 0] == 0).all()
    assert mask.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

BAD_SPECS = [
    ({"rollout_is": "tokens"}, "rollout_is"),
    ({"rollout_is": "token", "rollout_is_threshold": None}, "rollout_is_threshold"),
    ({"rollout_is": "token", "rollout_is_threshold": -1.0}, "rollout_is_threshold"),
    ({"rollout_is": "token", "rollout_is_threshold": "0_2"}, "rollout_is_threshold"),
    ({"rollout_is": "token", "rollout_is_threshold": "2_1"}, "rollout_is_threshold"),
    ({"rollout_is": "token", "rollout_is_threshold": "abc"}, "rollout_is_threshold"),
    ({"rollout_is": "token", "rollout_is_threshold": True}, "rollout_is_threshold"),
    ({"rollout_is": "token", "rollout_is_batch_normalize": "yes"}, "rollout_is_batch_normalize"),
    ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 2.0}, "rollout_rs"),
    ({"rollout_rs": "token_k1,", "rollout_rs_threshold": 2.0}, "rollout_rs"),
    ({"rollout_rs": "token_k2"}, "rollout_rs_threshold"),
    ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.1_0.5"}, "rollout_rs_threshold"),
    ({"rollout_rs": "seq_sum_k3", "rollout_rs_threshold": 0.0}, "rollout_rs_threshold"),
    ({"rollout_rs": "seq_mean_k2", "rollout_rs_threshold": "-1"}, "rollout_rs_threshold"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": "1.5_1.2"}, "rollout_rs_threshold"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": 0.5}, "rollout_rs_threshold"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_1_2"}, "rollout_rs_threshold"),
    ({"rollout_rs": "token_k1,token_k2", "rollout_rs_threshold": "2,0.1,0.2"}, "rollout_rs_threshold"),
    ({"rollout_rs": "token_k2", "rollout_rs_threshold": [0.1]}, "rollout_rs_threshold"),
]


@pytest.mark.parametrize("kwargs, argument", BAD_SPECS)
def test_bad_specs_raise_naming_the_argument(kwargs, argument):
    old, rollout = _inputs(RS_LR)
    with pytest.raises(ValueError, match=argument):
        compute_rollout_correction(old, rollout, MASK, **kwargs)


def test_shape_mismatch_raises_naming_the_tensor():
    old, rollout = _inputs(RS_LR)
    with pytest.raises(ValueError, match="response_mask"):
        compute_rollout_correction(old, rollout, MASK[:, :2])


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------

KEYWORDS = {
    name
    for name, p in inspect.signature(compute_rollout_correction).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
}


def test_presets_hold_every_keyword_plus_mode_and_loss_type():
    assert set(ROLLOUT_CORRECTION_PRESETS) == {
        "decoupled_token_is",
        "decoupled_seq_is",
        "decoupled_geo_rs",
        "bypass_ppo_clip",
        "bypass_pg_is",
    }
    for preset in ROLLOUT_CORRECTION_PRESETS.values():
        assert set(preset) == KEYWORDS | {"bypass_mode", "loss_type"}


@pytest.mark.parametrize(
    "name, is_level, rs, rs_threshold, bypass, loss_type",
    [
        ("decoupled_token_is", "token", None, None, False, "ppo_clip"),
        ("decoupled_seq_is", "sequence", None, None, False, "ppo_clip"),
        ("decoupled_geo_rs", None, "seq_mean_k1", "0.999_1.001", False, "ppo_clip"),
        ("bypass_ppo_clip", None, None, None, True, "ppo_clip"),
        ("bypass_pg_is", "sequence", None, None, True, "reinforce"),
    ],
)
def test_preset_values_and_they_run(name, is_level, rs, rs_threshold, bypass, loss_type):
    preset = get_rollout_correction_preset(name)
    assert preset["rollout_is"] == is_level and preset["rollout_is_threshold"] == 2.0
    assert preset["rollout_rs"] == rs and preset["rollout_rs_threshold"] == rs_threshold
    assert preset["bypass_mode"] is bypass and preset["loss_type"] == loss_type
    old, rollout = _inputs(RS_LR)
    kwargs = {key: value for key, value in preset.items() if key in KEYWORDS}
    weights, mask, _ = compute_rollout_correction(old, rollout, MASK, **kwargs)
    assert (weights is None) == (is_level is None)


def test_preset_lookup_returns_a_copy_and_rejects_unknown_names():
    get_rollout_correction_preset("decoupled_token_is")["rollout_is"] = "sequence"
    assert ROLLOUT_CORRECTION_PRESETS["decoupled_token_is"]["rollout_is"] == "token"
    with pytest.raises(ValueError, match="bypass_pg_is"):
        get_rollout_correction_preset("tis")
