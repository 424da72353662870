"""reward.function and reward.strict_box_verify reach the reward the trainer builds (STYLE rule 2),
and math_verify runs in the reward manager's worker pool under its timeout."""

import functools

import pytest

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.rewards import RewardManager, get_reward_fn, make_reward_fn, math_dapo, math_verify
from megatron_dapo.rewards.build import build_reward_manager

RESPONSES = ["Answer: 42", "So \\boxed{42}", "Answer: $\\dfrac{1}{2}$", "The answer is $\\boxed{0.5}$"]
TRUTHS = ["42", "42", "\\frac{1}{2}", "\\frac{1}{2}"]


def _scores(**reward_keys) -> list[float]:
    keys = {"reward.timeout_s": 0, **reward_keys}  # inline: these rewards are quick and pure
    cfg = load_config("configs/tiny_cpu.yaml", [f"{k}={v}" for k, v in keys.items()])
    with build_reward_manager(cfg) as rm:
        return rm.score(RESPONSES, TRUTHS, [1] * len(RESPONSES)).score.tolist()


def test_strict_box_verify_reaches_math_dapo():
    assert _scores(**{"reward.function": "math_dapo"}) == [1.0, 1.0, -1.0, -1.0]
    # Strict: only boxes count; "0.5" is not "\frac{1}{2}" as written.
    assert _scores(**{"reward.function": "math_dapo", "reward.strict_box_verify": "true"}) == [-1.0, 1.0, -1.0, -1.0]


def test_strict_box_verify_reaches_math_dapo_plus():
    assert _scores(**{"reward.function": "math_dapo_plus"}) == [1.0, 1.0, 1.0, -1.0]  # \dfrac == \frac
    assert _scores(**{"reward.function": "math_dapo_plus", "reward.strict_box_verify": "true"}) == [
        -1.0, 1.0, -1.0, -1.0]


def test_reward_function_math_verify_compares_symbolically_on_a_0_1_scale():
    assert _scores(**{"reward.function": "math_verify"}) == [1.0, 1.0, 1.0, 1.0]


def test_strict_box_verify_with_a_reward_that_has_no_box_mode_is_a_config_error():
    cfg = load_config("configs/tiny_cpu.yaml", ["reward.strict_box_verify=true"])  # auto -> arithmetic here
    with pytest.raises(ConfigError, match=r"reward.strict_box_verify.*'arithmetic'.*\['math_dapo', 'math_dapo_plus'\]"):
        build_reward_manager(cfg)


def test_make_reward_fn_binds_the_option_by_keyword():
    bound = make_reward_fn("math_dapo", strict_box_verify=True)
    assert isinstance(bound, functools.partial) and bound.func is math_dapo.compute_score
    assert bound.keywords == {"strict_box_verify": True}
    assert make_reward_fn("math_verify") is get_reward_fn("math_verify") is math_verify.compute_score


def test_math_verify_in_worker_processes_with_a_timeout_equals_inline():
    """The worker pool (reward.timeout_s > 0) runs Math-Verify in each worker's main thread, where its
    SIGALRM timeouts work; the scores are the inline ones."""
    inline = RewardManager(math_verify.compute_score, max_response_length=8, timeout_s=0)
    pooled = RewardManager(math_verify.compute_score, max_response_length=8, timeout_s=30.0, num_workers=2)
    with inline, pooled:
        a = inline.score(RESPONSES, TRUTHS, [1] * 4)
        b = pooled.score(RESPONSES, TRUTHS, [1] * 4)
    assert a.score.tolist() == b.score.tolist() == [1.0, 1.0, 1.0, 1.0]
    assert a.extra["pred"] == b.extra["pred"] and b.num_errors == 0


@pytest.mark.parametrize(
    "response,truth,score",
    [
        pytest.param("$\\boxed{0.5}$", "\\frac{1}{2}", 1.0, id="decimal_equals_fraction"),
        pytest.param("We get $x = 5$", "5", 1.0, id="equation_gives_its_value"),
        pytest.param("$\\boxed{\\{2, 1\\}}$", "\\{1,2\\}", 1.0, id="sets_compare_unordered"),
        pytest.param("$\\boxed{8}$", "7", 0.0, id="wrong"),
        pytest.param("no answer at all", "7", 0.0, id="nothing_extracted"),
    ],
)
def test_math_verify_by_hand(response, truth, score):
    result = math_verify.compute_score(response, truth)
    assert result["score"] == score and result["acc"] is (score == 1.0)
    assert result["pred"] is None or isinstance(result["pred"], str)


def test_math_verify_rejects_a_ground_truth_of_another_type():
    with pytest.raises(TypeError, match="ground_truth"):
        math_verify.compute_score("$\\boxed{1}$", 1.5)


def test_math_verify_missing_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(math_verify, "_IMPORT_ERROR", ImportError("No module named 'math_verify'"))
    with pytest.raises(ImportError, match=r"reward.function=math_verify needs the math-verify package.*make install"):
        math_verify.compute_score("$\\boxed{1}$", "1")
