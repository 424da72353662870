"""Streaming dynamic sampling on real SGLang 0.5.23 servers (conftest.real_servers).

Engine: `SGLangEngine.generate_streaming` reports a group when its request returns and, once told to
stop, aborts the requests still running by rid. Greedy decoding makes every output known: a first,
plain greedy pass finds a prompt the model ends within 3 tokens and prompts it runs for 100 or more, so
after the stop on the quick group the others must come back aborted with a strict prefix of their
greedy continuation.

Trainer: 3 steps of `run` with streaming against both servers, generation batches of 12 groups for steps
of 2 (an overlong buffer of 32 of the 40 response tokens makes most groups informative, so the stop
comes while groups still run): cut prompts come back at the sampler's front and nothing is drawn twice, every complete group is
scored once, and the actor's log-probs equal the servers' to round-off.
"""

from __future__ import annotations

import random
import re
from collections import Counter

from megatron_dapo.rollout.base import PromptInput, SamplingParams
from megatron_dapo.rollout.sglang.engine import SGLangEngine

LONG = 300
"""max_new_tokens of the engine test: server 1 (no --context-length) generates prompt + 300 in full."""
CANDIDATES = [PromptInput(f"c{i}", tuple([1] + [random.Random(i).randrange(3, 18) for _ in range(3 + i % 8)]))
              for i in range(40)]
EOS = 2


def _choose(greedy: dict[str, list[int]]) -> tuple[str, list[str]]:
    """(quick prompt, long prompts): greedy decoding ends the quick one with EOS within 3 tokens and runs
    each long one (at most 4) for at least 100."""
    quick = [pid for pid, toks in greedy.items() if len(toks) <= 3 and toks[-1] == EOS]
    long = [pid for pid, toks in greedy.items() if len(toks) >= 100][:4]
    assert quick and long, f"no quick or no long prompt among the greedy continuations {greedy}"
    return quick[0], long


def test_streaming_reports_complete_groups_and_aborts_the_running_ones_by_rid(real_servers):
    server = real_servers.servers[1]
    with SGLangEngine([server.url]) as engine:
        # The model's own weights: earlier tests of the session pushed trained ones, whose greedy answers
        # may all be short.
        engine.update_weights_from_disk(real_servers.model_dir, policy_version=0)
        plain = engine.generate(CANDIDATES, SamplingParams(max_new_tokens=LONG, temperature=0.0))
        greedy = {s.prompt_id: list(s.response_token_ids) for s in plain}
        quick, long = _choose(greedy)
        by_id = {p.prompt_id: p for p in CANDIDATES}
        reported: list[list[str]] = []

        def on_groups_done(groups):
            reported.append([g[0].prompt_id for g in groups])
            return True

        mark = len(server.log_path.read_text(errors="replace"))
        out = engine.generate_streaming([by_id[quick], *(by_id[p] for p in long)],
                                        SamplingParams(max_new_tokens=LONG, n=2, temperature=0.0),
                                        on_groups_done=on_groups_done)
    assert reported == [[quick]]
    assert [(s.prompt_id, s.sample_index) for s in out] == [(p, j) for p in [quick, *long] for j in range(2)]
    for s in out:
        want = greedy[s.prompt_id]
        if s.prompt_id == quick:
            assert (s.finish_reason, list(s.response_token_ids)) == ("stop", want)
        else:  # stopped 3 tokens into a 100+ token answer
            assert s.finish_reason == "abort" and len(s.response_token_ids) < len(want), s
            assert list(s.response_token_ids) == want[:len(s.response_token_ids)]
            assert len(s.rollout_log_probs) == len(s.response_token_ids)
    aborts = re.findall(r'"POST /abort_request HTTP', server.log_path.read_text(errors="replace")[mark:])
    assert len(aborts) >= 2 * len(long), "one /abort_request per running rid"


def test_streaming_trainer_on_real_servers_loses_and_repeats_nothing(real_servers, tmp_path, monkeypatch):
    from megatron_dapo.config import load_config
    from megatron_dapo.trainer.run import run
    from tests.sglang_real.test_train import MEAN_DIFF_TOL, _scalars, train_overrides
    from tests.trainer.test_streaming import (
        assert_given_back_first_and_never_repeated,
        recording_sampler,
        recording_scores,
    )

    draws: list = []
    recording_sampler(monkeypatch, draws)
    scored_rows: list = []
    recording_scores(monkeypatch, scored_rows)
    overrides = train_overrides(real_servers.model_dir, real_servers.tokenizer_dir,
                                f"rollout.sglang_urls=[{','.join(real_servers.urls)}]", "rollout.mode=disaggregate",
                                f"trainer.output_dir={tmp_path}", "algorithm.filter_groups.enable=true",
                                "algorithm.filter_groups.metric=seq_reward", "algorithm.filter_groups.streaming=true",
                                "data.gen_batch_size=12", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
                                "algorithm.filter_groups.max_num_gen_batches=0", "reward.overlong_buffer.len=32",
                                # one group request in flight per server: the groups not sent yet when the
                                # step has its groups are cut whatever the machine's load (with every request
                                # in flight at once, a loaded machine could see them all finish first)
                                "rollout.max_concurrency=1")
    assert run(load_config("configs/tiny_cpu.yaml", overrides)) == 0
    scalars = _scalars(tmp_path)
    assert all(d < MEAN_DIFF_TOL for d in scalars["rollout_corr/log_prob_abs_diff"].values())
    cut = scalars["train/num_cut_groups"]
    assert sorted(cut) == [1, 2, 3] and sum(cut.values()) > 0, cut
    assert_given_back_first_and_never_repeated(draws)
    assert set(Counter(scored_rows).values()) == {4}, "a group was scored twice (or in part)"
