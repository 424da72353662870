"""Crash recovery of the queue trainer with real processes and SIGKILL (megatron_dapo/trainer/faults.py).

Each case runs tests/trainer/_fault_run.py (4 steps, a checkpoint every 2) in a subprocess that kills
itself at an injected point, checks that the last good checkpoint is intact, restarts it, and checks:
- exactly once: every issued prompt is consumed once with one fate (trained / filtered / surplus),
  each step trains train_batch_size prompts, the rollout dumps hold exactly the trained groups, each
  in the step that consumed it, and no dataset prompt is issued twice in the epoch (a resumed
  sampler never re-issues);
- sync mode: the restarted run equals an uninterrupted one (losses, final weights, batches, queue).
Only the kill during generation is in the default suite; the rest of the matrix is marked slow.
"""

import collections
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from megatron_dapo.queue import TransferQueue
from megatron_dapo.trainer import faults
from megatron_dapo.trainer.checkpoint import LATEST

FAULT_RUN = pathlib.Path(__file__).with_name("_fault_run.py")
STEPS, TBS, N = 4, 4, 4
ASYNC = ["queue.max_staleness=1"]


@dataclasses.dataclass
class Finished:
    returncode: int
    stderr: str  # stdout and stderr together
    orphans: list = dataclasses.field(default_factory=list)
    """Its descendants still running 10 s after it ended (killed by the test then)."""


def _launch(out: pathlib.Path, *overrides: str, fault: str | None = None, once: pathlib.Path | None = None,
            timeout_s: float = 300.0, fault_signal: str | None = None, nproc: int = 1,
            fault_rank: int | None = None) -> Finished:
    """Run _fault_run.py to its end (or its SIGKILL), then end the processes it left behind. nproc > 1 runs
    it under torchrun (which ends the other ranks when one dies); fault_rank: only that rank crashes.

    Whatever a SIGKILLed trainer leaves running (a checkpoint writer it forked, ranks torchrun has not ended
    yet) is this test's, named in `orphans` and ended here by pid once 10 s have passed. The output goes to
    a file, not a pipe: an orphan holding a pipe would block the read forever.
    """
    env = {k: v for k, v in os.environ.items() if k not in (faults.ENV, faults.ONCE_ENV, faults.SIGNAL_ENV)}
    env["OMP_NUM_THREADS"] = "1"
    if fault_signal:  # the fault point sends this signal instead of SIGKILL (a preemption notice)
        env[faults.SIGNAL_ENV] = fault_signal
    if fault:
        env[faults.ENV] = fault
    if once:
        env[faults.ONCE_ENV] = str(once)
    env.pop(faults.RANK_ENV, None)
    if fault_rank is not None:
        env[faults.RANK_ENV] = str(fault_rank)
    cmd = [sys.executable, str(FAULT_RUN), str(out), *overrides]
    if nproc > 1:
        from tests.standin import free_port

        env["PYTHONPATH"] = str(FAULT_RUN.parents[2])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), *cmd[1:]]
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / f"run{len(list(out.glob('run*.log')))}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        me, descendants, deadline = psutil.Process(proc.pid), {}, time.monotonic() + timeout_s
        while proc.poll() is None:
            try:
                descendants.update((c.pid, c) for c in me.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
            if time.monotonic() > deadline:
                proc.kill()
            time.sleep(0.1)
    deadline, orphans = time.monotonic() + 10, []
    while time.monotonic() < deadline:
        orphans = [c for c in descendants.values() if _alive(c)]
        if not orphans:
            break
        time.sleep(0.1)
    names = [f"{c.pid} {' '.join(c.cmdline()[:4])}" for c in orphans if _alive(c)]
    for child in orphans:
        try:
            if child.is_running():  # is_running also guards against a reused pid
                child.kill()
        except psutil.NoSuchProcess:
            pass
    return Finished(proc.returncode, log_path.read_text(), names)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _ok(proc: Finished) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]


def _last_good_checkpoint(out: pathlib.Path) -> int | None:
    """The step named by the `latest` file, after checking that its directory is complete and loads."""
    root = out / "f/ckpt"
    if not (root / LATEST).exists():
        assert not list(root.glob("global_step_*")) if root.exists() else True
        return None
    c = int((root / LATEST).read_text())
    state = torch.load(root / f"global_step_{c}/trainer_state.pt", weights_only=True)
    assert state["global_step"] == c and len(state["loss_history"]) == c
    assert (root / f"global_step_{c}/model/.metadata").exists()
    return c


def _crash(out: pathlib.Path, fault: str, *overrides: str) -> int | None:
    """Run until the injected SIGKILL; return the last good checkpoint step (checked to load)."""
    crashed = _launch(out, *overrides, fault=fault)
    assert crashed.returncode == -signal.SIGKILL, f"expected a SIGKILL at {fault}; rc={crashed.returncode}\n" \
                                                  f"{crashed.stderr[-4000:]}"
    assert not (out / "summary.json").exists()
    return _last_good_checkpoint(out)


def _restart(out: pathlib.Path, c: int | None, *overrides: str) -> str:
    restarted = _launch(out, *overrides)
    _ok(restarted)
    if c is not None:
        assert f"resumed from {out}/f/ckpt/global_step_{c} at step {c}" in restarted.stderr
    return restarted.stderr


def _queue_record(out: pathlib.Path) -> dict[str, tuple]:
    """key -> (status, fate, global_steps, dataset uid) of every prompt in the queue."""
    q = TransferQueue(out / "f/queue.sqlite")
    keys = q.list_keys("train", is_prompt=True)
    f = q.get("train", keys, ["uid"])
    fates = [q.get("train", [k], ["fate"])["fate"][0] if t["status"] == "consumed" else None
             for k, t in zip(keys, q.get_tags("train", keys), strict=True)]
    tags = q.get_tags("train", keys)
    rec = {k: (t["status"], fate, t["global_steps"], uid) for k, t, fate, uid in zip(keys, tags, fates, f["uid"],
                                                                                      strict=True)}
    consumed = [k for k, r in rec.items() if r[0] == "consumed"]
    live_groups = {k: q.count("train", is_prompt=False, prompt_uid=k) for k, r in rec.items() if r[0] != "consumed"}
    no_consumed_trajs = q.count("train", is_prompt=False, prompt_uid=tuple(consumed)) == 0 if consumed else True
    q.close()
    return rec, live_groups, no_consumed_trajs


def _dumps(out: pathlib.Path) -> dict[int, list[tuple[str, int, str]]]:
    return {s: [(r["group"], r["sample_index"], r["prompt_uid"])
                for r in map(json.loads, (out / f"dumps/step_{s}.jsonl").read_text().splitlines())]
            for s in range(1, STEPS + 1)}


def _check_exactly_once(out: pathlib.Path, *, sync: bool) -> None:
    rec, live_groups, no_consumed_trajs = _queue_record(out)
    uids = [r[3] for r in rec.values()]
    assert len(set(uids)) == len(uids), "a dataset prompt was issued twice in one epoch"
    fates = collections.Counter(r[1] for r in rec.values() if r[0] == "consumed")
    assert set(fates) <= {"trained", "filtered", "surplus"}
    trained = {k: r[2] for k, r in rec.items() if r[1] == "trained"}
    assert collections.Counter(trained.values()) == {s: TBS for s in range(1, STEPS + 1)}
    dumped: dict[str, list] = collections.defaultdict(list)
    for step, rows in _dumps(out).items():
        for group, j, _ in rows:
            dumped[group].append((step, j))
    assert set(dumped) == set(trained)
    for group, rows in dumped.items():
        assert sorted(rows) == [(trained[group], j) for j in range(N)], group
    assert no_consumed_trajs  # the final checkpoint dropped the trajectories of consumed prompts
    if sync:
        assert not live_groups, "sync mode: nothing outlives a step"
    for key, count in live_groups.items():  # async leftovers: a whole group or none, never half
        status = rec[key][0]
        assert (status == "done" and count == N) or (status in ("pending", "running") and count == 0), key


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> pathlib.Path:
    """The uninterrupted sync-mode run every sync case is compared with."""
    out = tmp_path_factory.mktemp("reference")
    _ok(_launch(out))
    _check_exactly_once(out, sync=True)
    return out


def _assert_equal_to_reference(out: pathlib.Path, reference: pathlib.Path) -> None:
    a, b = (json.loads((d / "summary.json").read_text()) for d in (reference, out))
    assert b["loss_history"] == a["loss_history"]
    assert b["model_sha256"] == a["model_sha256"]
    assert _dumps(out) == _dumps(reference)
    assert _queue_record(out)[0] == _queue_record(reference)[0]


def test_kill_during_generation_resumes_exactly_once_and_equals_the_uninterrupted_run(tmp_path, reference):
    c = _crash(tmp_path, "generation:3")
    assert c == 2
    log = _restart(tmp_path, c)
    assert "sync-mode recovery: discarded 6 prompts issued after step 2" in log  # the running generation batch
    _check_exactly_once(tmp_path, sync=True)
    _assert_equal_to_reference(tmp_path, reference)


@pytest.mark.slow
@pytest.mark.parametrize("fault,last_good", [("after_reward:3", 2), ("update_actor:3", 2),
                                             ("after_commit:3", 2), ("checkpoint_write:4", 2),
                                             ("checkpoint_write:2", None)])
def test_sync_mode_kill_resumes_exactly_once_and_equals_the_uninterrupted_run(tmp_path, reference, fault,
                                                                              last_good):
    c = _crash(tmp_path, fault)
    assert c == last_good
    if fault.startswith("checkpoint_write"):  # the half-written checkpoint never became a step directory
        step = fault.split(":")[1]
        assert (tmp_path / f"f/ckpt/tmp_global_step_{step}/model").is_dir()
        assert not (tmp_path / f"f/ckpt/global_step_{step}").exists()
    _restart(tmp_path, c)
    _check_exactly_once(tmp_path, sync=True)
    _assert_equal_to_reference(tmp_path, reference)


@pytest.mark.slow
def test_async_mode_kill_after_commit_returns_the_lost_steps_prompts_and_trains_each_once(tmp_path):
    c = _crash(tmp_path, "after_commit:3", *ASYNC)
    assert c == 2
    log = _restart(tmp_path, c, *ASYNC)
    late = int(log.split("async recovery: ")[1].split(" prompts consumed")[0])
    assert late >= TBS  # step 3's trained prompts (and any it filtered) went back to the buffer
    _check_exactly_once(tmp_path, sync=False)


@pytest.mark.slow
def test_killed_producer_is_restarted_and_its_claim_reissued(tmp_path):
    once = tmp_path / "fired"
    proc = _launch(tmp_path, *ASYNC, fault="producer_generation:1", once=once)
    _ok(proc)
    assert once.exists(), "the producer fault never fired"
    assert "producer 0 died (exit code -9); reissued its" in proc.stderr
    _check_exactly_once(tmp_path, sync=False)


@pytest.mark.parametrize("trainer,fault,signal_name,step", [
    ("sync", "after_update_actor:2", "SIGTERM", 2),  # during step 2: stops at its end
    ("queue", "generation:3", "SIGUSR1", 3),  # the queue trainer in sync mode, step 3 (no checkpoint due)
], ids=["fit-sigterm", "queue-sigusr1"])
def test_a_stop_signal_saves_at_the_step_reached_and_the_resumed_run_equals_the_uninterrupted_one(
        tmp_path, reference, trainer, fault, signal_name, step):
    """Preemption (trainer/preemption.py): the signal arrives mid-step; the run finishes that step, writes
    its checkpoint (save_freq=2 would not have), exits with trainer.preemption_exit_code; the restarted
    run resumes at the next step and ends where the uninterrupted run does (losses, weights)."""
    more = ["queue.enable=false"] if trainer == "sync" else []
    stopped = _launch(tmp_path, *more, fault=fault, fault_signal=signal_name)
    assert stopped.returncode == 75, stopped.stderr[-4000:]
    assert f"{signal_name} received: stopped after a checkpoint at step {step}" in stopped.stderr
    assert _last_good_checkpoint(tmp_path) == step
    assert not (tmp_path / "summary.json").exists()
    _restart(tmp_path, step, *more)
    a, b = (json.loads((d / "summary.json").read_text()) for d in (reference, tmp_path))
    assert b["loss_history"] == a["loss_history"] and b["model_sha256"] == a["model_sha256"]
    if trainer == "queue":
        _assert_equal_to_reference(tmp_path, reference)
        _check_exactly_once(tmp_path, sync=True)


def test_a_trainer_killed_mid_save_leaves_no_checkpoint_writer_behind(tmp_path):
    """Megatron's checkpoint writer keeps a multiprocessing Manager process for the run; started by the
    trainer with PR_SET_PDEATHSIG (trainer/checkpoint.py), it dies with a SIGKILLed trainer instead of
    staying attached to PID 1."""
    crashed = _launch(tmp_path, "queue.enable=false", fault="checkpoint_write:2")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-4000:]
    assert crashed.orphans == []


def test_a_trainer_killed_during_a_background_save_leaves_no_writer_behind(tmp_path):
    """trainer.async_save: the writer process is started with PR_SET_PDEATHSIG too; the trainer is
    SIGKILLed while it writes (it kills its parent), and it must not stay behind writing."""
    crashed = _launch(tmp_path, "queue.enable=false", "trainer.async_save=true", fault="background_write:2")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-4000:]
    assert crashed.orphans == []
    assert (tmp_path / "f/ckpt/tmp_global_step_2").is_dir() and not (tmp_path / "f/ckpt/global_step_2").exists()
