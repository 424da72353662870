"""The queue trainer: producer claims and atomic group writes, partial rollouts, weight publishing,
queue recovery rules, sync mode == the sync trainer, stage I/O through the queue, parameter_sync_step,
and the async mode with a producer process."""

import dataclasses
import json
import pathlib
import threading

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_dapo.config import load_config
from megatron_dapo.queue import TransferQueue, parse_key
from megatron_dapo.rollout.base import RolloutEngine, Sample, SamplingParams, check_generate_inputs
from megatron_dapo.trainer.producer import (
    Producer,
    WeightStore,
    key_safe_uid,
    prompt_key,
    reissue_claims,
)
from megatron_dapo.trainer.queue_trainer import (
    TRAIN,
    discard_after,
    rollback_after,
)
from megatron_dapo.trainer.run import build_trainer, run

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ["data.train_batch_size=4", "data.gen_batch_size=6", "rollout.n=4", "actor.ppo_mini_batch_size=2",
        "data.max_response_length=6", "reward.overlong_buffer.len=4", "algorithm.filter_groups.metric=seq_reward",
        "data.arithmetic.num_train=200", "data.arithmetic.num_val=8", "trainer.sft_warmup_steps=0",
        "trainer.test_freq=0", "trainer.val_before_train=false", "actor.lr=1e-3", "trainer.logger=[tensorboard]"]


def _cfg(tmp_path, *extra):
    return load_config(str(ROOT / "configs/tiny_cpu.yaml"),
                       TINY + [f"trainer.output_dir={tmp_path}", f"trainer.rollout_data_dir={tmp_path}/dumps",
                               "trainer.experiment_name=q", *extra])


def _scalars(run_dir: pathlib.Path) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _dump_groups(dump_dir: pathlib.Path, step: int) -> list[str]:
    return [json.loads(line)["group"] for line in (dump_dir / f"step_{step}.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------- a scripted engine


class ScriptedEngine(RolloutEngine):
    """A deterministic engine for the producer's bookkeeping: sample j of a prompt is `length` tokens
    100*version + 10 + j, t (t = 0, 1, ...) with log-prob -(version + 1)/10 each, so every token shows
    the weights that produced it. `abort_first=True`: the first call waits for abort() and returns two
    tokens per sample with finish_reason "abort". `on_generate` runs inside each call."""

    def __init__(self, *, length=4, abort_first=False, on_generate=None):
        self.length, self.abort_first, self.on_generate = length, abort_first, on_generate
        self._version, self._abort = 0, threading.Event()
        self.calls: list[tuple[list[str], list[tuple[int, ...]], SamplingParams]] = []

    def generate(self, prompts, sampling):
        check_generate_inputs(prompts, sampling)
        self.calls.append(([p.prompt_id for p in prompts], [p.token_ids for p in prompts], sampling))
        if self.on_generate is not None:
            self.on_generate()
        aborted = False
        if self.abort_first:
            self.abort_first = False
            aborted = self._abort.wait(10.0)
            assert aborted, "the partial-rollout watcher never aborted the call"
        out = []
        for p in prompts:
            for j in range(sampling.n):
                L = 2 if aborted else min(self.length, sampling.max_new_tokens)
                out.append(Sample(prompt_id=p.prompt_id, sample_index=j, prompt_token_ids=p.token_ids,
                                  response_token_ids=tuple(100 * self._version + 10 + j + t for t in range(L)),
                                  rollout_log_probs=(-(self._version + 1) / 10,) * L,
                                  finish_reason="abort" if aborted else "length", policy_version=self._version))
        return out

    def update_weights(self, named_tensors=None, *, policy_version, **kwargs):
        self.loaded = dict(named_tensors or ())
        self._version = policy_version

    def abort(self):
        self._abort.set()

    def release_memory(self):
        pass

    def resume_memory(self):
        pass

    def health(self):
        return {"healthy": True, "policy_version": self._version}

    @property
    def policy_version(self):
        return self._version


SAMPLING = SamplingParams(max_new_tokens=6, n=3, temperature=1.0)


def _put_prompts(q, keys, *, seed=7, step=1):
    q.put(TRAIN, keys, {"prompts": [[1, 2, i + 3] for i in range(len(keys))], "seed": [seed] * len(keys)},
          {"global_steps": step})


# -------------------------------------------------------------------------------------- producer


def test_key_safe_uid_is_a_valid_prompt_id_and_keeps_distinct_uids_distinct():
    uids = ["math_dapo-17", "math=5Fdapo-17", "arith-train-12", "a b@c"]
    keys = [prompt_key(u, 3, 1) for u in uids]
    assert keys[2] == "arith-train-12@3.1"  # the arithmetic uids are unchanged: keys equal the sync trainer's groups
    assert keys[0] == "math=5Fdapo-17@3.1" and key_safe_uid("a b@c") == "a=20b=40c"
    assert len(set(keys)) == len(keys)
    assert all(parse_key(k) == (k, None) for k in keys)


def test_a_claim_is_written_as_complete_groups_tagged_done_with_their_version(tmp_path):
    q = TransferQueue(tmp_path / "q.sqlite")
    _put_prompts(q, ["a@1.0", "b@1.0"], step=5)
    engine = ScriptedEngine()
    engine.update_weights(None, policy_version=3)
    prod = Producer(q, engine, sampling=SAMPLING, producer_id="t")
    assert prod.run_once(10) == 2
    ids, _, sampling = engine.calls[0]
    assert ids == ["a@1.0", "b@1.0"] and sampling.seed == 7  # one engine call per generation batch, its seed
    assert [t["status"] for t in q.get_tags(TRAIN, ["a@1.0", "b@1.0"])] == ["done", "done"]
    trajs = q.list_keys(TRAIN, is_prompt=False)
    assert trajs == ["a@1.0_0", "a@1.0_1", "a@1.0_2", "b@1.0_0", "b@1.0_1", "b@1.0_2"]
    assert {(t["status"], t["global_steps"], t["policy_version"]) for t in q.get_tags(TRAIN, trajs)} == {("done", 5, 3)}
    f = q.get(TRAIN, ["b@1.0_2"], ["prompts", "responses", "rollout_log_probs", "min_policy_version"])
    assert f["prompts"][0].tolist() == [1, 2, 4] and f["responses"][0].tolist() == [312, 313, 314, 315]
    assert torch.equal(f["rollout_log_probs"][0], torch.full((4,), -0.4)) and f["min_policy_version"] == [3]
    assert prod.run_once(10) == 0  # nothing pending


def test_a_reissued_claim_is_never_written_by_its_old_producer(tmp_path):
    """The trainer presumed the producer dead while it generated: its late write must not add a group."""
    q = TransferQueue(tmp_path / "q.sqlite")
    _put_prompts(q, ["a@1.0"])
    holder = {}
    engine = ScriptedEngine(on_generate=lambda: reissue_claims(q, holder["p"].claim_prefix, global_steps=2))
    holder["p"] = Producer(q, engine, sampling=SAMPLING, producer_id="p0")
    assert holder["p"].run_once(1) == 0
    assert q.get_tags(TRAIN, ["a@1.0"])[0]["status"] == "pending" and q.count(TRAIN, is_prompt=False) == 0
    other = Producer(q, ScriptedEngine(), sampling=SAMPLING, producer_id="p1")
    assert other.run_once(1) == 1 and q.count(TRAIN, is_prompt=False) == 3


def test_reissue_claims_touches_only_the_dead_producers_running_prompts(tmp_path):
    q = TransferQueue(tmp_path / "q.sqlite")
    _put_prompts(q, ["a@1.0", "b@1.0", "c@1.0"])
    with q.transaction():
        q.claim(TRAIN, 1)
        q.put_fields(TRAIN, ["a@1.0"], {"claim": ["p0.11.1"]})
        q.claim(TRAIN, 1)
        q.put_fields(TRAIN, ["b@1.0"], {"claim": ["p1.12.1"]})
    assert reissue_claims(q, "p0.11.", global_steps=4) == ["a@1.0"]
    tags = q.get_tags(TRAIN, ["a@1.0", "b@1.0", "c@1.0"])
    assert [(t["status"], t["global_steps"]) for t in tags] == [("pending", 4), ("running", 1), ("pending", 1)]


def test_partial_rollout_continues_aborted_samples_under_the_new_weights(tmp_path):
    q = TransferQueue(tmp_path / "q.sqlite")
    _put_prompts(q, ["a@1.0"])
    store = WeightStore(str(tmp_path / "w"))
    store.publish(1, {"w": torch.ones(2)})  # newer than the engine's version 0: the watcher aborts the call
    engine = ScriptedEngine(abort_first=True)
    prod = Producer(q, engine, sampling=SAMPLING, producer_id="p0", weights=store, partial_rollout=True,
                    poll_s=0.01)
    assert prod.run_once(1) == 1
    assert engine.policy_version == 1 and torch.equal(engine.loaded["w"], torch.ones(2))
    ids, prompts, sampling = engine.calls[1]  # the continuation: one prompt per aborted sample
    assert ids == ["a@1.0_0", "a@1.0_1", "a@1.0_2"] and sampling.n == 1 and sampling.max_new_tokens == 4
    assert prompts[1] == (1, 2, 3, 11, 12)  # prompt + the tokens sampled before the abort
    f = q.get(TRAIN, ["a@1.0_1"], ["responses", "rollout_log_probs", "finish_reason", "min_policy_version",
                                   "max_policy_version"])
    assert f["responses"][0].tolist() == [11, 12, 110, 111, 112, 113]  # 2 tokens of version 0, 4 of version 1
    assert torch.allclose(f["rollout_log_probs"][0], torch.tensor([-0.1] * 2 + [-0.2] * 4))
    assert (f["finish_reason"], f["min_policy_version"], f["max_policy_version"]) == (["length"], [0], [1])
    assert q.get_tags(TRAIN, ["a@1.0"])[0]["policy_version"] == 1


def test_a_continuation_keeps_only_the_rest_of_min_new_tokens(tmp_path):
    """min_new_tokens counts the whole response: a continuation after 2 tokens needs 5 - 2 = 3 more."""
    q = TransferQueue(tmp_path / "q.sqlite")
    _put_prompts(q, ["a@1.0"])
    store = WeightStore(str(tmp_path / "w"))
    store.publish(1, {"w": torch.ones(2)})
    engine = ScriptedEngine(abort_first=True)
    prod = Producer(q, engine, sampling=dataclasses.replace(SAMPLING, min_new_tokens=5), producer_id="p0",
                    weights=store, partial_rollout=True, poll_s=0.01)
    assert prod.run_once(1) == 1
    assert [(c[2].max_new_tokens, c[2].min_new_tokens) for c in engine.calls] == [(6, 5), (4, 3)]


def test_partial_rollout_with_the_local_engine_continues_mid_decode_under_the_new_version(tmp_path):
    """The real engine, aborted by a weight publication at its 3rd decode step (timed through its
    per-step hook): the unfinished samples are continued and span two versions."""
    from megatron_dapo.models.forward import unwrap_model
    from megatron_dapo.trainer.producer import model_weights
    from megatron_dapo.trainer.run import build_parts

    parts = build_parts(_cfg(tmp_path))
    engine, base = parts.engine, parts.engine.policy_version
    q = TransferQueue(tmp_path / "q.sqlite")
    q.put(TRAIN, ["a@1.0", "b@1.0"], {"prompts": [parts.train_data[i].prompt_ids for i in (0, 1)], "seed": [3, 3]})
    store = WeightStore(str(tmp_path / "w"))
    weights = model_weights(unwrap_model(parts.actor.policy.chunks[0]))  # published as version base + 1
    calls, real_sync_step = [], engine._sync_step

    def sync_step(tok, lp, abort_flag):
        calls.append(1)
        if len(calls) == 3:  # the trainer syncs weights in the middle of the decode
            event = engine._abort_event
            store.publish(base + 1, weights)
            assert event.wait(10.0), "the producer's watcher did not abort the engine"
            abort_flag = True
        return real_sync_step(tok, lp, abort_flag)

    engine._sync_step = sync_step
    try:
        sampling = SamplingParams(max_new_tokens=6, n=2, temperature=1.0, stop_token_ids=(parts.tokenizer.eos_id,))
        prod = Producer(q, engine, sampling=sampling, producer_id="p0", weights=store, partial_rollout=True,
                        poll_s=0.001)
        assert prod.run_once(2) == 2
    finally:
        del engine._sync_step
    assert engine.policy_version == base + 1
    f = q.get(TRAIN, q.list_keys(TRAIN, is_prompt=False),
              ["responses", "finish_reason", "min_policy_version", "max_policy_version"])
    assert set(f["finish_reason"]) <= {"stop", "length"}
    spans = [(lo, hi, len(r)) for lo, hi, r in zip(f["min_policy_version"], f["max_policy_version"], f["responses"],
                                                   strict=True)]
    assert any(lo == base and hi == base + 1 for lo, hi, _ in spans)  # a trajectory made by two policies
    assert all(n <= 6 and (hi == lo or n > 3) for lo, hi, n in spans)


def test_weight_store_keeps_the_newest_versions_and_drops_those_after_a_rollback(tmp_path):
    store = WeightStore(str(tmp_path), keep=2)
    for v in (0, 2, 4, 6):
        store.publish(v, {"x": torch.full((3,), float(v))})
    assert store.versions() == [4, 6] and torch.equal(store.load(6)["x"], torch.full((3,), 6.0))
    store.publish(4, {"x": torch.zeros(3)})  # a restart from checkpoint 4: version 6 no longer exists
    assert store.versions() == [4] and not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


# -------------------------------------------------------------------------------------- recovery


def _recovery_queue(tmp_path, n=2):
    """Prompts in every state: consumed at steps 1 and 3, done (version 2, version 4, incomplete), running."""
    q = TransferQueue(tmp_path / "q.sqlite")
    for key, status, step, version, trajs in [("c1@1.0", "consumed", 1, 0, n), ("c3@3.0", "consumed", 3, 2, n),
                                              ("d2@3.0", "done", 3, 2, n), ("d4@4.0", "done", 4, 4, n),
                                              ("dx@4.0", "done", 4, 2, 1), ("r@4.0", "running", 4, None, 0)]:
        q.put(TRAIN, [key], {"fate": ["trained" if status == "consumed" else None]},
              {"status": status, "global_steps": step, "policy_version": version})
        if trajs:
            q.put(TRAIN, [f"{key}_{j}" for j in range(trajs)], None, {"status": "done", "policy_version": version})
    return q


def test_sync_recovery_deletes_everything_the_checkpoint_does_not_contain(tmp_path):
    q = _recovery_queue(tmp_path)
    assert sorted(discard_after(q, 2)) == ["c3@3.0", "d2@3.0", "d4@4.0", "dx@4.0", "r@4.0"]
    assert q.list_keys(TRAIN) == ["c1@1.0", "c1@1.0_0", "c1@1.0_1"]


def test_async_recovery_returns_late_consumption_and_regenerates_newer_or_incomplete_groups(tmp_path):
    q = _recovery_queue(tmp_path)
    late, redo = rollback_after(q, 2, n=2)
    assert late == ["c3@3.0"] and sorted(redo) == ["d4@4.0", "dx@4.0"]
    keys = ["c1@1.0", "c3@3.0", "d2@3.0", "d4@4.0", "dx@4.0", "r@4.0"]
    assert [(t["status"], t["global_steps"]) for t in q.get_tags(TRAIN, keys)] == [
        ("consumed", 1), ("done", 3), ("done", 3), ("pending", 2), ("pending", 2), ("running", 4)]
    assert q.get(TRAIN, ["c3@3.0"], ["fate"])["fate"] == [None]
    assert q.count(TRAIN, is_prompt=False) == 6  # c1, c3 and d2 keep their groups; d4 and dx lost theirs


# ------------------------------------------------------------------------------ the trainer, in process


def test_sync_mode_equals_the_sync_trainer_step_for_step(tmp_path):
    """Same keys (= GRPO groups), seeds and engine batching as DAPOTrainer.fit: equal losses and batches."""
    run(_cfg(tmp_path / "fit", "trainer.total_training_steps=3"))
    assert run(_cfg(tmp_path / "queue", "trainer.total_training_steps=3", "queue.enable=true")) == 0
    a, b = _scalars(tmp_path / "fit/q"), _scalars(tmp_path / "queue/q")
    for step in (1, 2, 3):
        assert _dump_groups(tmp_path / "fit/dumps", step) == _dump_groups(tmp_path / "queue/dumps", step)
        for name in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean",
                     "critic/advantages/max", "train/num_gen_batches", "train/num_dropped_groups",
                     "rollout_corr/log_prob_abs_diff"):
            assert a[name][step] == b[name][step], (name, step)
    for stage in ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor"):
        assert set(b[f"timing_s/{stage}"]) == {1, 2, 3}, stage
    assert b["staleness/lag_worst/max"] == {1: 0.0, 2: 0.0, 3: 0.0}
    q = TransferQueue(tmp_path / "queue/q/queue.sqlite")
    keys = q.list_keys(TRAIN, is_prompt=True)
    assert {t["status"] for t in q.get_tags(TRAIN, keys)} == {"consumed"}  # sync mode: nothing outlives a step
    assert q.count(TRAIN, is_prompt=False) == 0  # trajectories of consumed prompts go after the checkpoint


@pytest.mark.parametrize("bypass", [False, True])
def test_step_once_reads_and_writes_the_stage_fields_through_the_queue(tmp_path, bypass):
    extra = ["algorithm.rollout_correction.bypass_mode=true"] if bypass else []
    trainer = build_trainer(_cfg(tmp_path, "queue.enable=true", "trainer.total_training_steps=2", *extra))
    try:
        trainer._resume()
        from megatron_dapo.metrics import StageTimer

        batch, metrics = trainer._step_once(1, StageTimer(), first=True, last=False)
        q = trainer.queue
        prompts = q.list_keys(TRAIN, is_prompt=True)
        tags = dict(zip(prompts, q.get_tags(TRAIN, prompts), strict=True))
        fates = {k: q.get(TRAIN, [k], ["fate"])["fate"][0] for k in prompts if tags[k]["status"] == "consumed"}
        trained = [k for k, f in fates.items() if f == "trained"]
        assert trained == list(dict.fromkeys(batch.rollout.index)) and len(trained) == 4
        assert all(tags[k]["global_steps"] == 1 for k in fates)
        assert len(prompts) - len(fates) == metrics["train/num_kept_prompts"] - 4  # the rest waits: still done
        tk = [f"{k}_{j}" for k in trained for j in range(4)]
        f = q.get(TRAIN, tk, ["rm_scores", "rewards", "acc", "pred", "old_log_probs", "rollout_log_probs"])
        assert torch.equal(torch.tensor(f["rm_scores"], dtype=torch.float32), batch.scores)
        assert [len(x) for x in f["old_log_probs"]] == batch.rollout.response_length.tolist()
        for old, roll in zip(f["old_log_probs"], f["rollout_log_probs"], strict=True):
            if bypass:
                assert torch.equal(old, roll)
            else:  # the first-step invariant: the actor recomputes the engine's log-probs
                assert torch.allclose(old, roll, atol=1e-5)
        if not bypass:  # decoupled mode also writes the entropy of each response token
            assert all(e.shape == o.shape and (e >= 0).all()
                       for e, o in zip(q.get(TRAIN, tk, ["entropy"])["entropy"], f["old_log_probs"], strict=True))
        filtered = [k for k, v in fates.items() if v == "filtered"]
        if filtered:  # scored but never trained: no old_log_probs
            assert q.get(TRAIN, [f"{filtered[0]}_0"], ["rm_scores"])
            with pytest.raises(KeyError, match="old_log_probs"):
                q.get(TRAIN, [f"{filtered[0]}_0"], ["old_log_probs"])
    finally:
        trainer.close()


def test_parameter_sync_step_2_trains_two_updates_on_data_of_one_policy_version(tmp_path):
    cfg = _cfg(tmp_path, "queue.enable=true", "queue.parameter_sync_step=2", "trainer.total_training_steps=4")
    assert run(cfg) == 0
    s = _scalars(tmp_path / "q")
    # The second update of each sync trains on samples one actor update old; weights reach the engine
    # only every second update.
    assert s["staleness/lag_worst/max"] == {1: 0.0, 2: 1.0, 3: 0.0, 4: 1.0}
    assert s["train/num_train_prompts"] == {1: 4.0, 2: 4.0, 3: 4.0, 4: 4.0}
    assert s["train/num_gen_batches"][2] == 0.0 and s["train/num_gen_batches"][4] == 0.0
    q = TransferQueue(tmp_path / "q/queue.sqlite")
    consumed = q.list_keys(TRAIN, is_prompt=True, status="consumed")
    surplus_steps = {t["global_steps"] for k, t in zip(consumed, q.get_tags(TRAIN, consumed), strict=True)
                     if q.get(TRAIN, [k], ["fate"])["fate"][0] == "surplus"}
    assert surplus_steps <= {2, 4}  # leftovers are consumed at the end of the step, never mid-step


@pytest.mark.parametrize("policy", ["drop", "correct"])
def test_groups_older_than_max_staleness_are_regenerated_under_drop_and_kept_under_correct(tmp_path, policy):
    trainer = build_trainer(_cfg(tmp_path, "queue.enable=true", "queue.max_staleness=1",
                                       f"queue.stale_policy={policy}"))
    try:
        q = trainer.queue
        for key in ("a@1.0", "b@1.0"):
            q.put(TRAIN, [key], None, {"status": "done", "policy_version": 3})
            q.put(TRAIN, [f"{key}_{j}" for j in range(4)], None, {"status": "done"})
        trainer.policy_version = 4  # one sync of staleness allowed: a group needs a token of version >= 3
        trainer._pool, trainer._seen = [("a@1.0", 2), ("b@1.0", 3)], {"a@1.0", "b@1.0"}
        trainer._check_staleness(5)
        if policy == "drop":
            assert trainer._pool == [("b@1.0", 3)] and trainer._seen == {"b@1.0"}
            assert trainer._stale_dropped == 1  # counted: staleness/regenerated_groups
            assert [(t["status"], t["global_steps"]) for t in q.get_tags(TRAIN, ["a@1.0"])] == [("pending", 5)]
            assert q.count(TRAIN, is_prompt=False, prompt_uid="a@1.0") == 0
        else:  # kept; the update weights it with token-level IS against the recomputed old log-probs
            assert trainer._pool == [("a@1.0", 2), ("b@1.0", 3)]
            assert q.count(TRAIN, is_prompt=False) == 8 and trainer._stale_dropped == 0
    finally:
        trainer.close()


@pytest.mark.parametrize("extra,error", [
    (["queue.parameter_sync_step=2", "trainer.total_training_steps=3"],
     r"queue.parameter_sync_step: expected a divisor of trainer.total_training_steps \(3"),
    (["trainer.n_gpus_per_node=2"],
     r"queue.enable: with rollout.engine=local the queue trainer runs one training process, got .* = 2"),
    (["rollout.engine=sglang", "model.hf_path=/nonexistent", "queue.max_staleness=1"],
     r"queue.max_staleness: expected 0 with rollout.mode=colocate, got 1: in async mode the servers generate"),
    (["actor.router_replay=r3"], r"actor.router_replay: r3 replays the routing SGLang reports per request"),
    (["trainer.async_save=true"], r"trainer.async_save: the queue trainer saves synchronously"),
], ids=["sync-step", "local-world", "sglang-async-colocated", "r3", "async-save"])
def test_what_the_queue_trainer_does_not_run_is_refused_at_load_naming_the_key(tmp_path, extra, error):
    """Refused by the configuration, before any model is built or server started."""
    from megatron_dapo.config import ConfigError

    with pytest.raises(ConfigError, match=error):
        _cfg(tmp_path, "queue.enable=true", *extra)


@pytest.mark.parametrize("policy,partial", [("drop", False), pytest.param("correct", False, marks=pytest.mark.slow),
                                            pytest.param("drop", True, marks=pytest.mark.slow)])
def test_async_mode_trains_on_groups_from_a_producer_process(tmp_path, policy, partial):
    cfg = _cfg(tmp_path, "queue.enable=true", "queue.max_staleness=1", "trainer.total_training_steps=4",
               f"queue.stale_policy={policy}", f"queue.partial_rollout={str(partial).lower()}")
    assert run(cfg) == 0
    s = _scalars(tmp_path / "q")
    assert s["train/num_train_prompts"] == {1: 4.0, 2: 4.0, 3: 4.0, 4: 4.0}
    assert ("rollout_corr/is_weight_mean" in s) == (policy == "correct")
    if policy == "drop":  # never more than max_staleness syncs old (correct keeps older groups, IS-weighted)
        assert max(s["staleness/lag_worst/max"].values()) <= 1.0
    q = TransferQueue(tmp_path / "q/queue.sqlite")
    keys = q.list_keys(TRAIN, is_prompt=True)
    tags = q.get_tags(TRAIN, keys)
    trained = [k for k, t in zip(keys, tags, strict=True)
               if t["status"] == "consumed" and q.get(TRAIN, [k], ["fate"])["fate"][0] == "trained"]
    dumped = [g for step in (1, 2, 3, 4) for g in dict.fromkeys(_dump_groups(tmp_path / "dumps", step))]
    assert sorted(dumped) == sorted(trained) and len(set(dumped)) == 16
    assert len(list((tmp_path / "q/queue_weights").glob("policy_v*.safetensors"))) >= 1
