"""rollout.speculative.auto end to end: the trainer launches its SGLang servers (the stand-in in its own
process, 0.5.23, with SGLang's Qwen3-MoE drafter), measures step 1 with speculation, relaunches the
servers without it for step 2, and keeps the faster: relaunched with speculation for step 3 when that
was faster, left without otherwise. Both figures and the choice are logged under spec_decode/auto/.

The stand-in's emulated decoding speed makes one mode twice as fast as the other by construction
(--forward-delay-s / --draft-delay-s, tests/standin/generate.py): with a 2x gap the choice cannot flip
on a loaded machine, whose extra compute time per token is the same in both modes and far below the
emulated 0.05-0.1 s per forward."""

from __future__ import annotations

import pathlib

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_dapo.config import load_config
from megatron_dapo.rollout.sglang import server as sglang_server
from megatron_dapo.trainer.run import run
from tests.standin import LAUNCHER, free_port
from tests.trainer.test_sglang_drafter import hf_moe

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return hf_moe(tmp_path_factory.mktemp("autospec"))


def _run(hf_dir, tmp_path, monkeypatch, *, forward_delay_s: float, draft_delay_s: float):
    launched = []
    real = sglang_server.launch_servers

    def launch_standins(specs, *, log_dir, timeout_s, **kw):
        launched.append([s.speculative_algorithm for s in specs])
        emulate = ("--emulate-version", "0.5.23", "--forward-delay-s", str(forward_delay_s), "--draft-delay-s",
                   str(draft_delay_s), "--max-lifetime-s", "600")
        return real(specs, log_dir=log_dir, timeout_s=120, launcher=(*LAUNCHER, *emulate))

    monkeypatch.setattr(sglang_server, "launch_servers", launch_standins)
    cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), [
        "model.arch=hf", f"model.hf_path={hf_dir}", "model.mtp_num_layers=1", "rollout.engine=sglang",
        f"rollout.server_base_port={free_port()}", "rollout.speculative.algorithm=NEXTN",
        "rollout.speculative.num_steps=2", "rollout.speculative.num_draft_tokens=3", "rollout.speculative.auto=true",
        "rollout.speculative.auto_steps=1", "data.train_batch_size=4", "data.gen_batch_size=null", "rollout.n=2",
        "actor.ppo_mini_batch_size=4", "data.max_response_length=6", "reward.overlong_buffer.len=4",
        "algorithm.filter_groups.enable=false", "trainer.sft_warmup_steps=0", "trainer.test_freq=0",
        "trainer.val_before_train=false", "trainer.logger=[tensorboard]", "trainer.total_training_steps=3",
        "trainer.save_freq=-1", f"trainer.output_dir={tmp_path}"])
    assert run(cfg) == 0
    acc = EventAccumulator(str(tmp_path / "tiny_cpu/tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return launched, {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


def _check_probe(scalars, kept: bool) -> None:
    auto = {k.removeprefix("spec_decode/auto/"): v for k, v in scalars.items() if k.startswith("spec_decode/auto/")}
    assert auto["speculative"] == {1: 1.0, 2: 0.0, 3: float(kept)}  # the mode each step's rollout ran in
    assert set(auto["tokens_per_s"]) == {1, 2}  # measured on the probe steps only
    on, off = auto["tokens_per_s"][1], auto["tokens_per_s"][2]
    assert auto["tokens_per_s_on"] == {2: pytest.approx(on)} and auto["tokens_per_s_off"] == {2: pytest.approx(off)}
    assert auto["speedup"][2] == pytest.approx(on / off, rel=1e-5) and auto["chosen"] == {2: float(kept)}
    assert (on > off) is kept
    # The step that ran with speculation reports its counters; the one without does not.
    assert 1 in scalars["spec_decode/num_requests"] and 2 not in scalars["spec_decode/num_requests"]


def test_auto_keeps_speculation_when_it_is_faster(hf_dir, tmp_path, monkeypatch):
    # A verify step costs one forward (0.1 s) and yields two tokens: twice as fast as plain decoding.
    launched, scalars = _run(hf_dir, tmp_path, monkeypatch, forward_delay_s=0.1, draft_delay_s=0.0)
    assert launched == [["NEXTN"], [None], ["NEXTN"]]  # launched, relaunched without, relaunched with
    _check_probe(scalars, kept=True)
    assert 3 in scalars["spec_decode/num_requests"]


def test_auto_drops_speculation_when_it_is_slower(hf_dir, tmp_path, monkeypatch):
    # A verify step costs 0.05 + 2 drafts x 0.1 s for two tokens: 2.5x slower than 0.05 s per token.
    launched, scalars = _run(hf_dir, tmp_path, monkeypatch, forward_delay_s=0.05, draft_delay_s=0.1)
    assert launched == [["NEXTN"], [None]]  # one relaunch: the servers stay without speculation
    _check_probe(scalars, kept=False)
    assert 3 not in scalars["spec_decode/num_requests"]
