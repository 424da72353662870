"""The whole sync trainer under data and tensor parallelism (2 gloo ranks) reproduces the single-process
run: same prompts per step, same losses and gradient norms."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.standin import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARGS = ["--config", "configs/tiny_cpu.yaml", "trainer.total_training_steps=2", "trainer.sft_warmup_steps=0",
        "algorithm.filter_groups.metric=seq_reward", "data.max_response_length=6", "reward.overlong_buffer.len=4",
        "data.train_batch_size=4", "data.gen_batch_size=6", "rollout.n=4", "actor.ppo_mini_batch_size=2",
        "trainer.test_freq=0", "trainer.logger=[tensorboard]", "trainer.save_freq=-1"]


def _train(out: pathlib.Path, *extra: str, nproc: int = 1, port: int = 0) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launcher = [sys.executable, "-m", "megatron_dapo.train"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
        "--master_port", str(port), "-m", "megatron_dapo.train"]
    cmd = [*launcher, *ARGS, f"trainer.output_dir={out}", f"trainer.rollout_data_dir={out}/dumps", *extra]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    acc = EventAccumulator(str(out / "tiny_cpu/tb"), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {t: {e.step: e.value for e in acc.Scalars(t)} for t in ("actor/pg_loss", "actor/grad_norm",
                                                                           "rollout_corr/log_prob_abs_diff")}
    groups = {s: [json.loads(x)["group"] for x in (out / f"dumps/step_{s}.jsonl").read_text().splitlines()]
              for s in (1, 2)}
    return {"scalars": scalars, "groups": groups}


@pytest.mark.multiproc
def test_dp2_and_tp2_training_runs_equal_the_single_process_run(tmp_path):
    single = _train(tmp_path / "single")
    for name, extra, port in (("dp2", ["trainer.n_gpus_per_node=2"], free_port()),
                              ("tp2", ["trainer.n_gpus_per_node=2", "parallel.tensor_model_parallel_size=2"],
                               free_port())):
        got = _train(tmp_path / name, *extra, nproc=2, port=port)
        assert got["groups"] == single["groups"], name
        _assert_same_losses(got, single, name)


def _assert_same_losses(got: dict, single: dict, name: str) -> None:
    for tag in ("actor/pg_loss", "actor/grad_norm"):
        for step, value in single["scalars"][tag].items():
            assert got["scalars"][tag][step] == pytest.approx(value, rel=1e-4, abs=1e-6), (name, tag, step)


@pytest.mark.multiproc
def test_dp2_on_policy_update_gathers_its_log_probs_like_the_single_process_run(tmp_path):
    """One mini-batch per step: old_log_prob comes from the update's forward, whose rows are split over the
    DP ranks; the gathered log-probs must cover every row (a missing row would show as a large mismatch
    against the rollout log-probs)."""
    on_policy = "actor.ppo_mini_batch_size=4"
    single = _train(tmp_path / "single", on_policy)
    got = _train(tmp_path / "dp2", on_policy, "trainer.n_gpus_per_node=2", nproc=2,
                 port=free_port())
    assert got["groups"] == single["groups"]
    _assert_same_losses(got, single, "dp2")
    for run in (single, got):
        assert all(v < 1e-5 for v in run["scalars"]["rollout_corr/log_prob_abs_diff"].values())


@pytest.mark.multiproc
def test_a_signal_to_one_rank_stops_both_at_the_same_step_with_a_checkpoint_and_the_run_resumes(tmp_path):
    """SIGUSR1 (what the SLURM script forwards before the time limit) reaches rank 1 only, during step 1's
    update: the ranks agree at the step's end (trainer/preemption.py), write step 1's checkpoint, and
    both exit with trainer.preemption_exit_code (torchrun reports a failed worker); the restarted job
    resumes at step 2 and finishes."""
    from megatron_dapo.trainer import faults

    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_DAPO_FAULT")}
    env.update(OMP_NUM_THREADS="1", **{faults.ENV: "after_update_actor:1", faults.SIGNAL_ENV: "SIGUSR1",
                                       faults.RANK_ENV: "1"})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "megatron_dapo.train", *ARGS,
           "trainer.total_training_steps=3", "trainer.n_gpus_per_node=2", f"trainer.output_dir={tmp_path}"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "exitcode  : 75" in out, out[-4000:]
    assert out.count("SIGUSR1 received: stopped after a checkpoint at step 1; exiting with "
                     "trainer.preemption_exit_code=75") == 2, out[-4000:]
    ckpt = tmp_path / "tiny_cpu/ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    env = {k: v for k, v in env.items() if not k.startswith("MEGATRON_DAPO_FAULT")}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and f"resumed from {ckpt}/global_step_1 at step 1" in out, out[-4000:]
    acc = EventAccumulator(str(tmp_path / "tiny_cpu/tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert sorted(e.step for e in acc.Scalars("actor/pg_loss")) == [1, 2, 3]
