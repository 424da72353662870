"""Streaming dynamic sampling (algorithm.filter_groups.streaming): generation stops once the step's groups are
complete, cut prompts go back to the sampler's front, and the step logs what generation cost.

Invariants: with nothing cut, streaming trains on exactly the prompts of the run without it; with cuts, every
drawn prompt is trained on or dropped once or given back and drawn next, and a resume in the middle trains on
the prompts of the uninterrupted run; the cost metrics are the hand-computed ones.
"""

import dataclasses
import json
import pathlib
from collections import Counter

import pytest
import torch

from megatron_dapo.data.sampler import ResumableSampler
from megatron_dapo.rollout.ragged import to_ragged
from megatron_dapo.trainer.dynamic_sampling import StopWhenFull, finished_groups
from megatron_dapo.trainer.run import run
from tests.trainer._batches import scored
from tests.trainer.test_dynamic_sampling import buf
from tests.trainer.test_fit import _cfg, _Crash, _scalars

FAST = ["trainer.test_freq=0", "trainer.val_before_train=false", "trainer.logger=[tensorboard]"]


def _with_lengths(batch, lengths):
    """The batch with other response lengths (the buffer reads only these and the aborted flags)."""
    return dataclasses.replace(batch, rollout=dataclasses.replace(batch.rollout,
                                                                  response_length=torch.tensor(lengths)))


def test_cost_metrics_are_the_hand_computed_ones():
    b = buf(train_batch_size=2, n=2)
    b.add(None, generated_tokens=4, cut_groups=2)  # every group of this generation batch was cut
    # a is constant (dropped), b kept; the engine also spent 8 tokens on 3 groups it cut.
    b.add(_with_lengths(scored({"a": [1, 1], "b": [0, 1]}), [4, 4, 1, 3]), generated_tokens=12 + 8, cut_groups=3)
    b.add(_with_lengths(scored({"c": [1, 0], "d": [0, 1]}), [2, 2, 4, 4]))  # c kept, d surplus
    batch, m = b.take()
    assert batch.rollout.index == ["b", "b", "c", "c"]
    assert m["train/num_gen_batches"] == 3.0 and m["train/num_cut_groups"] == 5.0
    assert m["train/kept_response_length_mean"] == (1 + 3 + 2 + 2) / 4  # 2.0
    assert m["train/finished_response_length_mean"] == (4 + 4 + 1 + 3 + 2 + 2 + 4 + 4) / 8  # 3.0
    assert m["train/gen_tokens_per_trained_token"] == (4 + 20 + 12) / 8  # 4.5
    assert b.generated_tokens == b.cut_groups == b.finished_rows == 0  # reset with the step


def test_costs_survive_the_in_flight_state():
    b = buf(train_batch_size=4, n=2)
    b.add(scored({"a": [1, 0]}), generated_tokens=9, cut_groups=1)
    other = buf(train_batch_size=4, n=2)
    other.load_state_dict(b.state_dict())
    assert (other.generated_tokens, other.cut_groups, other.finished_rows, other.finished_tokens) == (9, 1, 2, 3)


def ragged_scored(groups):
    """tests.trainer._batches.scored with the ragged rollout a group scorer returns."""
    sb = scored(groups)
    return dataclasses.replace(sb, rollout=to_ragged(sb.rollout, pad_id=0))


def test_stop_when_full_counts_informative_groups_until_the_need_is_met():
    """need 3: groups wait unscored while all of them together could not meet it (a, b; then d after one of a, b, c
    was informative). Every group it scored is kept for the reward stage, with its rows."""
    acc = {"a": [1, 1], "b": [0, 1], "c": [0, 0], "d": [1, 0], "e": [0, 1]}
    calls = []

    def score_groups(batch):
        calls.append(list(dict.fromkeys(batch.index)))
        assert batch.responses.complete and len(batch) == 2 * len(calls[-1])
        return ragged_scored({gid: acc[gid] for gid in calls[-1]})

    def group(gid):  # a ragged batch of one complete group, as the engine reports it
        return to_ragged(scored({gid: [0, 0]}).rollout, pad_id=0)

    stop = StopWhenFull(need=3, metric="acc", score_groups=score_groups)
    assert [stop(group("a")), stop(group("b")), stop(group("c")), stop(group("d")), stop(group("e"))] == \
        [False, False, False, False, True]
    assert calls == [["a", "b", "c"], ["d", "e"]] and stop.informative == 3
    for gid in "abcde":
        batch, first = stop.scored[gid]
        assert batch.rollout.index[first:first + 2] == [gid, gid] and batch.extra["acc"][first:first + 2] == acc[gid]


def test_scoring_only_scores_each_group_as_it_completes_never_stops_and_leaves_a_failed_group_unscored():
    """The sync trainer's callback on SGLang without streaming: every reported batch is scored at once; a
    reward error leaves its groups for the reward stage (which raises it on every rank)."""
    calls = []

    def score_groups(batch):
        gids = list(dict.fromkeys(batch.index))
        calls.append(gids)
        if "bad" in gids:
            raise ValueError("reward failed")
        return ragged_scored({gid: [1, 0] for gid in gids})

    def groups(*gids):
        return to_ragged(scored({g: [0, 0] for g in gids}).rollout, pad_id=0)

    stop = StopWhenFull.scoring_only(metric="acc", score_groups=score_groups)
    assert [stop(groups("a")), stop(groups("b", "c")), stop(groups("bad")), stop(groups("d"))] == [False] * 4
    assert calls == [["a"], ["b", "c"], ["bad"], ["d"]]
    assert sorted(stop.scored) == ["a", "b", "c", "d"] and stop.scored["c"][1] == 2
    kept = stop.scored["c"][0].rollout  # its values stay for the reward stage, its tokens do not
    assert kept.index == ["b", "b", "c", "c"] and not kept.responses.present.any() and kept.responses.values.numel() == 0


@pytest.mark.parametrize("need", [None, 3], ids=["scoring-only", "stop-when-full"])
def test_the_routing_of_groups_dynamic_sampling_drops_is_released_as_they_are_scored(need):
    """R3: with filter_groups on (drops_constant), a constant group's routing is set to None in the batch the
    engine reported (the engine then frees its copy, BatchGroupsDone); informative groups keep theirs, and
    with filtering off every group does. A group not scored yet (need mode, waiting) keeps its routing."""
    acc = {"a": [1, 1], "b": [0, 1], "c": [0, 0], "d": [1, 0]}

    def score_groups(batch):
        return ragged_scored({gid: acc[gid] for gid in dict.fromkeys(batch.index)})

    def group(gid):
        rollout = to_ragged(scored({gid: [0, 0]}).rollout, pad_id=0)
        routing = [torch.full((2, 3, 1), ord(gid), dtype=torch.uint8) for _ in range(2)]
        return dataclasses.replace(rollout, routed_experts=routing)

    for drops in (True, False):
        stop = StopWhenFull(need=need, metric="acc", score_groups=score_groups, drops_constant=drops)
        reported = [group(g) for g in "abcd"]
        for b in reported:
            stop(b)
        held = {b.index[0]: [r is not None for r in b.routed_experts] for b in reported}
        if not drops:
            assert all(all(v) for v in held.values())
        elif need is None:  # each group scored as it came: a and c are constant
            assert held == {"a": [False, False], "b": [True, True], "c": [False, False], "d": [True, True]}
        else:  # a, b, c scored together once they could meet the need; d waits unscored
            assert held == {"a": [False, False], "b": [True, True], "c": [False, False], "d": [True, True]}
            assert stop.pending == [reported[3]]
        assert torch.equal(reported[1].routed_experts[0], torch.full((2, 3, 1), ord("b"), dtype=torch.uint8))


def test_the_routing_of_informative_groups_past_the_ones_the_step_takes_is_released_once_they_are_known():
    """R3, keep: the step takes the first `keep` informative groups in batch order (GroupBuffer.take); a later
    informative group's routing goes as soon as `keep` informative groups before it are scored, whatever
    order the groups complete in, and never sooner."""
    acc = {"a": [1, 0], "b": [0, 0], "c": [0, 1], "d": [1, 0], "e": [0, 1]}  # b constant, the others informative
    positions = {g: i for i, g in enumerate("abcde")}

    def score_groups(batch):
        return ragged_scored({gid: acc[gid] for gid in dict.fromkeys(batch.index)})

    def group(gid):
        rollout = to_ragged(scored({gid: [0, 0]}).rollout, pad_id=0)
        return dataclasses.replace(rollout, routed_experts=[torch.full((1, 2, 1), ord(gid), dtype=torch.uint8)] * 2)

    stop = StopWhenFull.scoring_only(metric="acc", score_groups=score_groups, drops_constant=True, keep=2,
                                     positions=positions)
    reported, held = {}, []
    for gid in "debac":  # completion order
        reported[gid] = group(gid)
        stop(reported[gid])
        held.append("".join(g for g, b in sorted(reported.items()) if b.routed_experts[0] is not None))
    # d, e: two known, none before them; b constant; a: e has a, d before it; c: d has a, c before it
    assert held == ["d", "de", "de", "ad", "ac"]
    assert all(r is None for r in reported["e"].routed_experts)
    with pytest.raises(ValueError, match="keep needs the groups' positions"):
        StopWhenFull(need=None, metric="acc", score_groups=score_groups, drops_constant=True, keep=2)


def test_a_group_with_any_aborted_sample_is_cut():
    rollout = scored({"a": [1, 0], "b": [1, 0], "c": [0, 1]}, aborted=frozenset({("b", 1)})).rollout
    assert finished_groups(rollout, 2) == ([0, 2], [1])


def _trained(dump_dir: pathlib.Path, step: int) -> list[str]:
    return [json.loads(line)["group"] for line in (dump_dir / f"step_{step}.jsonl").read_text().splitlines()]


def recording_scores(monkeypatch, log: list):
    """Every row the reward stage or the stop callback scores, by group id (stages.score)."""
    from megatron_dapo.trainer import stages

    real = stages.score
    monkeypatch.setattr(stages, "score", lambda rollout, *a, **k: log.extend(rollout.index) or real(rollout, *a, **k))


def test_with_nothing_cut_streaming_trains_on_the_prompts_of_the_run_without_it(tmp_path, monkeypatch):
    """gen_batch_size = train_batch_size: the stop can only come with the last group of a generation batch.
    Each row is scored once (the reward stage reuses the callback's scores)."""
    args = [*FAST, "data.gen_batch_size=4", "trainer.total_training_steps=2", "trainer.experiment_name=s"]
    run(_cfg(tmp_path / "off", *args))
    scored_rows: list = []
    recording_scores(monkeypatch, scored_rows)
    run(_cfg(tmp_path / "on", *args, "algorithm.filter_groups.streaming=true"))
    assert set(Counter(scored_rows).values()) == {4}, "a group was scored twice (or in part)"  # rollout.n=4
    assert {g for step in (1, 2) for g in _trained(tmp_path / "on/dumps", step)} <= set(scored_rows)
    off, on = _scalars(tmp_path / "off/s"), _scalars(tmp_path / "on/s")
    assert on["train/num_cut_groups"] == {1: 0.0, 2: 0.0}, "the setting must cut nothing"
    for step in (1, 2):
        assert _trained(tmp_path / "off/dumps", step) == _trained(tmp_path / "on/dumps", step)
        assert on["actor/pg_loss"][step] == pytest.approx(off["actor/pg_loss"][step], rel=1e-6, abs=1e-9)
        assert on["train/gen_tokens_per_trained_token"][step] == off["train/gen_tokens_per_trained_token"][step]


def assert_given_back_first_and_never_repeated(log: list) -> None:
    """On a recording_sampler log: every given-back list is the head of the next draw, and what was drawn
    minus what was given back has no repeat."""
    for (kind, items), nxt in zip(log, log[1:], strict=False):
        if kind == "push" and items:
            assert nxt[0] == "next" and nxt[1][:len(items)] == items
    used = [i for kind, items in log if kind == "next" for i in items]
    for kind, items in log:
        if kind == "push":
            for i in items:
                used.remove(i)
    assert len(used) == len(set(used)), "a prompt was drawn twice without being given back"


def recording_sampler(monkeypatch, log: list):
    """Record every draw ("next", items) and give-back ("push", items) of the ResumableSampler in `log`."""
    real_next, real_push = ResumableSampler.next_batch, ResumableSampler.push_front
    monkeypatch.setattr(ResumableSampler, "next_batch", lambda self: log.append(("next", real_next(self))) or log[-1][1])
    monkeypatch.setattr(ResumableSampler, "push_front",
                        lambda self, items: log.append(("push", list(items))) or real_push(self, items))


def test_cut_prompts_come_back_first_and_a_resume_neither_loses_nor_repeats_them(tmp_path, monkeypatch):
    """gen_batch_size 8 for train_batch_size 4: generation stops once 4 informative groups are complete and cuts
    the rest. The first attempt stops right after the step-1 checkpoint, whose sampler holds the cut prompts."""
    from megatron_dapo.trainer import fit

    args = [*FAST, "data.gen_batch_size=8", "rollout.max_num_seqs=8", "trainer.total_training_steps=3", "trainer.save_freq=1",
            "trainer.experiment_name=c", "algorithm.filter_groups.streaming=true"]
    log: list = []
    recording_sampler(monkeypatch, log)
    scored_rows: list = []
    recording_scores(monkeypatch, scored_rows)
    run(_cfg(tmp_path / "a", *args))
    a = _scalars(tmp_path / "a/c")
    assert a["train/num_cut_groups"][1] > 0, "the setting must cut groups at step 1"
    assert set(Counter(scored_rows).values()) == {4}, "a group was scored twice (or in part)"
    assert_given_back_first_and_never_repeated(log)
    final = torch.load(tmp_path / "a/c/ckpt/global_step_3/trainer_state.pt", weights_only=True)["sampler"]
    assert final["front"] == [i for kind, items in log[-1:] if kind == "push" for i in items]

    real = fit.DAPOTrainer._save

    def save_then_stop(self):
        real(self)
        if self.global_step == 1:
            raise _Crash

    monkeypatch.setattr(fit.DAPOTrainer, "_save", save_then_stop)
    with pytest.raises(_Crash):
        run(_cfg(tmp_path / "b", *args))
    saved = torch.load(tmp_path / "b/c/ckpt/global_step_1/trainer_state.pt", weights_only=True)["sampler"]
    assert len(saved["front"]) == a["train/num_cut_groups"][1]
    monkeypatch.setattr(fit.DAPOTrainer, "_save", real)
    run(_cfg(tmp_path / "b", *args))
    b = _scalars(tmp_path / "b/c")
    for step in (2, 3):
        assert _trained(tmp_path / "a/dumps", step) == _trained(tmp_path / "b/dumps", step)
        for name in ("actor/pg_loss", "train/num_cut_groups", "train/gen_tokens_per_trained_token"):
            assert a[name][step] == b[name][step], (name, step)
