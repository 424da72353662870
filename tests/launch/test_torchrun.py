"""launch/torchrun.sh: one node, standalone rendezvous, the config's node/GPU counts set from NPROC."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "torchrun.sh"
VENV_BIN = str(Path(sys.executable).parent)


def _run(*args, path_prefix=None, **env_changes):
    env = {k: v for k, v in os.environ.items()
           if k not in ("NPROC", "DRY_RUN", "TORCHRUN", "PYTHON", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    env.update(env_changes)
    if path_prefix:
        env["PATH"] = f"{path_prefix}:{env['PATH']}"
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_dry_run_command_sets_nodes_and_ranks_from_nproc():
    proc = _run("--dry-run", "--config", "configs/tiny_cpu.yaml", "actor.lr=1e-4", NPROC="3")
    assert proc.returncode == 0, proc.stderr
    assert shlex.split(proc.stdout) == [
        "python", "-m", "megatron_dapo.torchrun", "--standalone", "--local-addr=127.0.0.1", "--nnodes=1",
        "--nproc_per_node=3", "-m", "megatron_dapo.train", "--config", "configs/tiny_cpu.yaml", "actor.lr=1e-4",
        "trainer.nnodes=1", "trainer.n_gpus_per_node=3"]


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


def test_every_socket_of_a_two_rank_run_listens_on_loopback_only():
    """torch's stores listen on every interface (plain torchrun: its two stores on '::'); the launcher's
    stores (megatron_dapo/torchrun.py) and the ranks' gloo sockets listen on loopback. Sampled every 0.2 s
    over a whole 2-step run, from every process of the launch."""
    import time

    import psutil

    args = ["--config", "configs/tiny_cpu.yaml", "trainer.total_training_steps=2", "trainer.sft_warmup_steps=0",
            "algorithm.filter_groups.metric=seq_reward", "data.max_response_length=6", "reward.overlong_buffer.len=4",
            "data.train_batch_size=4", "data.gen_batch_size=6", "rollout.n=4", "actor.ppo_mini_batch_size=2",
            "trainer.test_freq=0", "trainer.logger=[tensorboard]", "trainer.save_freq=-1"]
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHRUN", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    env.update(NPROC="2", PYTHON=sys.executable, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.Popen(["bash", str(SCRIPT), *args, f"trainer.output_dir={out}"], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        me, listening, deadline = psutil.Process(proc.pid), {}, time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                tree = [me, *me.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            for p in tree:
                try:
                    listening.update({(c.laddr.ip, c.laddr.port): " ".join(p.cmdline()[1:4])
                                      for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN})
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            time.sleep(0.2)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    stores = [a for a, cmd in listening.items() if "megatron_dapo.torchrun" in cmd]
    assert len(stores) == 2, listening  # the rendezvous store and the one shared with the ranks
    assert len(listening) > 2  # the ranks' own (gloo) sockets were seen too
    assert {ip for ip, _ in listening} <= {"127.0.0.1", "::1"}, listening
