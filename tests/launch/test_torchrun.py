"""launch/torchrun.sh: one node, standalone rendezvous, the config's node/GPU counts set from NPROC."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "torchrun.sh"
VENV_BIN = str(Path(sys.executable).parent)


def _run(*args, path_prefix=None, **env_changes):
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "DRY_RUN", "TORCHRUN")}
    env.update(env_changes)
    if path_prefix:
        env["PATH"] = f"{path_prefix}:{env['PATH']}"
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_dry_run_command_sets_nodes_and_ranks_from_nproc():
    proc = _run("--dry-run", "--config", "configs/tiny_cpu.yaml", "actor.lr=1e-4", NPROC="3")
    assert proc.returncode == 0, proc.stderr
    assert shlex.split(proc.stdout) == [
        "torchrun", "--standalone", "--nnodes=1", "--nproc_per_node=3", "-m", "megatron_dapo.train",
        "--config", "configs/tiny_cpu.yaml", "actor.lr=1e-4", "trainer.nnodes=1", "trainer.n_gpus_per_node=3"]


def test_nproc_defaults_to_the_gpus_nvidia_smi_lists(tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/usr/bin/env bash\nfor i in 0 1 2 3; do echo \"GPU $i: NVIDIA H800 (UUID: GPU-$i)\"; done\n")
    fake.chmod(0o755)
    proc = _run("--dry-run", "--config", "configs/tiny_cpu.yaml", path_prefix=tmp_path)
    assert "--nproc_per_node=4" in proc.stdout and "trainer.n_gpus_per_node=4" in proc.stdout


def test_overriding_the_launch_shape_or_a_bad_nproc_is_an_error():
    proc = _run("--dry-run", "--config", "configs/tiny_cpu.yaml", "trainer.n_gpus_per_node=2", NPROC="1")
    assert proc.returncode == 2 and "trainer.n_gpus_per_node=2: set by this script from NPROC" in proc.stderr
    proc = _run("--dry-run", NPROC="0")
    assert proc.returncode == 2 and "NPROC must be a positive integer, got '0'" in proc.stderr


def test_two_local_ranks_each_resolve_the_config_with_two_processes():
    proc = _run("--config", "configs/tiny_cpu.yaml", "--print-config", NPROC="2",
                TORCHRUN=os.path.join(VENV_BIN, "torchrun"), OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Each rank prints its config (~3 KB) in one write, below the pipe's 4 KiB atomic-write size.
    docs = [d for d in proc.stdout.split("data:\n") if d.strip()]
    assert len(docs) == 2                                     # one resolved config per rank
    for doc in docs:
        trainer = yaml.safe_load("data:\n" + doc)["trainer"]
        assert (trainer["nnodes"], trainer["n_gpus_per_node"]) == (1, 2)
