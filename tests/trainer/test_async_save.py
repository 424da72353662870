"""trainer.async_save: the shards are written by a background process while training goes on, and the
checkpoint is completed later (trainer/checkpoint.py PendingSave). Each asynchronous checkpoint holds
exactly the state of its step, as the synchronous one does, although later steps ran while it was being
written; and a kill before it completes leaves the previous checkpoint as the last good one, from which
the run resumes to the same end."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_dapo.trainer import faults
from megatron_dapo.trainer.checkpoint import LATEST, verify_checkpoint
from tests.standin import free_port
from tests.trainer.test_fit import TINY as FIT_TINY

ROOT = pathlib.Path(__file__).resolve().parents[2]
# test_fit's tiny run, 4 steps, a checkpoint after each, all kept
TINY = [*FIT_TINY, "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.total_training_steps=4",
        "trainer.save_freq=1", "trainer.max_ckpt_to_keep=4", "trainer.experiment_name=a"]


def _train(out: pathlib.Path, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (faults.ENV, faults.ONCE_ENV, faults.SIGNAL_ENV)}
    env["OMP_NUM_THREADS"] = "1"
    if fault:
        env[faults.ENV] = fault
    return subprocess.run([sys.executable, "-m", "megatron_dapo.train", "--config", "configs/tiny_cpu.yaml", *TINY,
                           f"trainer.output_dir={out}", *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def _tensors(step_dir: pathlib.Path, tmp_path: pathlib.Path) -> dict:
    """Every tensor of a checkpoint's model + optimizer, by name (read without a model)."""
    out = tmp_path / f"{step_dir.parent.parent.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir / "model"), str(out))
    flat = {}

    def walk(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif isinstance(v, torch.Tensor):
                flat[prefix + k] = v

    walk(torch.load(out, weights_only=False))  # a file this test just wrote
    return flat


def _same_checkpoint(a: pathlib.Path, b: pathlib.Path, tmp_path: pathlib.Path) -> None:
    ta, tb = _tensors(a, tmp_path), _tensors(b, tmp_path)
    assert ta.keys() == tb.keys() and len(ta) > 20
    different = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert not different, f"{a} and {b} differ in {different[:5]}"
    sa, sb = (torch.load(d / "trainer_state.pt", weights_only=True) for d in (a, b))
    assert sa["global_step"] == sb["global_step"] and sa["sampler"] == sb["sampler"]
    assert sa["loss_history"] == sb["loss_history"]


def test_each_asynchronous_checkpoint_holds_its_steps_state_and_a_kill_before_it_completes_resumes(tmp_path):
    sync, background, killed = tmp_path / "sync", tmp_path / "async", tmp_path / "killed"
    r = _train(sync)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _train(background, "trainer.async_save=true")
    assert r.returncode == 0, r.stderr[-3000:]
    for step in (1, 2, 3, 4):
        path = background / "a/ckpt" / f"global_step_{step}"
        assert verify_checkpoint(str(path)) is None
        _same_checkpoint(sync / "a/ckpt" / f"global_step_{step}", path, tmp_path)

    # SIGKILL once step 3's writers are done, before its checkpoint is completed (step 4 has trained meanwhile)
    r = _train(killed, "trainer.async_save=true", fault="checkpoint_write:3")
    assert r.returncode == -9, r.stderr[-3000:]
    ckpt = killed / "a/ckpt"
    assert (ckpt / LATEST).read_text() == "2" and (ckpt / "tmp_global_step_3").is_dir()
    assert not (ckpt / "global_step_3").exists()
    r = _train(killed, "trainer.async_save=true")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "global_step_2 at step 2" in r.stderr
    assert not (ckpt / "tmp_global_step_3").exists()
    _same_checkpoint(sync / "a/ckpt/global_step_4", ckpt / "global_step_4", tmp_path)


@pytest.mark.multiproc
def test_at_tensor_parallel_2_the_asynchronous_checkpoints_equal_the_synchronous_ones(tmp_path):
    """Two ranks, each writing its own shards in its own background writer: the ranks agree when every
    writer is done (PendingSave.done, a collective) and complete the checkpoint together."""
    runs = {}
    for mode in ("sync", "async"):
        out = tmp_path / mode
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), "-m", "megatron_dapo.train", "--config", "configs/tiny_cpu.yaml",
               *TINY, "trainer.total_training_steps=3", "trainer.n_gpus_per_node=2",
               "parallel.tensor_model_parallel_size=2", f"trainer.output_dir={out}",
               f"trainer.async_save={mode == 'async'}"]
        r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        runs[mode] = out / "a/ckpt"
    for step in (1, 2, 3):
        path = runs["async"] / f"global_step_{step}"
        assert len(list((path / "model").glob("__1_*.distcp"))) >= 1  # rank 1 wrote shards of its own
        assert verify_checkpoint(str(path)) is None
        _same_checkpoint(runs["sync"] / f"global_step_{step}", path, tmp_path)
