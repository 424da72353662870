"""launch/ray_job.sh and launch/runtime_env.yaml: the submit command and its defaults, the runtime
env kept in step with pyproject.toml, and a real submission to a Ray head started on loopback.

The real submission runs one training step of the tiny recipe (no warm-up, no dynamic sampling, so a
random model can train) and a job with a bad key, which must fail."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "ray_job.sh"
VENV_BIN = Path(sys.executable).parent


def _run(*args, **env_changes):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_IP", "WORKING_DIR", "RUNTIME_ENV", "DRY_RUN", "RAY_JOB_SUBMIT_ARGS")}
    env.update(env_changes)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_dry_run_defaults_follow_the_dapo_recipe_variables():
    proc = _run("--dry-run", "configs/tiny_cpu.yaml", "actor.lr=1e-4")
    assert proc.returncode == 0, proc.stderr
    assert shlex.split(proc.stdout) == [
        "ray", "job", "submit", "--address", "http://localhost:8265", "--runtime-env",
        str(REPO / "launch" / "runtime_env.yaml"), "--working-dir", str(REPO), "--", "python", "-m",
        "megatron_dapo.ray_launch", "--config", "configs/tiny_cpu.yaml", "actor.lr=1e-4"]


def test_ray_ip_and_explicit_variables_override_the_defaults(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "r.yaml").write_text("{}\n")
    env_file = tmp_path / "env.yaml"
    env_file.write_text("env_vars: {}\n")
    argv = shlex.split(_run("configs/r.yaml", RAY_IP="10.1.2.3", WORKING_DIR=str(tmp_path), RUNTIME_ENV=str(env_file),
                            DRY_RUN="1", RAY_JOB_SUBMIT_ARGS="--no-wait --submission-id s1").stdout)
    assert argv[:9] == ["ray", "job", "submit", "--address", "http://10.1.2.3:8265", "--runtime-env", str(env_file),
                        "--working-dir", str(tmp_path)]
    assert argv[9:12] == ["--no-wait", "--submission-id", "s1"]
    assert "http://10.9.9.9:8265" in _run("--dry-run", "configs/tiny_cpu.yaml", RAY_ADDRESS="http://10.9.9.9:8265",
                                          RAY_IP="10.1.2.3").stdout


def test_a_relative_output_dir_is_named_since_the_job_runs_in_a_temporary_copy(tmp_path):
    warned = _run("--dry-run", "configs/tiny_cpu.yaml")
    assert warned.returncode == 0 and "trainer.output_dir=runs is relative" in warned.stderr
    shared = _run("--dry-run", "configs/tiny_cpu.yaml", f"trainer.output_dir={tmp_path}")
    assert shared.returncode == 0 and shared.stderr == ""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "r.yaml").write_text(f"trainer:\n  output_dir: {tmp_path}/runs\n")
    assert _run("--dry-run", "configs/r.yaml", WORKING_DIR=str(tmp_path)).stderr == ""


@pytest.mark.parametrize("args, env, message", [
    ([], {}, "usage: launch/ray_job.sh"),
    (["configs/missing.yaml"], {}, "recipe configs/missing.yaml not found under WORKING_DIR"),
    (["configs/tiny_cpu.yaml"], {"RUNTIME_ENV": "/nonexistent.yaml"}, "RUNTIME_ENV=/nonexistent.yaml not found"),
])
def test_bad_arguments_exit_2_with_the_reason(args, env, message):
    proc = _run("--dry-run", *args, **env)
    assert proc.returncode == 2 and message in proc.stderr


def _requirement_names(specs):
    return {re.split(r"[<>=!~\[ ]", s, maxsplit=1)[0].lower(): s for s in specs}


def test_runtime_env_pip_list_matches_pyproject_minus_the_image_stack():
    runtime_env = yaml.safe_load((REPO / "launch" / "runtime_env.yaml").read_text())
    assert set(runtime_env) == {"env_vars", "pip", "excludes"}
    assert all(isinstance(v, str) for v in runtime_env["env_vars"].values())       # Ray requires strings
    assert runtime_env["env_vars"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    project = {name: spec.split("#")[0].strip() for name, spec in _requirement_names(pyproject).items()}
    for from_image in ("torch", "triton", "ray"):
        project.pop(from_image)
    assert _requirement_names(runtime_env["pip"]["packages"]) == project
    assert "/models/" in runtime_env["excludes"] and "/data/" not in runtime_env["excludes"]


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _session_pids(sid):
    """Processes in session `sid` (the session our `ray start` leads), from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[3]) == sid:
                pids.append(int(entry))
    return pids


@contextlib.contextmanager
def _head(*resources: str, dashboard: bool = True):
    """A Ray head on loopback in its own session, with `resources` (e.g. --num-gpus=2: declared, not real);
    yields (the dashboard's address or the GCS address without one, its private HOME). Stopped by pid
    (never `ray stop`, which would end every Ray instance of this user on the machine)."""
    gcs, dash, client = _free_ports(3)
    temp = tempfile.mkdtemp(prefix="rayjob", dir="/tmp")      # short: Ray's socket paths have a length limit
    cmd = [str(VENV_BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
           f"--ray-client-server-port={client}", *resources, f"--temp-dir={temp}", "--disable-usage-stats", "--block"]
    cmd += ["--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--include-dashboard=true"] if dashboard else [
        "--include-dashboard=false"]
    # Ray 2.60 reads a token from ~/.ray/auth_token when one exists (another Ray run may leave one):
    # the head and the submitting CLI share a private HOME so they agree.
    env = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ['PATH']}", OMP_NUM_THREADS="1", HOME=temp)
    log = open(Path(temp) / "head.log", "w")
    head = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", dash if dashboard else gcs), timeout=1).close()
                break
            except OSError:
                assert head.poll() is None, (Path(temp) / "head.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "Ray head did not come up in 120 s"
                time.sleep(1)
        yield (f"http://127.0.0.1:{dash}" if dashboard else f"127.0.0.1:{gcs}"), temp
    finally:
        head.send_signal(signal.SIGTERM)                     # `ray start --block` stops its processes
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        for pid in _session_pids(head.pid):                  # stragglers of our session only
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def ray_head():
    """A three-CPU Ray head with its dashboard (the job server)."""
    with _head("--num-cpus=3") as head:
        yield head


def _job_env(ray_head, tmp_path, **job_env_vars) -> dict:
    """ray_job.sh's environment for a submission to the local head: a runtime env of environment variables
    only (no pip, no network), OMP_NUM_THREADS=1 plus `job_env_vars`."""
    address, home = ray_head
    runtime_env = tmp_path / "runtime_env.yaml"
    runtime_env.write_text(yaml.safe_dump({"env_vars": {"OMP_NUM_THREADS": "1", **job_env_vars}}))
    return dict(RAY_ADDRESS=address, RUNTIME_ENV=str(runtime_env), RAY=str(VENV_BIN / "ray"), PYTHON=sys.executable,
                HOME=home)


@pytest.mark.slow
def test_job_submitted_to_a_local_head_runs_the_recipe_and_a_failing_job_fails(ray_head, tmp_path):
    env = _job_env(ray_head, tmp_path)
    ok = _run("configs/tiny_cpu.yaml", "trainer.experiment_name=ray_job_test", "trainer.total_training_steps=1",
              "trainer.sft_warmup_steps=0", "algorithm.filter_groups.enable=false", "data.gen_batch_size=null",
              "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.logger=[console]",
              f"trainer.output_dir={tmp_path / 'runs'}", **env)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert "done: 1 steps" in ok.stdout and "succeeded" in ok.stdout + ok.stderr
    assert (tmp_path / "runs/ray_job_test/ckpt/global_step_1/trainer_state.pt").exists()
    bad = _run("configs/tiny_cpu.yaml", "trainer.no_such_key=1", **env)
    assert bad.returncode != 0
    assert "trainer.no_such_key" in bad.stdout + bad.stderr


@pytest.mark.slow
def test_a_two_node_recipe_runs_as_one_torchrun_agent_per_placement_bundle(ray_head, tmp_path):
    """trainer.nnodes=2: two torchrun agents placed by Ray (PACK: both "nodes" on this machine), one gloo
    rank each, rendezvous hosted by bundle 0's agent; the step trains on both ranks and checkpoints."""
    env = _job_env(ray_head, tmp_path, MEGATRON_DAPO_RAY_PLACEMENT="PACK")
    ok = _run("configs/tiny_cpu.yaml", "trainer.nnodes=2", "trainer.n_gpus_per_node=1",
              "trainer.experiment_name=ray_two", "trainer.total_training_steps=1", "trainer.sft_warmup_steps=0",
              "algorithm.filter_groups.enable=false", "data.gen_batch_size=null", "trainer.test_freq=0",
              "trainer.val_before_train=false", "trainer.logger=[console]", f"trainer.output_dir={tmp_path / 'runs'}",
              **env)
    out = ok.stdout + ok.stderr
    assert ok.returncode == 0, out[-4000:]
    assert re.search(r"ray_launch: 2 node\(s\) x 1 rank\(s\), rendezvous at [0-9.]+:\d+ \(PACK\)", out), out[-3000:]
    # both agents ran (the trainer checks that its world is nnodes x n_gpus_per_node = 2 processes)
    assert "[node 0]" in out and "[node 1]" in out and "done: 1 steps" in out
    assert (tmp_path / "runs/ray_two/ckpt/global_step_1/manifest.json").exists()


def test_the_job_package_holds_every_tracked_file():
    """Ray packs WORKING_DIR minus .gitignore's patterns, applied to every file (tracked or not): an
    unanchored `models/` there once dropped megatron_dapo/models from every job, and the job then imported
    whatever copy of the package the cluster's image had, or failed."""
    from ray._private.thirdparty.pathspec import PathSpec

    spec = PathSpec.from_lines("gitwildmatch", (REPO / ".gitignore").read_text().splitlines())
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    assert any(f.startswith("megatron_dapo/models/") for f in tracked)
    assert [f for f in tracked if spec.match_file(f)] == []


def _agents(codes: list[int]):
    """Fake Ray calls over agents that end in the order given, with those statuses."""
    from megatron_dapo.ray_launch import _wait_for_agents

    order, cancelled = list(range(len(codes))), []
    running = {f"ref{i}": i for i in order}

    def wait(refs, num_returns):
        return [f"ref{order.pop(0)}"], None

    status = _wait_for_agents(running, stopped=75, cancel=lambda ref, force: cancelled.append(ref), wait=wait,
                              get=lambda ref: codes[int(ref[3:])])
    return status, cancelled


def test_a_failed_node_stops_the_others_but_a_node_stopping_on_a_signal_does_not():
    assert _agents([0, 3, 0]) == (3, ["ref2"])          # a crash: the rest are cancelled at once
    assert _agents([75, 75, 75]) == (75, [])            # a stop signal: every node finishes its checkpoint
    assert _agents([75, 9, 0]) == (9, ["ref2"])         # a crash while the others stop still ends the job
    assert _agents([0, 0]) == (0, [])


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_two_agents_leave_the_gpus_to_the_colocated_servers_rank_0_places_beside_them(tmp_path):
    """ray_launch on a head declaring 2 GPUs (nothing real: placement only), 2 nodes x 1 rank (PACK): the
    agents reserve no GPU and pass RAY_ADDRESS on, so rank 0 places its 2 colocated servers (stand-ins in
    memory-saver mode, through the trainer's launch path) on the 2 GPUs and the step trains against them.
    (With each agent holding its node's GPUs the servers' placement group waited 30 minutes and failed.)"""
    from tests.trainer.test_cluster_in_a_box import _hf_model
    from tests.trainer.test_colocated_lifecycle import SHIM

    hf_dir = _hf_model(tmp_path, "dense")
    with _head("--num-cpus=4", "--num-gpus=2", dashboard=False) as (gcs, home):
        env = dict(os.environ, RAY_ADDRESS=gcs, HOME=home, MEGATRON_DAPO_RAY_PLACEMENT="PACK", OMP_NUM_THREADS="1",
                   PYTHONPATH=str(REPO))
        r = subprocess.run([sys.executable, "-m", "megatron_dapo.ray_launch", "--config", "configs/tiny_cpu.yaml",
                            "trainer.nnodes=2", "trainer.n_gpus_per_node=1", "rollout.engine=sglang", "model.arch=hf",
                            f"model.hf_path={hf_dir}", f"rollout.sglang_python={sys.executable}",
                            f"rollout.server_env=[PYTHONPATH={SHIM}:{REPO}]", "rollout.server_device=cpu",
                            f"rollout.server_base_port={_free_ports(1)[0]}", "trainer.experiment_name=ray_servers",
                            "trainer.total_training_steps=1", "trainer.sft_warmup_steps=0", "data.train_batch_size=4",
                            "rollout.n=4", "actor.ppo_mini_batch_size=2", "data.max_response_length=6",
                            "reward.overlong_buffer.len=4", "algorithm.filter_groups.enable=false",
                            "data.gen_batch_size=null", "trainer.test_freq=0", "trainer.val_before_train=false",
                            "trainer.logger=[console]", f"trainer.output_dir={tmp_path / 'runs'}"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    assert "[node 0]" in out and "[node 1]" in out and "done: 1 steps" in out, out[-3000:]
    logs = sorted((tmp_path / "runs/ray_servers/sglang").glob("*.log"))
    assert len(logs) == 2 and all("stand-in listening" in p.read_text() for p in logs), logs


def test_an_agent_gets_ray_address_and_the_node_s_gpus():
    from megatron_dapo.ray_launch import agent_environment

    env = agent_environment({"CUDA_VISIBLE_DEVICES": "", "PATH": "/bin"}, "10.0.0.1:6379")
    assert env == {"PATH": "/bin", "RAY_ADDRESS": "10.0.0.1:6379"}  # Ray's empty value for a zero-GPU task dropped
    assert agent_environment({"CUDA_VISIBLE_DEVICES": "0,1"}, "a:1")["CUDA_VISIBLE_DEVICES"] == "0,1"
