"""RewardManager: overlong shaping, failure handling in both modes, timeouts, the worker pool."""

import functools
import logging
import math
import os
import sys
import time
import types

import pytest
import torch

from megatron_dapo.rewards import (
    RewardError,
    RewardManager,
    arithmetic,
    get_reward_fn,
    math_dapo,
    register_reward_fn,
)

# Reward functions used by the tests. They live at module level so worker processes can import them.


def exact_match(solution, ground_truth):
    return {
        "score": 1.0 if solution == ground_truth else -1.0,
        "acc": solution == ground_truth,
        "pred": solution,
    }


def faulty(solution, ground_truth):
    """Behaves according to the response text, so one batch can mix good and failing rows."""
    if solution == "raise":
        raise ValueError("boom")
    if solution == "nan":
        return {"score": math.nan}
    if solution == "nokey":
        return {"acc": True}
    if solution == "notdict":
        return 3.0
    if solution == "hang":
        time.sleep(60)
    if solution == "die":
        os._exit(3)
    return exact_match(solution, ground_truth)


def worker_pid(solution, ground_truth):
    return {"score": 0.0, "pred": os.getpid()}


def score_only(solution, ground_truth):
    return {"score": 0.5}


@pytest.fixture
def make_manager():
    """Build managers that are closed at the end of the test (worker processes never leak)."""
    managers = []

    def make(score_fn, **kwargs):
        kwargs.setdefault("max_response_length", 16)
        manager = RewardManager(score_fn, **kwargs)
        managers.append(manager)
        return manager

    yield make
    for manager in managers:
        manager.close()


INLINE_AND_WORKERS = pytest.mark.parametrize("timeout_s", [0.0, 5.0], ids=["inline", "workers"])


@INLINE_AND_WORKERS
def test_reward_equals_score_when_overlong_shaping_is_off(make_manager, timeout_s):
    manager = make_manager(exact_match, timeout_s=timeout_s)
    out = manager.score(["1", "2", "3"], ["1", "x", "3"], [5, 15, 16])
    assert out.reward.dtype == torch.float32 and out.reward.shape == (3,)
    torch.testing.assert_close(out.score, torch.tensor([1.0, -1.0, 1.0]))
    torch.testing.assert_close(out.reward, out.score)
    assert out.extra["overlong_reward"] == [0.0, 0.0, 0.0]
    assert out.extra["overlong"] == [False, False, True]  # only the row that reached 16 tokens
    assert out.num_errors == 0 and out.error_messages == []


def test_overlong_penalty_is_the_closed_form(make_manager):
    # max 20, buffer 8, factor 0.5: no penalty up to 12 tokens, then -(L - 12) / 8 * 0.5.
    manager = make_manager(
        exact_match,
        max_response_length=20,
        overlong_buffer_enable=True,
        overlong_buffer_len=8,
        overlong_penalty_factor=0.5,
        timeout_s=0,
    )
    lengths = torch.tensor([0, 12, 13, 16, 20])
    out = manager.score(["a", "a", "b", "a", "a"], ["a"] * 5, lengths)
    expected_penalty = torch.tensor([0.0, 0.0, -0.0625, -0.25, -0.5])
    torch.testing.assert_close(torch.tensor(out.extra["overlong_reward"]), expected_penalty)
    torch.testing.assert_close(out.score, torch.tensor([1.0, 1.0, -1.0, 1.0, 1.0]))
    torch.testing.assert_close(out.reward, out.score + expected_penalty)
    assert out.extra["overlong"] == [False, False, False, False, True]


def test_extra_holds_one_entry_per_row_for_every_key(make_manager):
    manager = make_manager(get_reward_fn("arithmetic"), timeout_s=0)
    out = manager.score(["19", "7", "x"], ["19", "8", "1"], [2, 1, 1], data_sources=["arith", "arith", "b"])
    assert set(out.extra) == {"score", "acc", "pred", "overlong_reward", "overlong", "error", "data_source",
                              "reward_extra"}
    assert all(len(values) == 3 for values in out.extra.values())
    assert out.extra["reward_extra"] == [{}, {}, {}]
    assert out.extra["score"] == [1.0, 0.0, 0.0]
    assert out.extra["acc"] == [True, False, False]
    assert out.extra["pred"] == ["19", "7", "[INVALID]"]
    assert out.extra["data_source"] == ["arith", "arith", "b"]


def test_acc_defaults_to_positive_score_when_the_function_omits_it(make_manager):
    out = make_manager(score_only, timeout_s=0).score(["a"], ["b"], [1])
    assert out.extra["acc"] == [True] and out.extra["pred"] == [None]


FAILURES = [
    pytest.param("raise", "raised ValueError: boom", id="exception"),
    pytest.param("nan", "non-finite score nan", id="nan"),
    pytest.param("nokey", "without a 'score' key", id="missing_score"),
    pytest.param("notdict", "returned float", id="not_a_dict"),
]


@INLINE_AND_WORKERS
@pytest.mark.parametrize("bad_response,what", FAILURES)
def test_failure_raises_naming_row_and_ground_truth(make_manager, timeout_s, bad_response, what):
    manager = make_manager(faulty, timeout_s=timeout_s, on_error="raise")
    with pytest.raises(RewardError) as info:
        manager.score(["ok", bad_response, "ok"], ["ok", "gt-1", "ok"], [1, 1, 1])
    message = str(info.value)
    assert "row 1" in message and "'gt-1'" in message and what in message


@INLINE_AND_WORKERS
@pytest.mark.parametrize("bad_response,what", FAILURES)
def test_failure_is_penalised_counted_and_logged(make_manager, caplog, timeout_s, bad_response, what):
    manager = make_manager(faulty, timeout_s=timeout_s, on_error="penalize", error_score=-3.0)
    with caplog.at_level(logging.WARNING, logger="megatron_dapo.rewards.manager"):
        out = manager.score(["ok", bad_response, "ok"], ["ok", "gt-1", "ok"], [1, 1, 1])
    torch.testing.assert_close(out.score, torch.tensor([1.0, -3.0, 1.0]))
    torch.testing.assert_close(out.reward, torch.tensor([1.0, -3.0, 1.0]))
    assert out.num_errors == 1
    assert out.extra["error"] == [False, True, False]
    assert out.extra["acc"] == [True, False, True]
    assert len(out.error_messages) == 1 and "row 1" in out.error_messages[0] and what in out.error_messages[0]
    assert "row 1" in caplog.text and what in caplog.text


def test_default_error_score_is_minus_one(make_manager):
    out = make_manager(faulty, timeout_s=0, on_error="penalize").score(["raise"], ["x"], [1])
    assert out.score.tolist() == [-1.0]


def test_hanging_call_is_penalised_after_the_timeout_and_the_pool_recovers(make_manager):
    manager = make_manager(faulty, timeout_s=0.5, on_error="penalize")
    manager.score(["ok"], ["ok"], [1])  # start the pool outside the timed region
    start = time.monotonic()
    out = manager.score(["ok", "hang", "ok"], ["ok", "ok", "ok"], [1, 1, 1])
    elapsed = time.monotonic() - start
    # The hanging call sleeps 60 s: finishing in well under that proves it was cut at the timeout, on any
    # machine speed (no tighter wall-clock bound: a slow or loaded CI machine must not fail this).
    assert elapsed < 30.0, f"a hanging call stalled the batch for {elapsed:.1f} s"
    assert out.score.tolist() == [1.0, -1.0, 1.0]  # the row after the hang ran on a fresh worker
    assert out.num_errors == 1 and "timed out after 0.5 s" in out.error_messages[0]


def test_hanging_call_raises_quickly_in_raise_mode_and_next_batch_works(make_manager):
    manager = make_manager(faulty, timeout_s=0.5, on_error="raise", num_workers=2)
    manager.score(["ok"], ["ok"], [1])
    start = time.monotonic()
    with pytest.raises(RewardError, match="row 1 .*timed out"):
        manager.score(["ok", "hang", "hang"], ["ok", "ok", "ok"], [1, 1, 1])
    assert time.monotonic() - start < 3.0
    assert manager.score(["ok", "ok"], ["ok", "ok"], [1, 1]).score.tolist() == [1.0, 1.0]


def test_rows_queued_behind_a_hang_or_a_death_are_scored_once_each(make_manager):
    """Rows are sent ahead to each worker (up to a window); the ones behind a call that hangs or kills its
    worker never started, so they go to a fresh worker: every row gets exactly its own outcome."""
    manager = make_manager(faulty, timeout_s=0.5, on_error="penalize", num_workers=2)
    responses = [str(i) for i in range(200)]
    responses[7], responses[150], responses[90] = "hang", "hang", "die"
    out = manager.score(responses, [str(i) for i in range(200)], [1] * 200)
    expected = [1.0] * 200
    expected[7] = expected[150] = expected[90] = -1.0
    assert out.score.tolist() == expected and out.num_errors == 3
    assert out.extra["pred"][:7] == [str(i) for i in range(7)] and out.extra["pred"][151:] == responses[151:]


def test_long_responses_never_block_the_pipe(make_manager):
    """20k-character responses: the bytes sent ahead stay within the window, so a send never blocks while
    a worker hangs (the timeout still fires)."""
    manager = make_manager(faulty, timeout_s=0.5, on_error="penalize")
    long = ["x" * 20000 + str(i) for i in range(40)]
    long[3] = "hang"
    start = time.monotonic()
    out = manager.score(long, list(long), [1] * 40)
    assert time.monotonic() - start < 30.0
    assert out.score.tolist() == [1.0] * 3 + [-1.0] + [1.0] * 36


def test_worker_that_dies_is_penalised_and_replaced(make_manager):
    manager = make_manager(faulty, timeout_s=5.0, on_error="penalize")
    out = manager.score(["die", "ok"], ["ok", "ok"], [1, 1])
    assert out.score.tolist() == [-1.0, 1.0]
    assert "killed its worker process (exit code 3)" in out.error_messages[0]


def test_worker_pool_persists_across_calls(make_manager):
    manager = make_manager(worker_pid, timeout_s=5.0)
    first = manager.score(["a"], ["a"], [1]).extra["pred"]
    second = manager.score(["a", "b"], ["a", "b"], [1, 1]).extra["pred"]
    assert first[0] != os.getpid()  # ran in a worker, not inline
    assert set(second) == set(first)  # the same single worker served both calls


def test_inline_mode_runs_in_this_process(make_manager):
    assert make_manager(worker_pid, timeout_s=0).score(["a"], ["a"], [1]).extra["pred"] == [os.getpid()]


def test_partial_of_module_function_runs_in_workers(make_manager):
    strict = functools.partial(math_dapo.compute_score, strict_box_verify=True)
    out = make_manager(strict, timeout_s=5.0).score(["Answer: 3", "\\boxed{3}"], ["3", "3"], [4, 4])
    assert out.score.tolist() == [-1.0, 1.0]


def test_unpicklable_function_is_rejected_for_workers_but_fine_inline(make_manager):
    with pytest.raises(TypeError, match="module-level function"):
        make_manager(lambda s, g: {"score": 0.0}, timeout_s=1.0)
    out = make_manager(lambda s, g: {"score": 0.25}, timeout_s=0).score(["a"], ["b"], [1])
    assert out.score.tolist() == [0.25]


def test_close_stops_workers_and_forbids_scoring():
    with RewardManager(worker_pid, max_response_length=4, timeout_s=5.0) as manager:
        manager.score(["a"], ["a"], [1])
        processes = [worker.process for worker in manager._workers if worker is not None]
        assert processes and all(process.is_alive() for process in processes)
    assert not any(process.is_alive() for process in processes)
    with pytest.raises(RuntimeError, match="after close"):
        manager.score(["a"], ["a"], [1])


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        ({"on_error": "ignore"}, "on_error"),
        ({"overlong_buffer_enable": True, "overlong_buffer_len": 0}, "overlong_buffer_len"),
        ({"overlong_buffer_enable": True, "overlong_buffer_len": 17}, "overlong_buffer_len"),
        ({"overlong_penalty_factor": -1.0}, "overlong_penalty_factor"),
        ({"max_response_length": 0}, "max_response_length"),
        ({"num_workers": 0}, "num_workers"),
        ({"error_score": math.nan}, "error_score"),
        ({"start_method": "thread"}, "start_method"),
    ],
)
def test_constructor_rejects_bad_arguments_by_name(kwargs, argument):
    kwargs = {"max_response_length": 16, "timeout_s": 0, **kwargs}
    with pytest.raises(ValueError, match=argument):
        RewardManager(exact_match, **kwargs)


def test_buffer_length_is_not_checked_when_shaping_is_off():
    RewardManager(exact_match, max_response_length=16, overlong_buffer_len=0, timeout_s=0)


@pytest.mark.parametrize(
    "lengths,match",
    [
        ([1, 17], r"response_lengths\[1\] = 17 is outside \[0, max_response_length=16\]"),
        ([1, -1], r"response_lengths\[1\] = -1"),
        ([1], "response_lengths has 1 entries"),
        (torch.tensor([1.0, 2.0]), "integer tensor"),
    ],
)
def test_bad_response_lengths_are_rejected(make_manager, lengths, match):
    with pytest.raises(ValueError, match=match):
        make_manager(exact_match, timeout_s=0).score(["a", "b"], ["a", "b"], lengths)


def test_registry_resolves_names_and_lists_them_on_a_miss():
    assert get_reward_fn("math_dapo") is math_dapo.compute_score
    assert get_reward_fn("arithmetic") is arithmetic.compute_score
    with pytest.raises(
        ValueError, match=r"unknown reward function 'gsm8k'; known: \['arithmetic', 'math_dapo', 'math_dapo_plus', 'math_verify'\]"
    ):
        get_reward_fn("gsm8k")
    with pytest.raises(ValueError, match="already registered"):
        register_reward_fn("math_dapo")(exact_match)


def test_fork_start_method_gives_the_same_scores(make_manager):
    responses, truths = ["ok", "raise", "x"], ["ok", "ok", "y"]
    forked = make_manager(faulty, timeout_s=5.0, on_error="penalize", start_method="fork")
    inline = make_manager(faulty, timeout_s=0, on_error="penalize")
    assert forked.score(responses, truths, [1, 1, 1]).score.tolist() == [1.0, -1.0, -1.0]
    assert inline.score(responses, truths, [1, 1, 1]).score.tolist() == [1.0, -1.0, -1.0]


def test_function_the_worker_cannot_import_fails_at_start_up(make_manager, monkeypatch):
    # Picklable here (by reference to a module that exists only in this process), but a worker
    # cannot import that module: start-up must fail with a clear error instead of hanging.
    module = types.ModuleType("megatron_dapo_test_ephemeral")
    exec("def score(s, g):\n    return {'score': 1.0}\n", module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    manager = make_manager(module.score, timeout_s=5.0)
    with pytest.raises(RuntimeError, match=r"exited during start-up \(exit code 1\)"):
        manager.score(["a"], ["a"], [1])
    assert manager._workers == [None]


def with_extra_info(solution, ground_truth):
    import numpy as np

    right = solution == ground_truth
    return {"score": float(right), "acc": right, "format_ok": solution.isdigit(), "n_chars": np.int64(len(solution)),
            "note": "free text", "digits": [c for c in solution if c.isdigit()]}


@INLINE_AND_WORKERS
def test_a_dicts_other_keys_are_kept_per_row_as_plain_values(make_manager, timeout_s):
    out = make_manager(with_extra_info, timeout_s=timeout_s).score(["12", "x"], ["12", "3"], [2, 1])
    assert out.extra["reward_extra"] == [{"format_ok": True, "n_chars": 2, "note": "free text", "digits": "['1', '2']"},
                                         {"format_ok": False, "n_chars": 1, "note": "free text", "digits": "[]"}]
    assert type(out.extra["reward_extra"][0]["n_chars"]) is int
    from megatron_dapo.metrics import reward_extra_metrics

    assert reward_extra_metrics(out.extra["reward_extra"]) == {"reward_extra/format_ok/mean": 0.5,
                                                               "reward_extra/n_chars/mean": 1.5}
