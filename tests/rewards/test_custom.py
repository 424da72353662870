"""reward.custom_function: a reward of the user's own from a Python file, with verl's signature, run inline
and in the reward workers, through the config and the trainer's build, with the same named errors."""

import os
import pathlib
import textwrap

import pytest

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.rewards import RewardError, RewardManager
from megatron_dapo.rewards.build import build_reward_manager
from megatron_dapo.rewards.custom import CustomRewardError, CustomRewardFn

ROOT = pathlib.Path(__file__).resolve().parents[2]

# verl's signature, called by keyword; it reads every argument, so a row's score shows what reached it.
SOURCE = textwrap.dedent('''
    import math

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        right = solution_str.strip() == str(ground_truth)
        bonus = extra_info.get("bonus", 0.0) if extra_info else 0.0
        if data_source == "as-dict":
            return {"score": (1.0 if right else 0.0) + bonus, "acc": right, "pred": solution_str.strip(),
                    "len": len(solution_str)}
        if data_source == "as-bool":
            return right
        if solution_str == "raise":
            raise ZeroDivisionError("custom boom")
        if solution_str == "nan":
            return math.nan
        return (1.0 if right else -1.0) + bonus

    def helper():
        return None
''')


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(SOURCE)
    return path


@pytest.mark.parametrize("timeout_s", [0, 5.0], ids=["inline", "workers"])
def test_the_function_gets_each_rows_data_source_and_extra_info(reward_file, timeout_s):
    with RewardManager(CustomRewardFn(str(reward_file)), max_response_length=16, timeout_s=timeout_s,
                       num_workers=2) as manager:
        out = manager.score(["7", "8", " 5 ", "4"], ["7", "7", "5", "5"], [1, 1, 3, 1],
                            data_sources=["math", "math", "as-dict", "as-dict"],
                            extra_infos=[{"bonus": 0.5}, {}, {"bonus": 0.25}, {"index": 3}])
    assert out.score.tolist() == [1.5, -1.0, 1.25, 0.0]
    assert out.extra["acc"] == [True, False, True, False]  # a float's acc is score > 0, as for the built-ins
    assert out.extra["pred"] == [None, None, "5", "4"]
    assert out.extra["reward_extra"] == [{}, {}, {"len": 3}, {"len": 1}]  # verl's reward_extra_info, per row


@pytest.mark.parametrize("timeout_s", [0, 5.0], ids=["inline", "workers"])
def test_a_bool_is_right_or_wrong(reward_file, timeout_s):
    with RewardManager(CustomRewardFn(str(reward_file)), max_response_length=16, timeout_s=timeout_s) as manager:
        out = manager.score(["7", "8"], ["7", "7"], [1, 1], data_sources=["as-bool"] * 2, extra_infos=[{}, {}])
    assert out.score.tolist() == [1.0, 0.0] and out.extra["acc"] == [True, False]


@pytest.mark.parametrize("timeout_s", [0, 5.0], ids=["inline", "workers"])
def test_its_failures_are_named_like_a_built_in_functions(reward_file, timeout_s):
    with RewardManager(CustomRewardFn(str(reward_file)), max_response_length=16, timeout_s=timeout_s) as manager:
        with pytest.raises(RewardError, match=r"row 1 \(ground truth '2'\).*raised ZeroDivisionError: custom boom"):
            manager.score(["1", "raise"], ["1", "2"], [1, 1], data_sources=["m", "m"], extra_infos=[{}, {}])
        with pytest.raises(RewardError, match=r"row 0 .*non-finite score nan"):
            manager.score(["nan"], ["1"], [1], data_sources=["m"], extra_infos=[{}])


def test_a_file_that_does_not_define_the_function_or_does_not_load_is_named(tmp_path, reward_file):
    with pytest.raises(CustomRewardError, match=rf"{reward_file} defines no function 'score' \(its functions: "
                                                r"\['compute_score', 'helper'\]\)"):
        CustomRewardFn(str(reward_file), "score").load()
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(CustomRewardError, match=rf"{broken}: importing it raised ModuleNotFoundError"):
        CustomRewardFn(str(broken)).load()


def _cfg(*overrides):
    return load_config(str(ROOT / "configs/tiny_cpu.yaml"), list(overrides))


def test_the_config_builds_it_and_refuses_what_cannot_work(reward_file, tmp_path):
    manager = build_reward_manager(_cfg(f"reward.custom_function.path={reward_file}", "reward.timeout_s=0"))
    try:
        out = manager.score(["3"], ["3"], [1], data_sources=["math"], extra_infos=[{"bonus": 1.0}])
        assert out.score.tolist() == [2.0]
    finally:
        manager.close()
    with pytest.raises(ConfigError, match=r"reward.custom_function: .* defines no function 'nope'"):
        build_reward_manager(_cfg(f"reward.custom_function.path={reward_file}", "reward.custom_function.name=nope"))
    with pytest.raises(ConfigError, match=r"reward.custom_function.path: expected an existing Python file"):
        _cfg(f"reward.custom_function.path={tmp_path / 'missing.py'}")
    with pytest.raises(ConfigError, match=r"reward.function: expected auto when reward.custom_function.path is set"):
        _cfg(f"reward.custom_function.path={reward_file}", "reward.function=math_dapo")


def test_the_trainer_scores_with_it_in_its_reward_workers(tmp_path):
    """Two steps of the sync trainer on the arithmetic task with a custom function that computes the answer
    from the row's extra_info (a, op, b) instead of the ground truth: every call reached a worker with the
    row's data_source and extra_info, and the logged scores are its scores."""
    import json

    from tests.trainer.test_fit import TINY, _scalars

    seen = tmp_path / "seen.jsonl"
    path = tmp_path / "arith_reward.py"
    path.write_text(textwrap.dedent(f'''
        import json, os

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            a, b = extra_info["a"], extra_info["b"]
            answer = a + b if extra_info["op"] == "+" else a - b
            with open({str(seen)!r}, "a") as f:
                f.write(json.dumps({{"pid": os.getpid(), "data_source": data_source, "truth": ground_truth,
                                    "answer": answer}}) + "\\n")
            return 1.0 if solution_str.strip() == str(answer) else -1.0
    '''))
    from megatron_dapo.trainer.run import run

    cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"),
                      TINY + [f"trainer.output_dir={tmp_path}", "trainer.total_training_steps=2", "trainer.test_freq=0",
                              "trainer.val_before_train=false", "trainer.experiment_name=c", "reward.timeout_s=5",
                              f"reward.custom_function.path={path}"])
    assert run(cfg) == 0
    calls = [json.loads(line) for line in seen.read_text().splitlines()]
    assert len(calls) >= 2 * 4 * 4 and {c["data_source"] for c in calls} == {"arithmetic"}
    assert all(c["truth"] == str(c["answer"]) for c in calls)  # extra_info is the row's own
    assert os.getpid() not in {c["pid"] for c in calls}  # scored in the reward workers
    scores = _scalars(tmp_path / "c")["critic/score/mean"]
    assert set(scores) == {1, 2} and all(-1.0 <= v <= 1.0 for v in scores.values())
