"""The actor/engine numerical contract (trainer/mismatch.py): the two peer metrics in closed form, the
alarm's warning, its reset on a good step and its stop after `stop_after` consecutive steps, and a run
whose server does not hold the actor's weights (the SGLang stand-in's toy model, its own process) stopped
at step 1 with one line."""

import logging
import math
import pathlib

import pytest
import torch

from megatron_dapo.config import load_config
from megatron_dapo.config.schema_rollout import MismatchAlarmConfig
from megatron_dapo.data.tokenizer import CharTokenizer
from megatron_dapo.trainer.mismatch import MismatchAlarm, MismatchAlarmError, mismatch_metrics
from megatron_dapo.trainer.run import run
from tests.standin import StandinServer

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_metrics_in_closed_form():
    actor = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    engine = torch.tensor([[-1.0, -2.5, -2.0], [-0.5, -0.7, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the last entry is padding: never counted
    lr = [0.0, 0.5, -1.0, 0.0, 0.2]
    got = mismatch_metrics(actor, engine, mask)
    assert got["rollout_corr/token_mult_prob_error"] == pytest.approx(sum(math.exp(abs(x)) for x in lr) / 5)
    assert got["rollout_corr/mismatch_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in lr) / 5)
    same = mismatch_metrics(actor, actor, mask)
    assert same == {"rollout_corr/token_mult_prob_error": 1.0, "rollout_corr/mismatch_kl": 0.0}


def test_the_alarm_warns_resets_and_stops_after_consecutive_steps(caplog):
    alarm = MismatchAlarm(MismatchAlarmConfig(stop_after=2))
    actor, mask = torch.zeros(3, 2), torch.ones(3, 2)
    engine = torch.tensor([[0.0, 0.0], [-0.3, -0.3], [-0.1, 0.0]])  # row 1 is the worst
    bad = mismatch_metrics(actor, engine, mask)
    good = {"rollout_corr/token_mult_prob_error": 1.01, "rollout_corr/mismatch_kl": 0.001}
    kw = dict(actor_log_probs=actor, engine_log_probs=engine, mask=mask, data_sources=["aime", "math", "math"])
    with caplog.at_level(logging.WARNING, logger="megatron_dapo.trainer.mismatch"):
        alarm.check(1, bad, **kw)
        assert "step 1: rollout/training mismatch above rollout.mismatch_alarm: token_mult_prob_error=" in caplog.text
        assert "'math': 2" in caplog.text
        alarm.check(2, good, **kw)  # a good step resets the count
        alarm.check(3, bad, **kw)
        with pytest.raises(MismatchAlarmError, match=r"step 4: token_mult_prob_error=1\.\d+ > 1\.05 for 2 consecutive"):
            alarm.check(4, bad, **kw)
    MismatchAlarm(MismatchAlarmConfig()).check(5, bad, **kw)  # stop_after=0: warn only, never raises


def test_a_server_without_the_actors_weights_stops_the_run_at_step_1(tmp_path, capsys):
    with StandinServer(toy=True, args=["--toy-vocab-size", str(CharTokenizer().vocab_size)],
                       log_dir=tmp_path) as server:
        cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), [
            "rollout.engine=sglang", f"rollout.sglang_urls=[{server.url}]", "rollout.require_memory_saver=false",
            "trainer.total_training_steps=3", "trainer.sft_warmup_steps=0", "algorithm.filter_groups.enable=false",
            "data.gen_batch_size=null", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2",
            "data.max_response_length=6", "reward.overlong_buffer.len=4", "trainer.test_freq=0",
            "trainer.val_before_train=false", "trainer.logger=[]", "trainer.save_freq=-1",
            "rollout.mismatch_alarm.stop_after=1", f"trainer.output_dir={tmp_path}"])
        assert run(cfg) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("training error:")]
    assert len(err) == 1 and "step 1: token_mult_prob_error=" in err[0], err


def test_the_kl_estimate_at_round_off_agreement_is_its_closed_form_not_cancellation_noise():
    """|log r| ~ 1e-6 (fp32 actor vs fp32 server): r - log r - 1 = x^2/2 + x^3/6 + ... ~ 5e-13, where float32
    exp(x) - x - 1 gives +-1e-7 of noise, negative as often as not (it failed the real-server test once)."""
    actor = torch.full((2, 3), -2.0)
    engine = actor - torch.tensor([[1e-6, -2e-6, 3e-6], [0.0, 1e-6, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    x = (actor.double() - engine.double())[mask.bool()]  # the float32 inputs' exact differences
    want = sum(math.expm1(v) - v for v in x.tolist()) / 5
    got = mismatch_metrics(actor, engine, mask)["rollout_corr/mismatch_kl"]
    assert got >= 0 and got == pytest.approx(want, rel=1e-9) and 1e-13 < got < 1e-11
