"""Our algorithm functions against verl 0.9.1's, on outputs tools/verl_reference.py recorded from live verl.

Each case of tests/assets/verl/tensors.json names a function, an input set of tensors.safetensors
and keyword arguments; verl's outputs sit next to the inputs. Covered: the vanilla, gspo and cispo
policy losses (value, gradient with respect to log_prob, metrics) under every loss_agg_mode and
data-parallel counts; grpo, grpo_vectorized, rloo and reinforce_plus_plus advantages (groups of
one, all-equal groups, rows without valid tokens, masked gaps); rollout-correction weights, masks
and off-policy metrics (rows without valid tokens, log ratios beyond +-20); every KL estimator.

Tolerance: the inputs are float32 and both sides compute in float32 (our GRPO statistics in float64,
then cast) with the same formulas in a different order and process, so results agree to float32
round-off: a few ulps, amplified by exp() and by divisions by a std. rtol=1e-5 (about 80 ulps) and
atol=1e-6 cover that with margin while any real difference (a clamp, a mask, a mean over other
rows) moves values by far more.
"""

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import types

import pytest
import torch
from safetensors.torch import load_file

from megatron_dapo.algos.advantage import get_adv_estimator_fn
from megatron_dapo.algos.kl import kl_penalty
from megatron_dapo.algos.policy_loss import get_policy_loss_fn
from megatron_dapo.algos.rollout_correction import compute_rollout_correction

REPO = pathlib.Path(__file__).resolve().parents[2]
ASSETS = REPO / "tests" / "assets" / "verl"
RTOL, ATOL = 1e-5, 1e-6

META = json.loads((ASSETS / "tensors.json").read_text())
TENSORS = load_file(str(ASSETS / "tensors.safetensors"))
CASES = META["cases"]


def _inputs(set_name: str) -> dict[str, torch.Tensor]:
    prefix = set_name + "/"
    return {k[len(prefix):]: v for k, v in TENSORS.items() if k.startswith(prefix)}


def _out(case: dict, name: str) -> torch.Tensor:
    return TENSORS[f"out/{case['id']}/{name}"]


def _close(ours, verl, what: str) -> None:
    torch.testing.assert_close(torch.as_tensor(ours, dtype=torch.float32), torch.as_tensor(verl, dtype=torch.float32),
                               rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _cases(kind: str) -> list:
    return [pytest.param(c, id=c["id"]) for c in CASES if c["kind"] == kind]


def test_assets_come_from_verl_0_9_1_and_cover_every_kind():
    assert META["verl_version"] == "0.9.1"
    kinds = [c["kind"] for c in CASES]
    assert kinds.count("policy_loss") >= 120 and kinds.count("rollout_correction") >= 50
    assert {"advantage", "kl_penalty"} <= set(kinds)


@pytest.mark.parametrize("case", _cases("policy_loss"))
def test_policy_loss_value_gradient_and_metrics_equal_verl(case):
    t = _inputs(case["set"])
    kw = case["kwargs"]
    log_prob = t["log_prob"].clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn(case["loss"])(
        old_log_prob=t["old_log_prob"], log_prob=log_prob, advantages=t["advantages"],
        response_mask=t["response_mask"], loss_agg_mode=kw["loss_agg_mode"], clip_ratio_low=kw["clip_ratio_low"],
        clip_ratio_high=kw["clip_ratio_high"], clip_ratio_c=kw.get("clip_ratio_c", 10.0),
        rollout_is_weights=t.get("rollout_is_weights"), dp_size=kw.get("dp_size", 1),
        batch_num_tokens=kw.get("batch_num_tokens"), global_batch_size=kw.get("global_batch_size"))
    loss.backward()
    _close(loss.detach(), _out(case, "loss"), "loss")
    _close(log_prob.grad, _out(case, "grad"), "d loss / d log_prob")
    assert set(metrics) == set(case["metrics"])
    for name, value in case["metrics"].items():
        _close(metrics[name], value, name)


def _config(gamma: float):
    return types.SimpleNamespace(gamma=gamma)  # verl passes its AlgoConfig; any object with .gamma


@pytest.mark.parametrize("case", _cases("advantage"))
def test_advantages_equal_verl_called_the_way_verl_calls_them(case):
    t = _inputs(case["set"])
    kwargs = dict(case["kwargs"])
    if case["estimator"] == "reinforce_plus_plus":  # verl's trainer: config= and index=, no gamma=
        kwargs = {"config": _config(kwargs["gamma"]), "index": case["index"]}
    else:
        kwargs.update(index=case["index"], config=_config(1.0))
    adv, ret = get_adv_estimator_fn(case["estimator"])(
        token_level_rewards=t["token_level_rewards"], response_mask=t["response_mask"], **kwargs)
    _close(adv, _out(case, "advantages"), "advantages")
    _close(ret, _out(case, "returns"), "returns")


# Our off-policy metrics that verl 0.9.1 also reports, under the same names and definitions.
OFFPOLICY_METRICS = ("kl", "k3_kl", "chi2_token", "chi2_seq", "training_ppl", "training_log_ppl", "rollout_ppl",
                     "rollout_log_ppl", "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min",
                     "ppl_ratio")


@pytest.mark.parametrize("case", _cases("rollout_correction"))
def test_rollout_correction_mask_weights_and_offpolicy_metrics_equal_verl(case):
    t = _inputs(case["set"])
    kwargs = case["kwargs"]
    weights, new_mask, metrics = compute_rollout_correction(t["old_log_prob"], t["rollout_log_prob"],
                                                            t["response_mask"], **kwargs)
    assert torch.equal(new_mask, _out(case, "mask"))  # 0/1 decisions: exact
    for name in OFFPOLICY_METRICS:
        _close(metrics[f"rollout_corr/{name}"], case["metrics"][f"rollout_corr/{name}"], name)
    if kwargs.get("rollout_is") is None:
        assert weights is None
        return
    if kwargs["rollout_is"] == "sequence" and case["set"] == "rc/beyond20":
        # API.md's contract: the sequence weight sums per-token log ratios clamped at +-20, then
        # clamps the sum; verl sums the unclamped ones. They differ only on such tokens, so here the
        # weights are checked against the contract's formula instead of verl's.
        lr = (t["old_log_prob"] - t["rollout_log_prob"]).clamp(-20, 20)
        w = torch.exp((lr * t["response_mask"]).sum(-1).clamp(-20, 20)).unsqueeze(1) * t["response_mask"]
        threshold = kwargs.get("rollout_is_threshold", 2.0)
        if isinstance(threshold, (int, float)):
            w = w.clamp(max=threshold)
        if kwargs.get("rollout_is_batch_normalize"):  # mean weight 1 over valid sequences
            valid = t["response_mask"].sum(-1) > 0
            w = w / w.max(-1).values[valid].mean()
        _close(weights, w, "is weights (API.md per-token clamp)")
        return
    # As verl, weights over the input mask: a token rejection sampling drops keeps its weight (the loss masks
    # it), and batch normalisation counts it.
    _close(weights, _out(case, "weights"), "is weights")


def test_offpolicy_metrics_beyond_20_and_on_empty_rows_are_verl_not_clamped():
    """The two places this file's fixes are about, by hand: an unclamped kl, all-row ppl means."""
    old = torch.tensor([[-1.0, -2.0, 0.0], [-5.0, 9.0, 9.0]])
    rollout = torch.tensor([[-31.0, -2.0, 0.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # row 1: no valid token
    _, _, m = compute_rollout_correction(old, rollout, mask)
    assert float(m["rollout_corr/kl"]) == pytest.approx(-30.0 / 2)  # the +30 log ratio, unclamped
    assert float(m["rollout_corr/k3_kl"]) == pytest.approx((math.exp(30.0) - 31.0) / 2, rel=1e-6)
    # Row 0: mean log-prob -1.5, ppl e^1.5; row 1 (empty) counts as ppl 1, as in verl.
    assert float(m["rollout_corr/training_ppl"]) == pytest.approx((math.exp(1.5) + 1.0) / 2)
    assert float(m["rollout_corr/chi2_seq"]) == pytest.approx((math.exp(40.0) + 1.0) / 2 - 1.0, rel=1e-6)


@pytest.mark.parametrize("case", _cases("kl_penalty"))
def test_kl_penalty_value_and_gradient_equal_verl(case):
    t = _inputs(case["set"])
    logprob = t["logprob"].clone().requires_grad_(True)
    value = kl_penalty(logprob, t["ref_logprob"], case["kwargs"]["kl_penalty"])
    value.sum().backward()
    _close(value.detach(), _out(case, "value"), "value")
    _close(logprob.grad, _out(case, "grad"), "gradient")


# ---------------------------------------------------------------------------------------------
# The assets are current: the committed inputs are what the generator makes (always), and the
# committed outputs are what live verl gives (slow, needs .venv-verl from `make verl-env`).


def _reference_module():
    spec = importlib.util.spec_from_file_location("verl_reference", REPO / "tools" / "verl_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_inputs_are_what_the_generator_makes():
    ref = _reference_module()
    # Exact on purpose: the inputs come from Python's Mersenne Twister integers and IEEE + - * /
    # only, rounded to float32, so every machine makes the same bits.
    for set_name, tensors in ref.tensor_sets().items():
        for name, tensor in tensors.items():
            assert torch.equal(tensor, TENSORS[f"{set_name}/{name}"]), f"{set_name}/{name}"
    reward_assets = ASSETS / "math_dapo.json", ASSETS / "math_verify.json"
    recorded = [json.loads(p.read_text())["cases"] for p in reward_assets]
    strip = lambda cases, keys: [{k: c[k] for k in keys} for c in cases]  # noqa: E731
    assert strip(recorded[0], ("id", "solution", "ground_truth", "pause_tokens_index")) == ref.math_cases()
    assert strip(recorded[1], ("id", "solution", "ground_truth")) == ref.math_verify_cases()
    recorded_specs = [{k: c[k] for k in c if k not in ("kind", "metrics", "index")} for c in CASES]
    specs = ref.policy_loss_cases() + ref.advantage_cases() + ref.rollout_correction_cases() + ref.kl_cases()
    assert recorded_specs == specs


def test_assets_fit_the_size_budget():
    assert sum(p.stat().st_size for p in ASSETS.iterdir()) < 1_000_000  # bytes


VERL_PYTHON = REPO / ".venv-verl" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not VERL_PYTHON.exists(), reason="no .venv-verl: `make verl-env` builds the verl 0.9.1 reference")
def test_committed_outputs_are_what_live_verl_gives(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([str(VERL_PYTHON), str(REPO / "tools" / "verl_reference.py"), "--out", str(tmp_path)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    for name in ("math_dapo.json", "math_verify.json"):  # strings, booleans and +-1/0/1 scores: exact
        assert json.loads((tmp_path / name).read_text()) == json.loads((ASSETS / name).read_text()), name
    live_meta = json.loads((tmp_path / "tensors.json").read_text())
    assert [c["id"] for c in live_meta["cases"]] == [c["id"] for c in CASES]
    for live, committed in zip(live_meta["cases"], CASES):
        for name, value in committed.get("metrics", {}).items():
            if math.isnan(value):
                assert math.isnan(live["metrics"][name]), (committed["id"], name)
            else:
                _close(live["metrics"][name], value, f"{committed['id']} {name}")
    live = load_file(str(tmp_path / "tensors.safetensors"))
    assert sorted(live) == sorted(TENSORS)
    for key, tensor in TENSORS.items():
        _close(live[key], tensor, key)
