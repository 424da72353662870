"""launch/slurm/dapo_16x8_h800.sbatch: the dry run per node (16 nodes x 8 ranks, one rendezvous
endpoint, one Ray head and 15 workers, per-node logs), argument checks, and the real launch path
with stand-ins for srun / ray / torchrun / python that record what they were asked to do.

`scontrol` and `getent` are replaced by small scripts on PATH: the node list is an explicit list of
16 host names, and node h800-NN resolves to 10.0.0.NN."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "launch" / "slurm" / "dapo_16x8_h800.sbatch"
NODES = [f"h800-{i:02d}" for i in range(1, 17)]
HEAD_IP = "10.0.0.1"

SCONTROL = """#!/usr/bin/env bash
# scontrol show hostnames a,b,c -> one name per line (the test gives explicit lists, no ranges);
# scontrol requeue ID is recorded
if [[ "$1" == requeue ]]; then echo "scontrol requeue $2" >>"$FAKE_RECORD"; exit 0; fi
[[ "$1 $2" == "show hostnames" ]] || { echo "fake scontrol: unexpected $*" >&2; exit 1; }
tr ',' '\\n' <<<"$3"
"""
GETENT = """#!/usr/bin/env bash
# getent hosts h800-NN -> 10.0.0.NN
[[ "$1" == hosts && "$2" =~ ^h800-0*([0-9]+)$ ]] || exit 2
echo "10.0.0.${BASH_REMATCH[1]} $2"
"""
# Stand-ins for the real run: each records its arguments; `ray start --block` waits to be killed,
# a trainer runs FAKE_TRAINER_SLEEP_<node> (else FAKE_TRAINER_SLEEP, default 0) seconds, then exits
# with the status named in FAKE_TRAINER_RC_<node> (default 0). Like srun, a trainer step passes SIGTERM
# on to its task (here the sleep) and ends with it. With FAKE_PIDS set, the pid of every step's
# long-lived process (Ray's, a trainer's task) is appended to that file.
SRUN = """#!/usr/bin/env bash
node=""
for a in "$@"; do [[ "$a" == --nodelist=* ]] && node=${a#--nodelist=}; done
while [[ "$1" == --* ]]; do shift; done
echo "srun on $node: $*" >>"$FAKE_RECORD"
prog=$1; [[ " $* " == *" megatron_dapo.torchrun "* ]] && prog=torchrun
echo "output of $prog on $node"
if [[ " $* " == *" --block "* ]]; then
    if [[ -n "${FAKE_PIDS:-}" ]]; then echo "$$" >>"$FAKE_PIDS"; fi
    exec sleep 60
fi
if [[ "$prog" == torchrun ]]; then
    sleep_var="FAKE_TRAINER_SLEEP_${node//-/_}"
    sleep "${!sleep_var:-${FAKE_TRAINER_SLEEP:-0}}" & task=$!
    if [[ -n "${FAKE_PIDS:-}" ]]; then echo "$task" >>"$FAKE_PIDS"; fi
    trap 'echo "srun on $node: SIGTERM, passed on to the task"; kill -TERM $task; wait $task; exit 143' TERM
    wait $task
fi
rc_var="FAKE_TRAINER_RC_${node//-/_}"
exit "${!rc_var:-0}"
"""
# The wait for Ray: like the real one, it returns once $4 `ray start` steps are up (here: recorded).
PYTHON = """#!/usr/bin/env bash
if [[ "$1" == -m && "$2" == megatron_dapo.train ]]; then  # the preflight: recorded, FAKE_CHECK_RC its status
    echo "preflight: ${*:3}" >>"$FAKE_RECORD"
    [[ -n "${FAKE_CHECK_RC:-}" ]] && { echo "preflight: data.train_files: data/x.parquet: no such file" >&2; exit "$FAKE_CHECK_RC"; }
    echo "preflight: ok"; exit 0
fi
deadline=$((SECONDS + 10))
until (( $( { cat "$FAKE_RECORD" 2>/dev/null || true; } | grep -c "ray start") >= $4 )); do
    (( SECONDS < deadline )) || { echo "fake python: no $4 ray nodes" >&2; exit 1; }
    sleep 0.05
done
echo "python $4 nodes at $3" >>"$FAKE_RECORD"
"""


# `apptainer exec [--opt [value]] IMAGE CMD...`: recorded, then CMD runs here (no container).
APPTAINER = """#!/usr/bin/env bash
echo "apptainer $*" >>"$FAKE_RECORD"
shift
while [[ "$1" == --* ]]; do case "$1" in --bind|--pwd) shift 2 ;; *) shift ;; esac; done
shift
exec "$@"
"""


@pytest.fixture
def fake_bin(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {"scontrol": SCONTROL, "getent": GETENT, "srun": SRUN, "fake-python": PYTHON,
                       "apptainer": APPTAINER}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _run(fake_bin, tmp_path, *args, **env_changes):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_", "RAY_"))}
    env.update(PATH=f"{fake_bin}:{env['PATH']}", SLURM_JOB_ID="777", SLURM_JOB_NODELIST=",".join(NODES),
               SLURM_JOB_NUM_NODES="16", SLURM_GPUS_ON_NODE="8", SLURM_CPUS_ON_NODE="96",
               SLURM_SUBMIT_DIR=str(REPO), FAKE_RECORD=str(tmp_path / "record.txt"),
               PYTHON=str(fake_bin / "fake-python"))
    env.update({k: v for k, v in env_changes.items() if v is not None})
    for k in [k for k, v in env_changes.items() if v is None]:
        env.pop(k, None)
    return subprocess.run(["bash", str(SBATCH), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)


HEADER = re.compile(r"^\[node (\d+)/(\d+) (\S+)\] node_rank=(\d+) nproc_per_node=(\d+) rdzv_endpoint=(\S+) "
                    r"ray_address=(\S+) log=(\S+)$")
COMMAND = re.compile(r"^\[node (\d+)/16 (\S+)\] (ray-head|ray-worker|trainer): (.*) >> (\S+) 2>&1$")


def _commands(stdout):
    """{role: [(node index, node name, argv, log)]} from the dry-run lines."""
    out = {"ray-head": [], "ray-worker": [], "trainer": []}
    for line in stdout.splitlines():
        m = COMMAND.match(line)
        if m:
            out[m.group(3)].append((int(m.group(1)), m.group(2), shlex.split(m.group(4)), m.group(5)))
    return out


def test_dry_run_prints_every_node_with_rank_rendezvous_and_ray_address(fake_bin, tmp_path):
    proc = _run(fake_bin, tmp_path, "--dry-run", "actor.lr=2e-6")
    assert proc.returncode == 0, proc.stderr
    headers = [HEADER.match(line).groups() for line in proc.stdout.splitlines() if HEADER.match(line)]
    assert [(int(i), int(n), name, int(rank)) for i, n, name, rank, *_ in headers] == \
        [(i, 16, NODES[i], i) for i in range(16)]
    assert {(h[4], h[5], h[6]) for h in headers} == {("8", f"{HEAD_IP}:29500", f"{HEAD_IP}:6379")}
    assert [h[7] for h in headers] == [f"logs/777/node-{n}.log" for n in NODES]
    assert "0.0.0.0" not in proc.stdout
    # ran nothing but the preflight (a check in this process's files, no job step)
    record = (tmp_path / "record.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in record] == ["preflight"] and not (REPO / "logs" / "777").exists()


def test_dry_run_ray_head_on_first_node_workers_on_the_rest(fake_bin, tmp_path):
    cmds = _commands(_run(fake_bin, tmp_path, "--dry-run").stdout)
    ((idx, node, argv, log),) = cmds["ray-head"]
    assert (idx, node, log) == (0, NODES[0], f"logs/777/node-{NODES[0]}.log")
    ray = argv[argv.index("ray"):]
    assert ray == ["ray", "start", "--head", f"--node-ip-address={HEAD_IP}", "--port=6379",
                   "--dashboard-host=127.0.0.1", "--dashboard-port=8265", "--num-gpus=8",
                   "--disable-usage-stats", "--block"]
    assert f"--nodelist={NODES[0]}" in argv and "--overlap" in argv
    assert [(i, n) for i, n, _, _ in cmds["ray-worker"]] == list(enumerate(NODES))[1:]
    for _, node, argv, _ in cmds["ray-worker"]:
        assert argv[argv.index("ray"):] == ["ray", "start", f"--address={HEAD_IP}:6379", "--num-gpus=8",
                                            "--disable-usage-stats", "--block"]
        assert f"--nodelist={node}" in argv


def test_dry_run_trainer_per_node_is_torchrun_c10d_on_the_head(fake_bin, tmp_path):
    cmds = _commands(_run(fake_bin, tmp_path, "--dry-run", "actor.lr=2e-6", "trainer.save_freq=5").stdout)
    assert [(i, n) for i, n, _, _ in cmds["trainer"]] == list(enumerate(NODES))
    for _, node, argv, log in cmds["trainer"]:
        assert argv[:1] == ["srun"] and f"--nodelist={node}" in argv and "--cpus-per-task=96" in argv
        assert argv[argv.index("megatron_dapo.torchrun") - 1:] == [
            "-m", "megatron_dapo.torchrun", "--nnodes=16", "--nproc_per_node=8", "--rdzv_backend=c10d",
            f"--rdzv_endpoint={HEAD_IP}:29500", "--rdzv_id=777", "--max_restarts=0", "-m", "megatron_dapo.train",
            "--config", "configs/dapo_qwen2.5_32b.yaml", "trainer.nnodes=16", "trainer.n_gpus_per_node=8",
            "actor.lr=2e-6", "trainer.save_freq=5"]
        assert log == f"logs/777/node-{node}.log"


def test_dry_run_env_var_equals_flag_and_overrides_apply(fake_bin, tmp_path):
    flag = _run(fake_bin, tmp_path, "--dry-run").stdout
    assert _run(fake_bin, tmp_path, DRY_RUN="1").stdout == flag
    custom = _run(fake_bin, tmp_path, DRY_RUN="1", RECIPE="configs/dapo_qwen3_30b_a3b.yaml", NPROC_PER_NODE="4",
                  HEAD_IP="192.168.7.7", RDZV_PORT="29600", LOG_DIR="mylogs")
    cmds = _commands(custom.stdout)
    argv = cmds["trainer"][5][2]
    assert "configs/dapo_qwen3_30b_a3b.yaml" in argv and "--nproc_per_node=4" in argv
    assert "--rdzv_endpoint=192.168.7.7:29600" in argv and "trainer.n_gpus_per_node=4" in argv
    assert "--num-gpus=4" in cmds["ray-head"][0][2] and cmds["trainer"][5][3] == f"mylogs/node-{NODES[5]}.log"


@pytest.mark.parametrize("args, env, message", [
    (["trainer.nnodes=4"], {}, "trainer.nnodes=4: the node and GPU counts come from the allocation"),
    ([], {"SLURM_JOB_NODELIST": None}, "not inside a Slurm allocation"),
    ([], {"SLURM_JOB_NUM_NODES": "8"}, "SLURM_JOB_NUM_NODES=8 but SLURM_JOB_NODELIST expands to 16 hosts"),
    ([], {"RECIPE": "configs/missing.yaml"}, "RECIPE=configs/missing.yaml not found"),
    ([], {"NPROC_PER_NODE": "eight"}, "NPROC_PER_NODE must be a positive integer"),
    ([], {"SLURM_JOB_NODELIST": "node-x"}, "cannot resolve head node 'node-x'"),
])
def test_bad_launch_settings_exit_2_naming_the_setting(fake_bin, tmp_path, args, env, message):
    env = {"SLURM_JOB_NUM_NODES": None if "SLURM_JOB_NODELIST" in env else "16", **env}
    proc = _run(fake_bin, tmp_path, "--dry-run", *args, **env)
    assert proc.returncode != 0 and message in proc.stderr


def test_real_launch_starts_ray_then_trainers_logs_per_node_and_returns_trainer_status(fake_bin, tmp_path):
    nodes = NODES[:3]
    proc = _run(fake_bin, tmp_path, "x.y=1", SLURM_JOB_NODELIST=",".join(nodes), SLURM_JOB_NUM_NODES="3",
                PYTHON=str(fake_bin / "fake-python"), LOG_DIR=str(tmp_path / "logs" / "777"),
                **{"FAKE_TRAINER_RC_h800_02": "3"})
    assert proc.returncode == 3, proc.stdout + proc.stderr
    preflight, *record = (tmp_path / "record.txt").read_text().splitlines()
    # Order: the preflight, head, wait for 1 node, workers, wait for all 3, then one trainer per node.
    assert preflight == "preflight: --config configs/dapo_qwen2.5_32b.yaml trainer.nnodes=3 trainer.n_gpus_per_node=8 x.y=1 --check"
    assert record[0].startswith(f"srun on {nodes[0]}: ray start --head")
    assert record[1] == f"python 1 nodes at {HEAD_IP}:6379"
    assert sorted(record[2:4]) == [f"srun on {n}: ray start --address={HEAD_IP}:6379 --num-gpus=8 "
                                   "--disable-usage-stats --block" for n in nodes[1:]]
    assert record[4] == f"python 3 nodes at {HEAD_IP}:6379"
    assert sorted(r.split(":")[0] for r in record[5:]) == [f"srun on {n}" for n in nodes]
    assert all(" -m megatron_dapo.torchrun --nnodes=3 " in r and r.endswith("trainer.n_gpus_per_node=8 x.y=1") for r in record[5:])
    for node in nodes:
        log = (tmp_path / "logs" / "777" / f"node-{node}.log").read_text()
        assert f"output of torchrun on {node}" in log and f"output of ray on {node}" in log


def test_usr1_before_the_time_limit_is_forwarded_to_every_nodes_trainer_ranks_and_the_job_requeued(
        fake_bin, tmp_path):
    """Slurm sends the batch script USR1 ahead of the time limit (#SBATCH --signal=B:USR1@1200): it asks
    the ranks on every node (the children of each node's torchrun) to checkpoint and stop, keeps waiting
    for the trainer steps (the signal interrupts bash's `wait`), then requeues the job."""
    import signal
    import time

    header = SBATCH.read_text()
    assert "#SBATCH --signal=B:USR1@1200" in header and "#SBATCH --requeue" in header
    nodes = NODES[:3]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_", "RAY_"))}
    env.update(PATH=f"{fake_bin}:{env['PATH']}", SLURM_JOB_ID="777", SLURM_JOB_NODELIST=",".join(nodes),
               SLURM_JOB_NUM_NODES="3", SLURM_GPUS_ON_NODE="8", SLURM_SUBMIT_DIR=str(REPO),
               FAKE_RECORD=str(tmp_path / "record.txt"), PYTHON=str(fake_bin / "fake-python"),
               LOG_DIR=str(tmp_path / "logs"), FAKE_TRAINER_SLEEP="3", **{f"FAKE_TRAINER_RC_{n.replace('-', '_')}": "75"
                                                                          for n in nodes})
    proc = subprocess.Popen(["bash", str(SBATCH)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    record = tmp_path / "record.txt"
    deadline = time.monotonic() + 30
    while not (record.exists() and record.read_text().count(" megatron_dapo.torchrun ") == 3):
        assert time.monotonic() < deadline and proc.poll() is None, "the trainer steps did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 75, out  # the trainers' status, after they ended
    lines = record.read_text().splitlines()
    forward = [x for x in lines if "pkill -USR1" in x]
    assert len(forward) == 1 and "pgrep -d, -f -- 'torchrun .*--rdzv_id=777 '" in forward[0], lines
    assert lines[-1] == "scontrol requeue 777", lines
    assert "the trainer ranks checkpoint and stop" in out and "requeueing job 777" in out


def _ended(pid: int) -> bool:
    """True once PID is gone or a zombie (ended, not yet reaped by its new parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_the_first_failed_trainer_step_ends_the_job_and_stops_the_other_nodes_steps(fake_bin, tmp_path):
    """A node whose trainer step fails (a rank crashed) ends the job within seconds: the other nodes'
    ranks would otherwise wait in a collective for the dead ones until NCCL's timeout (30 min), holding
    every GPU of the job. The script exits with that step's status, names the node, and leaves no process
    of any step behind (the other trainers' tasks and the Ray steps)."""
    import signal
    import time

    nodes = NODES[:3]
    pids = tmp_path / "pids.txt"
    start = time.monotonic()
    try:
        proc = _run(fake_bin, tmp_path, SLURM_JOB_NODELIST=",".join(nodes), SLURM_JOB_NUM_NODES="3",
                    LOG_DIR=str(tmp_path / "logs"), FAKE_PIDS=str(pids), FAKE_TRAINER_SLEEP="300",
                    FAKE_TRAINER_SLEEP_h800_02="0.5", FAKE_TRAINER_RC_h800_02="7")
        elapsed = time.monotonic() - start
        deadline = time.monotonic() + 5   # Ray's steps get SIGTERM as the script exits
        recorded = [int(p) for p in pids.read_text().split()]
        while not all(_ended(p) for p in recorded) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [p for p in recorded if not _ended(p)]
    finally:
        for p in [int(p) for p in pids.read_text().split()] if pids.exists() else []:
            if not _ended(p):
                os.kill(p, signal.SIGKILL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 7, out
    assert elapsed < 30, f"{elapsed:.1f} s: the job waited for the nodes that were still running"
    assert (f"the trainer step on node h800-02 (node rank 1) failed first, with status 7; its output: "
            f"{tmp_path / 'logs'}/node-h800-02.log") in proc.stderr, out
    assert "stopping the trainer steps on the other 2 node(s) and Ray" in proc.stderr, out
    assert len(recorded) == 6 and not left, (recorded, left)   # 3 Ray steps, 3 trainer tasks
    for node in ("h800-01", "h800-03"):
        assert "SIGTERM, passed on to the task" in (tmp_path / "logs" / f"node-{node}.log").read_text()


def test_every_step_on_a_node_is_killed_whole_on_a_bad_exit_and_torchrun_never_restarts(fake_bin, tmp_path):
    """--kill-on-bad-exit=1: a task that fails ends its step; --max_restarts=0: a crashed rank ends its
    node's torchrun (and so its step) instead of restarting alone into a world that moved on."""
    cmds = _commands(_run(fake_bin, tmp_path, "--dry-run").stdout)
    for role, entries in cmds.items():
        for _, _, argv, _ in entries:
            assert "--kill-on-bad-exit=1" in argv[:argv.index("--job-name=dapo-" + role)], (role, argv)
    assert all("--max_restarts=0" in argv for _, _, argv, _ in cmds["trainer"])
    # and a rank left in a hung collective errors out (after NCCL's timeout) instead of stalling forever
    env = {k: v for k, v in os.environ.items() if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    nccl = subprocess.run(["bash", "-c", "source launch/slurm/env.sh; echo $TORCH_NCCL_ASYNC_ERROR_HANDLING"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert nccl.stdout.split() == ["1"], nccl.stderr


# --- DRY_RUN=1 where there is no Slurm at all -------------------------------------------------------

def _no_slurm_env(**changes):
    """The environment of a laptop: no SLURM_* variables, no sbatch / srun / scontrol on PATH."""
    path = [d for d in os.environ["PATH"].split(os.pathsep)
            if not any((Path(d) / tool).exists() for tool in ("sbatch", "srun", "scontrol"))]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_", "RAY_", "DRY_RUN"))}
    return {**env, "PATH": os.pathsep.join(path), **changes}


SBATCH_TARGETS = {"train-dapo-32b": "configs/dapo_qwen2.5_32b.yaml",
                  "train-dapo-32b-wo-ds": "configs/dapo_wo_ds_qwen2.5_32b.yaml",
                  "train-dapo-32b-early": "configs/dapo_early_qwen2.5_32b.yaml",
                  "train-moe": "configs/dapo_qwen3_30b_a3b.yaml"}
MADE_UP = [f"dryrun-node-{i:02d}" for i in range(1, 17)]


@pytest.mark.parametrize("target, recipe", SBATCH_TARGETS.items())
def test_make_dry_run_without_slurm_previews_the_headers_16_nodes(target, recipe, tmp_path):
    proc = subprocess.run(["make", "-s", "--no-print-directory", target, "ARGS=actor.lr=2e-6"], cwd=REPO, capture_output=True, text=True,
                          env=_no_slurm_env(DRY_RUN="1", CHECK="0"), timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("# dry run outside Slurm: MADE-UP nodes dryrun-node-01 .. dryrun-node-16 and head "
                               "address 192.0.2.1 (documentation range)")
    assert "#SBATCH --nodes=16 --gpus-per-node=8" in lines[0]
    headers = [HEADER.match(line).groups() for line in lines if HEADER.match(line)]
    assert [(h[2], h[3], h[4]) for h in headers] == [(n, str(i), "8") for i, n in enumerate(MADE_UP)]
    cmds = _commands(proc.stdout)
    ((_, head, argv, _),) = cmds["ray-head"]
    assert head == MADE_UP[0] and "--node-ip-address=192.0.2.1" in argv and "--num-gpus=8" in argv
    assert [n for _, n, _, _ in cmds["ray-worker"]] == MADE_UP[1:]
    assert [n for _, n, _, _ in cmds["trainer"]] == MADE_UP
    for _, node, argv, log in cmds["trainer"]:
        assert argv[argv.index("megatron_dapo.torchrun") - 1:] == [
            "-m", "megatron_dapo.torchrun", "--nnodes=16", "--nproc_per_node=8", "--rdzv_backend=c10d",
            "--rdzv_endpoint=192.0.2.1:29500", "--rdzv_id=dryrun", "--max_restarts=0", "-m", "megatron_dapo.train",
            "--config", recipe, "trainer.nnodes=16", "trainer.n_gpus_per_node=8", "actor.lr=2e-6"]
        assert log == f"logs/dryrun/node-{node}.log"
    assert not (REPO / "logs" / "dryrun").exists()          # ran nothing


def test_the_preview_follows_the_scripts_own_header(tmp_path):
    script = tmp_path / "four.sbatch"
    text = SBATCH.read_text().replace("#SBATCH --nodes=16", "#SBATCH --nodes=4").replace(
        "#SBATCH --gpus-per-node=8", "#SBATCH --gpus-per-node=2")
    script.write_text(text)
    proc = subprocess.run(["bash", str(script), "--dry-run"], cwd=tmp_path, capture_output=True, text=True,
                          env=_no_slurm_env(REPO_DIR=str(REPO), HEAD_IP="10.1.2.3", CHECK="0"), timeout=60)
    assert proc.returncode == 0, proc.stderr
    trainers = [line for line in proc.stdout.splitlines() if "] trainer: " in line]
    assert [line.split()[2].rstrip("]") for line in trainers] == MADE_UP[:4]
    assert all("--nnodes=4 --nproc_per_node=2" in line and "--rdzv_endpoint=10.1.2.3:29500" in line
               for line in trainers)


def test_without_slurm_a_real_launch_still_refuses(tmp_path):
    proc = subprocess.run(["bash", str(SBATCH)], cwd=tmp_path, capture_output=True, text=True,
                          env=_no_slurm_env(REPO_DIR=str(REPO)), timeout=60)
    assert proc.returncode != 0 and "not inside a Slurm allocation: submit with sbatch (or DRY_RUN=1" in proc.stderr


def test_the_preflight_runs_first_in_a_dry_run_and_a_problem_starts_nothing(fake_bin, tmp_path):
    proc = _run(fake_bin, tmp_path, "--dry-run", "actor.lr=2e-6")
    assert proc.returncode == 0, proc.stderr
    record = (tmp_path / "record.txt").read_text().splitlines()
    assert record[0] == ("preflight: --config configs/dapo_qwen2.5_32b.yaml trainer.nnodes=16 trainer.n_gpus_per_node=8 "
                         "actor.lr=2e-6 --check")
    (tmp_path / "record.txt").unlink()
    proc = _run(fake_bin, tmp_path, "actor.lr=2e-6", FAKE_CHECK_RC="2")  # a real submission whose check fails
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-2:] == ["preflight: data.train_files: data/x.parquet: no such file",
                                             "dapo: the preflight found the problems above; nothing was started (it "
                                             f"ran PYTHON={fake_bin / 'fake-python'}: a missing module means that is "
                                             "not the run's environment; set PYTHON)"]
    assert [line.split(":")[0] for line in (tmp_path / "record.txt").read_text().splitlines()] == ["preflight"]
    assert not (REPO / "logs" / "777").exists()
    (tmp_path / "record.txt").unlink()
    proc = _run(fake_bin, tmp_path, "--dry-run", "actor.lr=2e-6", FAKE_CHECK_RC="2")  # a preview goes on
    assert proc.returncode == 2
    assert "a real job would stop here (the dry run goes on;" in proc.stderr
    assert len(_commands(proc.stdout)["trainer"]) == 16  # every node's command still printed


def test_a_pyxis_container_runs_every_step_and_the_batch_hosts_commands_in_the_image(fake_bin, tmp_path):
    image, mounts = "nvcr.io/acme/dapo:25.10", "/shared:/shared,/scratch"
    proc = _run(fake_bin, tmp_path, "--dry-run", CONTAINER_IMAGE=image, CONTAINER_MOUNTS=mounts)
    assert proc.returncode == 0, proc.stderr
    flags = [f"--container-image={image}", f"--container-mounts={REPO},{mounts}", f"--container-workdir={REPO}"]
    for role, entries in _commands(proc.stdout).items():
        for _, _, argv, _ in entries:
            assert argv[0] == "srun" and all(f in argv for f in flags), (role, argv)
    # the preflight ran as a job step on the head node, in the image (the batch host has no Python stack)
    (check,) = (tmp_path / "record.txt").read_text().splitlines()
    assert check.startswith(f"srun on {NODES[0]}: ") and check.endswith("--check")
    assert "/fake-python -m megatron_dapo.train --config configs/dapo_qwen2.5_32b.yaml" in check


def test_an_apptainer_image_wraps_every_command_and_both_kinds_at_once_are_refused(fake_bin, tmp_path):
    proc = _run(fake_bin, tmp_path, "--dry-run", APPTAINER_IMAGE="/shared/dapo.sif", CONTAINER_MOUNTS="/shared")
    assert proc.returncode == 0, proc.stderr
    prefix = ["apptainer", "exec", "--nv", "--bind", f"{REPO},/shared", "--pwd", str(REPO), "/shared/dapo.sif"]
    for _, _, argv, _ in _commands(proc.stdout)["trainer"]:
        start = argv.index("apptainer")
        assert argv[start:start + len(prefix)] == prefix and argv[start + len(prefix) + 1:][:2] == \
            ["-m", "megatron_dapo.torchrun"]
    apptainer, check = (tmp_path / "record.txt").read_text().splitlines()  # the preflight, in the image
    assert apptainer.startswith(f"apptainer exec --nv --bind {REPO},/shared --pwd {REPO} /shared/dapo.sif ")
    assert check.startswith("preflight: --config configs/dapo_qwen2.5_32b.yaml")
    proc = _run(fake_bin, tmp_path, "--dry-run", APPTAINER_IMAGE="/x.sif", CONTAINER_IMAGE="nvcr.io/x")
    assert proc.returncode == 2 and "CONTAINER_IMAGE and APPTAINER_IMAGE are both set: choose one" in proc.stderr
