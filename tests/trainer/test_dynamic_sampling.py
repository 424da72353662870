"""DAPO dynamic sampling across generation batches (GroupBuffer)."""

import pytest
import torch

from megatron_dapo.rollout.ragged import to_dense
from megatron_dapo.trainer.dynamic_sampling import DynamicSamplingExhausted, GroupBuffer
from tests.trainer._batches import scored


def buf(**kw):
    args = dict(enable=True, metric="acc", max_num_gen_batches=3, on_exhausted="raise", train_batch_size=2, n=2,
                ppo_mini_batch_size=1, pad_id=0)
    args.update(kw)
    return GroupBuffer(**args)


def test_constant_groups_are_dropped_and_kept_groups_accumulate_across_batches():
    b = buf()
    b.add(scored({"a": [1, 1], "b": [0, 1], "c": [0, 0]}))  # only b is informative
    assert b.num_prompts == 1 and not b.ready() and b.check_budget()
    b.add(scored({"d": [1, 0], "e": [1, 0]}))
    assert b.ready()
    batch, m = b.take()
    assert batch.rollout.index == ["b", "b", "d", "d"]  # trimmed to train_batch_size * n, first-seen order
    assert m["train/num_gen_batches"] == 2.0 and m["train/num_kept_prompts"] == 3.0
    assert m["train/num_dropped_groups"] == 2.0
    assert b.num_gen_batches == 0 and b.num_prompts == 0  # reset for the next step


def test_metric_seq_reward_uses_the_shaped_reward():
    b = buf(metric="seq_reward")
    b.add(scored({"a": [1, 1], "b": [0, 1]}))
    assert b.num_prompts == 1


def test_past_max_num_gen_batches_raises_a_named_error():
    b = buf(max_num_gen_batches=2)
    b.add(scored({"a": [1, 1]}))
    assert b.check_budget()
    b.add(scored({"b": [0, 0]}))
    with pytest.raises(DynamicSamplingExhausted, match="max_num_gen_batches=2"):
        b.check_budget()


def test_non_positive_max_means_no_limit():
    b = buf(max_num_gen_batches=0)
    for _ in range(50):
        b.add(scored({"a": [1, 1]}))
        assert b.check_budget()


def test_the_embedded_default_generates_3x_the_recipes_batches_before_it_stops():
    """configs/tiny_cpu.yaml allows 30 generation batches a step (a late seed-1 step once kept 41 of 64
    prompts after the recipe's 10 and stopped the run), and still stops a step that can never fill."""
    from megatron_dapo.config import load_config

    fg = load_config("configs/tiny_cpu.yaml").algorithm.filter_groups
    b = buf(max_num_gen_batches=fg.max_num_gen_batches, on_exhausted=fg.on_exhausted)
    for i in range(29):
        b.add(scored({f"c{i}": [1, 1]}))
        assert b.check_budget()
    b.add(scored({"x": [0, 1]}))
    assert b.num_prompts == 1 and b.num_gen_batches == 30
    with pytest.raises(DynamicSamplingExhausted, match="kept 1 of the 2 prompts needed after 30 generation batches"):
        b.check_budget()


def test_train_on_available_rounds_down_to_whole_mini_batches():
    b = buf(on_exhausted="train_on_available", max_num_gen_batches=1, train_batch_size=4, ppo_mini_batch_size=2)
    b.add(scored({"a": [1, 0], "b": [0, 1], "c": [1, 0], "d": [1, 1]}))  # 3 informative
    assert not b.ready() and not b.check_budget()
    batch, m = b.take()
    assert batch.rollout.index == ["a", "a", "b", "b"] and m["train/num_train_prompts"] == 2.0


def test_filtering_off_passes_the_batch_through():
    b = buf(enable=False)
    b.add(scored({"a": [1, 1], "b": [0, 0]}))
    assert b.ready()
    batch, _ = b.take()
    assert len(batch) == 4


def test_buffer_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    b = buf(train_batch_size=3)
    b.add(scored({"a": [1, 0], "b": [1, 1]}))
    b.add(scored({"c": [0, 1]}))
    torch.save(b.state_dict(), tmp_path / "s.pt")
    restored = buf(train_batch_size=3)
    restored.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert (restored.num_gen_batches, restored.num_prompts) == (2, 2)
    for x in (b, restored):
        x.add(scored({"d": [0, 1]}))
    (b1, _), (b2, _) = b.take(), restored.take()
    assert b1.rollout.index == b2.rollout.index == ["a", "a", "c", "c", "d", "d"]
    r1, r2 = to_dense(b1.rollout), to_dense(b2.rollout)
    assert torch.equal(r1.responses, r2.responses) and b1.extra == b2.extra


def test_aborted_responses_do_not_make_a_group_informative():
    """Three correct answers and one abort: the finished responses agree, so the group carries no
    signal and is dropped (the abort's score is not an answer); a group of only aborts is dropped too."""
    b = buf(train_batch_size=1, n=4)
    b.add(scored({"a": [1, 1, 1, 0], "b": [0, 0, 1, 1], "c": [0, 1, 0, 1]},
                 aborted=frozenset({("a", 3), ("c", 0), ("c", 1), ("c", 2), ("c", 3)})))
    batch, m = b.take()
    assert batch.rollout.index == ["b"] * 4 and m["train/num_dropped_groups"] == 2.0


def test_inflight_parts_are_written_once_ragged_and_restore_the_buffer(tmp_path):
    """Each generation batch's kept groups go to disk once (a later save writes only the new part and the
    counters), as real tokens only (the file does not grow with max_response_length), and load back into
    a buffer that takes the same batch."""
    from megatron_dapo.trainer import checkpoint as ckpt

    b = buf(train_batch_size=3)
    b.add(scored({"a": [1, 0], "b": [1, 1]}, T=4096))
    ckpt.save_inflight(str(tmp_path), {"step": 5, "buffer": b.counters()}, b.parts(0), first=0)
    part0 = tmp_path / ckpt.INFLIGHT / "part_0.pt"
    before = part0.stat()
    assert before.st_size < 8192  # 2 rows x 4096 wide as dense int64 + fp32 would be 48 KiB
    b.add(scored({"c": [0, 1]}, T=4096))
    ckpt.save_inflight(str(tmp_path), {"step": 5, "buffer": b.counters()}, b.parts(1), first=1)
    after = part0.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not rewritten
    state, parts = ckpt.load_inflight(str(tmp_path))
    assert state["step"] == 5 and state["num_parts"] == 2 and len(parts) == 2
    restored = buf(train_batch_size=3)
    restored.load_state_dict({**state["buffer"], "kept": parts})
    for x in (b, restored):
        x.add(scored({"d": [0, 1]}, T=4096))
    (b1, m1), (b2, m2) = b.take(), restored.take()
    assert b1.rollout.index == b2.rollout.index == ["a", "a", "c", "c", "d", "d"] and m1 == m2
    r1, r2 = to_dense(b1.rollout), to_dense(b2.rollout)
    for name in ("responses", "rollout_log_probs", "response_mask", "response_length", "prompt_ids"):
        assert torch.equal(getattr(r1, name), getattr(r2, name)), name
    # a new step starts from a clean directory: the old step's parts are gone
    ckpt.save_inflight(str(tmp_path), {"step": 6, "buffer": buf().counters()}, [], first=0)
    assert not part0.exists() and ckpt.load_inflight(str(tmp_path))[0]["num_parts"] == 0
