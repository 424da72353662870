"""The sync trainer end to end on the tiny CPU model: metrics in TensorBoard, dumps, checkpoints,
and resume == uninterrupted."""

import json
import pathlib
import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_dapo.config import load_config
from megatron_dapo.trainer.run import run

ROOT = pathlib.Path(__file__).resolve().parents[2]

# A random model never answers right, but its responses differ in length, so with overlong shaping
# the shaped reward varies inside groups: dynamic sampling on seq_reward has groups to keep.
TINY = ["data.train_batch_size=4", "data.gen_batch_size=6", "rollout.n=4", "actor.ppo_mini_batch_size=2",
        "data.max_response_length=6", "reward.overlong_buffer.len=4", "algorithm.filter_groups.metric=seq_reward",
        "data.arithmetic.num_train=200", "data.arithmetic.num_val=8", "trainer.sft_warmup_steps=0",
        "trainer.test_freq=2", "actor.lr=1e-3", "trainer.logger=[tensorboard]"]


def _cfg(tmp_path, *extra):
    return load_config(str(ROOT / "configs/tiny_cpu.yaml"),
                       TINY + [f"trainer.output_dir={tmp_path}", f"trainer.rollout_data_dir={tmp_path}/dumps", *extra])


def _scalars(run_dir: pathlib.Path) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


DESIGN_METRICS = ["critic/score/mean", "critic/rewards/mean", "critic/advantages/max", "response_length/mean",
                  "response_length/clip_ratio", "actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
                  "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr", "timing_s/gen",
                  "timing_s/reward", "timing_s/old_log_prob", "timing_s/adv", "timing_s/update_actor",
                  "timing_per_token_ms/gen", "perf/throughput", "perf/total_num_tokens", "perf/time_per_step",
                  "train/num_gen_batches", "rollout_corr/log_prob_abs_diff"]


def test_two_steps_write_design_metrics_dumps_and_a_checkpoint(tmp_path, capsys):
    cfg = _cfg(tmp_path, "trainer.total_training_steps=2", "trainer.experiment_name=e2e", "reward.overlong_buffer.log=true")
    assert run(cfg) == 0
    summary = capsys.readouterr().out  # the final validation, next to the one before training
    assert re.search(r"val/arithmetic/acc/mean@4 = [0-9.]+  \(step 0: [0-9.]+\)", summary), summary
    assert f"tensorboard --logdir {tmp_path / 'e2e' / 'tb'}" in summary
    scalars = _scalars(tmp_path / "e2e")
    for name in DESIGN_METRICS:
        assert set(scalars[name]) == {1, 2}, name
    assert "val/arithmetic/acc/mean@4" in scalars and 0 in scalars["val/arithmetic/acc/mean@4"]
    # verl's names for the same means, at every validation
    assert scalars["val-core/arithmetic/acc/mean@4"] == scalars["val/arithmetic/acc/mean@4"]
    assert scalars["val-aux/arithmetic/score/mean@4"] == scalars["val/arithmetic/score/mean@4"]
    assert "val-core/arithmetic/acc/mean@4" not in summary
    # First-step invariant: the engine's log-probs are the actor's (same weights, fp32).
    assert scalars["rollout_corr/log_prob_abs_diff"][1] < 1e-5
    rows = [json.loads(line) for line in (tmp_path / "dumps/step_1.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * 4 and {r["sample_index"] for r in rows} == {0, 1, 2, 3}
    # reward.overlong_buffer.log: the logged penalty is the trained rows' reward - score.
    penalty = [r["reward"] - r["score"] for r in rows]
    assert scalars["reward/overlong_penalty/mean"][1] == pytest.approx(sum(penalty) / len(penalty), abs=1e-6)
    assert scalars["reward/overlong_penalty/min"][1] == pytest.approx(min(penalty), abs=1e-6)
    ckpt = tmp_path / "e2e/ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (ckpt / "global_step_2/trainer_state.pt").exists() and not (ckpt / "inflight").exists()


def _dumped_uids(dump_dir: pathlib.Path, step: int) -> list[str]:
    return [json.loads(line)["group"] for line in (dump_dir / f"step_{step}.jsonl").read_text().splitlines()]


def test_resume_after_step_2_reproduces_the_uninterrupted_run(tmp_path, monkeypatch):
    """Same config; the first attempt stops right after the step-2 checkpoint (as a crash would)."""
    from megatron_dapo.trainer import fit

    args = ["trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.experiment_name=r"]
    run(_cfg(tmp_path / "a", *args))
    real = fit.DAPOTrainer._save

    def save_then_stop(self):
        real(self)
        if self.global_step == 2:
            raise _Crash

    monkeypatch.setattr(fit.DAPOTrainer, "_save", save_then_stop)
    with pytest.raises(_Crash):
        run(_cfg(tmp_path / "b", *args))
    monkeypatch.setattr(fit.DAPOTrainer, "_save", real)
    run(_cfg(tmp_path / "b", *args))
    a, b = _scalars(tmp_path / "a/r"), _scalars(tmp_path / "b/r")
    for step in (3, 4):
        assert _dumped_uids(tmp_path / "a/dumps", step) == _dumped_uids(tmp_path / "b/dumps", step)
        for name in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "actor/entropy", "actor/lr"):
            assert a[name][step] == b[name][step], (name, step)


class _Crash(Exception):
    pass


def test_crash_between_generation_batches_resumes_without_regenerating(tmp_path, monkeypatch):
    """The kept groups of a half-collected step are restored from inflight/: the resumed step
    trains on exactly the batch of the uninterrupted run."""
    from megatron_dapo.trainer import fit

    extra = ["data.gen_batch_size=4", "trainer.total_training_steps=2", "trainer.save_freq=1",
             "trainer.experiment_name=c", "trainer.test_freq=0"]
    run(_cfg(tmp_path / "a", *extra))
    a = _scalars(tmp_path / "a/c")
    assert a["train/num_gen_batches"][2] >= 2, "the setting must need a second generation batch"

    real = fit.DAPOTrainer._save_inflight

    def crash_after_saving(self, step):
        real(self, step)
        if step == 2:
            raise _Crash

    monkeypatch.setattr(fit.DAPOTrainer, "_save_inflight", crash_after_saving)
    with pytest.raises(_Crash):
        run(_cfg(tmp_path / "b", *extra))
    assert (tmp_path / "b/c/ckpt/inflight/state.pt").exists()
    monkeypatch.setattr(fit.DAPOTrainer, "_save_inflight", real)
    generated = []
    real_generate = fit.stages.generate
    monkeypatch.setattr(fit.stages, "generate", lambda *a_, **k: generated.append(1) or real_generate(*a_, **k))
    run(_cfg(tmp_path / "b", *extra))
    b = _scalars(tmp_path / "b/c")
    assert len(generated) == a["train/num_gen_batches"][2] - 1  # the saved batch was not generated again
    assert _dumped_uids(tmp_path / "a/dumps", 2) == _dumped_uids(tmp_path / "b/dumps", 2)
    for name in ("actor/pg_loss", "actor/grad_norm", "train/num_gen_batches"):
        assert a[name][2] == b[name][2], name


def test_moe_model_with_mtp_trains_and_logs_load_balance(tmp_path):
    cfg = _cfg(tmp_path, "trainer.total_training_steps=1", "trainer.experiment_name=moe", "model.arch=tiny_moe",
               "model.mtp_num_layers=1", "trainer.test_freq=0", "trainer.val_before_train=false",
               "actor.router_replay=true", "actor.mtp_detach_trunk=true")
    assert run(cfg) == 0
    scalars = _scalars(tmp_path / "moe")
    assert scalars["moe/num_layers"][1] == 4.0 and scalars["moe/load_imbalance/mean"][1] >= 1.0
    assert scalars["rollout_corr/log_prob_abs_diff"][1] < 1e-5  # MTP heads do not leak into sampling


def test_on_policy_old_log_prob_from_the_update_equals_a_separate_pass(tmp_path, monkeypatch):
    """ppo_mini_batch_size = train_batch_size, one epoch: with actor.old_log_prob_from_update the trainer
    skips the separate old_log_prob forward and trains the same (same samples, losses, grad norms), with
    the first-step invariant and the variance proxy taken from the update's forward."""
    from megatron_dapo.trainer import fit

    calls = []
    real = fit.DAPOTrainer.__init__

    def spy_init(self, cfg, parts):
        real(self, cfg, parts)
        lp = parts.actor.compute_log_prob
        parts.actor.compute_log_prob = lambda *a, **k: calls.append(self.old_from_update) or lp(*a, **k)

    monkeypatch.setattr(fit.DAPOTrainer, "__init__", spy_init)
    args = ["actor.ppo_mini_batch_size=4", "trainer.total_training_steps=3", "trainer.test_freq=0"]
    for flag in ("true", "false"):
        assert run(_cfg(tmp_path / flag, *args, f"actor.old_log_prob_from_update={flag}",
                        "trainer.experiment_name=o")) == 0
    assert calls == [False] * 3  # only the run with the flag off made separate old_log_prob passes
    on, off = _scalars(tmp_path / "true/o"), _scalars(tmp_path / "false/o")
    for step in (1, 2, 3):
        assert _dumped_uids(tmp_path / "true/dumps", step) == _dumped_uids(tmp_path / "false/dumps", step)
        assert on["critic/score/mean"][step] == off["critic/score/mean"][step]
        for name in ("actor/pg_loss", "actor/grad_norm", "variance_proxy/proxy1_signal_strength"):
            assert on[name][step] == pytest.approx(off[name][step], rel=1e-4, abs=1e-6), (name, step)
        assert on["actor/ppo_kl"][step] == 0.0 and on["rollout_corr/log_prob_abs_diff"][step] < 1e-5
    # Two mini-batches, or a rollout correction that needs old before the update: the separate pass stays.
    from megatron_dapo.config import resolve_rollout_correction

    for extra in (["actor.ppo_mini_batch_size=2"], args[:1] + ["algorithm.rollout_correction.preset=decoupled_token_is"]):
        cfg = _cfg(tmp_path, *extra)
        assert not fit.old_log_prob_from_update(cfg, resolve_rollout_correction(cfg), None), extra


def test_critic_warmup_compares_with_the_current_step_as_verl(tmp_path):
    """trainer.critic_warmup=2: verl's `critic_warmup <= global_steps` with the current step, so the actor
    first updates at step 2 (step 1 only generates and scores)."""
    cfg = _cfg(tmp_path, "trainer.total_training_steps=2", "trainer.experiment_name=cw", "trainer.critic_warmup=2",
               "trainer.test_freq=0", "trainer.val_before_train=false")
    assert run(cfg) == 0
    scalars = _scalars(tmp_path / "cw")
    assert set(scalars["actor/pg_loss"]) == {2} and set(scalars["critic/score/mean"]) == {1, 2}


def test_aborted_responses_are_excluded_from_the_group_advantages():
    """GRPO over the finished responses only: 3 correct + 1 aborted gives the 3 an advantage of 0 (their
    group agrees), not the positive one a score of 0 for the abort would give; the abort gets 0."""
    import torch

    from megatron_dapo.algos.advantage import get_adv_estimator_fn
    from megatron_dapo.trainer import stages
    from tests.trainer._batches import scored

    batch = scored({"a": [1, 1, 1, 0], "b": [1, 0, 1, 0]}, aborted=frozenset({("a", 3)}))
    mask = stages.loss_mask(batch, overlong_filter=False, max_response_length=4)
    adv = stages.compute_advantages(batch, mask, adv_fn=get_adv_estimator_fn("grpo"), estimator="grpo",
                                    norm_adv_by_std_in_grpo=True, gamma=1.0, lam=1.0, kl_in_reward=None,
                                    old_log_probs=None, ref_log_probs=None).advantages
    per_row = adv.sum(-1) / mask.sum(-1).clamp(min=1)
    assert per_row[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    # group b (rewards = acc - 0.1): mean 0.4, unbiased std sqrt(1/3); +-0.5 / (std + 1e-6) on its rows.
    want = 0.5 / (torch.tensor([1.0, 0.0, 1.0, 0.0]).std().item() + 1e-6)
    torch.testing.assert_close(per_row[4:], torch.tensor([want, -want, want, -want]), atol=1e-5, rtol=1e-5)


def test_total_epochs_ends_training_after_the_last_prompt_of_the_epochs(tmp_path, caplog):
    # 8 prompts, 4 per step, no dynamic sampling: two steps per epoch, so two epochs are four steps of 30.
    cfg = _cfg(tmp_path, "trainer.total_training_steps=30", "trainer.total_epochs=2", "data.arithmetic.num_train=8",
               "data.gen_batch_size=4", "algorithm.filter_groups.enable=false", "trainer.save_freq=3",
               "trainer.experiment_name=ep")
    with caplog.at_level("INFO", logger="megatron_dapo.trainer.fit"):
        assert run(cfg) == 0
    assert "trainer.total_epochs=2 reached at step 4: training ends" in caplog.text
    scalars = _scalars(tmp_path / "ep")
    assert set(scalars["actor/pg_loss"]) == {1, 2, 3, 4}
    assert 4 in scalars["val/arithmetic/acc/mean@4"]  # the last step validates ...
    ckpt = tmp_path / "ep" / "ckpt"  # ... and saves, as at total_training_steps
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert {p.name for p in ckpt.glob("global_step_*")} == {"global_step_3", "global_step_4"}
    prompts = [sorted({u.split("@")[0] for s in steps for u in _dumped_uids(tmp_path / "dumps", s)})
               for steps in ((1, 2), (3, 4))]
    assert prompts[0] == prompts[1] == [f"arith-train-{i}" for i in range(8)]  # every prompt once per epoch


def test_dynamic_sampling_that_cannot_fill_a_step_ends_the_run_with_one_line_naming_the_warm_up(tmp_path, capsys):
    # acc on a random model: every group constant, so the step can never fill (the embedded default without
    # its supervised warm-up).
    cfg = _cfg(tmp_path, "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=2",
               "trainer.val_before_train=false", "trainer.experiment_name=dse")
    assert run(cfg) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("training error: dynamic sampling kept 0 of the 4 prompts needed")
    assert "(trainer.sft_warmup_steps=0)" in err[0] and "Traceback" not in err[0]
