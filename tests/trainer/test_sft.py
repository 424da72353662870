"""The supervised warm-up: NLL steps that lower the loss, the cache, and the early stop at a target accuracy."""

import pytest
import torch

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.data.arithmetic import arithmetic_sft_examples
from megatron_dapo.models.forward import unwrap_model
from megatron_dapo.trainer import sft
from megatron_dapo.trainer.run import build_parts

SMALL = ["data.arithmetic.num_train=64", "data.arithmetic.num_val=8", "trainer.sft_warmup_lr=2e-3",
         "data.train_batch_size=16", "data.gen_batch_size=16", "actor.ppo_mini_batch_size=16"]


def _parts(tmp_path, *extra):
    cfg = load_config("configs/tiny_cpu.yaml", SMALL + [f"trainer.output_dir={tmp_path}", *extra])
    return cfg, build_parts(cfg)


def _weights(actor) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for c in actor.policy.chunks
                      for p in unwrap_model(c).parameters()])


def test_warmup_lowers_the_nll_and_a_rerun_loads_the_cached_weights(tmp_path):
    cfg, parts = _parts(tmp_path, "trainer.sft_warmup_steps=30", "trainer.sft_warmup_target_acc=0",
                        "trainer.sft_warmup_batch_size=16")
    examples = arithmetic_sft_examples(parts.train_data, parts.tokenizer)
    first = parts.actor.supervised_step(sft._batch(examples[:64], parts.tokenizer.pad_id), lr=0.0)  # lr 0: a probe
    m = sft.sft_warmup(parts.actor, examples, cfg, pad_id=parts.tokenizer.pad_id, rank=0)
    assert m["sft/steps"] == 30 and "sft/probe_acc" not in m
    after = parts.actor.supervised_step(sft._batch(examples[:64], parts.tokenizer.pad_id), lr=0.0)
    assert after["actor/pg_loss"] < 0.7 * first["actor/pg_loss"]
    warmed = _weights(parts.actor)
    # another experiment in the same output directory, with the same warm-up settings, starts from the cache
    other, again = _parts(tmp_path, "trainer.sft_warmup_steps=30", "trainer.sft_warmup_target_acc=0",
                          "trainer.sft_warmup_batch_size=16", "trainer.experiment_name=another")
    assert other.run_dir != cfg.run_dir
    assert sft.sft_warmup(again.actor, examples, other, pad_id=again.tokenizer.pad_id, rank=0) == {"sft/cached": 1.0}
    assert torch.equal(_weights(again.actor), warmed)
    parts.reward_manager.close()
    again.reward_manager.close()


def test_target_accuracy_stops_at_the_first_check_that_reaches_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sft, "PROBE_GAPS", ((0.25, 64), (0.6, 32), (float("inf"), 16)))  # examples: 8, 4, 2 steps
    cfg, parts = _parts(tmp_path, "trainer.sft_warmup_steps=40", "trainer.sft_warmup_target_acc=0.3",
                        "trainer.sft_warmup_batch_size=8")
    examples = arithmetic_sft_examples(parts.train_data, parts.tokenizer)
    steps_at_check = []
    readings = iter([0.05, 0.1, 0.15, 0.29, 0.31, 0.9])
    real_step = parts.actor.supervised_step
    done = []
    parts.actor.supervised_step = lambda *a, **k: done.append(1) or real_step(*a, **k)
    probe = lambda: steps_at_check.append(len(done)) or next(readings)  # noqa: E731
    m = sft.sft_warmup(parts.actor, examples, cfg, pad_id=parts.tokenizer.pad_id, rank=0, probe=probe)
    # 0.05 < 0.25 x target: 8 steps to the next check; 0.1, 0.15 < 0.6 x target: 4; 0.29 (near it): 2
    assert steps_at_check == [8, 16, 20, 24, 26]
    assert (m["sft/steps"], m["sft/probe_acc"]) == (26, 0.31)
    assert [sft.next_probe_gap(a, 0.3, 8) for a in (None, 0.0, 0.074, 0.075, 0.179, 0.18, 0.5)] == [8, 8, 8, 4, 4, 2, 2]
    assert [sft.next_probe_gap(a, 0.3, 20) for a in (None, 0.1, 0.2)] == [3, 2, 1]  # 64/20, 32/20, 16/20 rounded, >= 1
    with pytest.raises(ValueError, match="needs a probe"):
        sft.sft_warmup(parts.actor, examples, load_config("configs/tiny_cpu.yaml", SMALL + [
            f"trainer.output_dir={tmp_path}/b", "trainer.sft_warmup_steps=8", "trainer.sft_warmup_target_acc=0.3"]),
            pad_id=parts.tokenizer.pad_id, rank=0)
    with pytest.raises(ConfigError, match="sft_warmup_target_acc"):
        load_config("configs/tiny_cpu.yaml", ["trainer.sft_warmup_target_acc=1.0"])
    parts.reward_manager.close()


def test_warmup_lr_schedule_ramps_then_decays_by_cosine():
    t = load_config("configs/tiny_cpu.yaml", ["trainer.sft_warmup_steps=110", "trainer.sft_warmup_lr=2e-3",
                                              "trainer.sft_warmup_lr_warmup_steps=10",
                                              "trainer.sft_warmup_lr_decay_style=cosine"]).trainer
    assert sft.warmup_lr(t, 1) == pytest.approx(2e-4) and sft.warmup_lr(t, 10) == pytest.approx(2e-3)
    assert sft.warmup_lr(t, 60) == pytest.approx(1e-3)  # half-way down the cosine: half the peak
    assert sft.warmup_lr(t, 110) == pytest.approx(0.0, abs=1e-12)
    const = load_config("configs/tiny_cpu.yaml", ["trainer.sft_warmup_lr=2e-3", "trainer.sft_warmup_lr_warmup_steps=0",
                                                  "trainer.sft_warmup_lr_decay_style=constant"]).trainer
    assert [sft.warmup_lr(const, s) for s in (1, 500)] == [2e-3, 2e-3]
    with pytest.raises(ConfigError, match="sft_warmup_batch_size"):
        load_config("configs/tiny_cpu.yaml", ["trainer.sft_warmup_batch_size=0"])


def test_the_run_probes_accuracy_on_training_problems(tmp_path):
    """build_trainer's probe: mean@n of the live policy on the first training problems, in [0, 1]."""
    from megatron_dapo.trainer.run import _warmup_probe

    cfg, parts = _parts(tmp_path, "trainer.sft_warmup_steps=10", "trainer.sft_warmup_target_acc=0.5")
    calls = []
    real = parts.engine.generate
    parts.engine.generate = lambda prompts, sampling: calls.append([p.prompt_id for p in prompts]) or real(prompts, sampling)
    acc = _warmup_probe(cfg, parts)()
    assert 0.0 <= acc <= 1.0
    ids = [pid for batch in calls for pid in batch]
    assert ids and all(pid.startswith("arith-train-") for pid in ids), ids[:3]
    parts.reward_manager.close()
