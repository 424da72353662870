"""Real SGLang servers that die under the trainer: SIGKILL of a server's whole process tree while a generation
batch has requests on it, in a 2-process run (tests/sglang_real/_server_death.py). These tests start their
own servers: the session's shared ones are never killed.

- The trainer launched two servers: the lost requests go to the survivor at once (the step trains on
  every row, none twice), the weight sync leaves the dead server out, the trainer restarts it, and the
  first sync after it answers re-forms the weight-update group with it and brings it back with the
  actor's weights (its probe log-probs equal the actor export's); the next step generates on both.
- The only server, given by rollout.sglang_urls, dies: every rank stops with the same AllServersDown
  within rollout.server_down_timeout_s, and the last checkpoint stays the one before the step.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from tests.sglang_real.conftest import (
    ROOT,
    assert_all_gone,
    cpu_server_overrides,
    free_port_pair,
    server_tree,
)
from tests.sglang_real.test_train import PROBE_DIFF_TOL, _processes_in, _scalars, train_overrides
from tests.standin import free_port

STEPS = 4
DOWN_TIMEOUT_S = 10


def _torchrun(tmp_path: pathlib.Path, mode: str, *overrides: str, timeout_s: int = 900) -> tuple[int, float]:
    """Run the driver on 2 processes; (exit code, seconds)."""
    port = free_port()  # an OS-chosen free port: fixed ranges collide with ports other tests left in TIME_WAIT
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    t0 = time.monotonic()
    with open(tmp_path / "launch.log", "w") as f:
        rc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                             "127.0.0.1", "--master_port", str(port), str(ROOT / "tests/sglang_real/_server_death.py"),
                             str(tmp_path), mode, *overrides], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                            timeout=timeout_s).returncode
    return rc, time.monotonic() - t0


def _overrides(tiny_qwen2, tmp_path, *more):
    """rollout.min_new_tokens keeps every request generating long enough to be killed mid-way (it also
    masks EOS in SGLang's log-probs, so the actor-vs-server log-prob metric is not checked here: the probe
    comparison after every sync is)."""
    return [*train_overrides(*tiny_qwen2, "rollout.mode=disaggregate", "trainer.n_gpus_per_node=2",
                             "data.train_batch_size=8", "rollout.min_new_tokens=30", "actor.entropy_coeff=0.01",
                             f"trainer.total_training_steps={STEPS}", f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
                             "rollout.health_check_interval_s=1"),
            *cpu_server_overrides(), *more]


def _restart_run(tiny_qwen2, tmp_path, *more):
    """The "restart" mode on 2 processes; checks the pool's story of the victim and returns (events, its
    URL, the pool's events): down (its in-flight request lost its connection), the request re-issued,
    restarted, back after a sync."""
    rc, _ = _torchrun(tmp_path, "restart", *_overrides(tiny_qwen2, tmp_path, f"rollout.server_base_port={free_port_pair()}",
                                                       *more))
    log = (tmp_path / "launch.log").read_text(errors="replace")
    assert rc == 0, log[-8000:]
    events = json.loads((tmp_path / "events.json").read_text())
    victim, pool = events["killed_url"], events["pool"]
    kinds = [(e["kind"], e["url"]) for e in pool]
    assert kinds[:3] == [("down", victim), ("restart", victim), ("reissue", victim)], kinds
    assert ("readmitted", victim) in kinds and all(u == victim for _, u in kinds)
    return events, victim, pool


@pytest.mark.multiproc
def test_a_killed_server_s_requests_go_to_the_survivor_and_it_comes_back_restarted_with_the_weights(
        tiny_qwen2, tmp_path):
    events, victim, pool = _restart_run(tiny_qwen2, tmp_path)
    first_reissue = next(e["wall"] for e in pool if e["kind"] == "reissue")
    assert 0 <= first_reissue - events["killed_at"] < 2.0, first_reissue - events["killed_at"]
    print(f"\nserver killed -> first request re-issued on the survivor: {first_reissue - events['killed_at']:.3f} s")

    # Every step trained on its whole batch: 8 groups of 4, each (group, sample) once, none aborted.
    for step in range(1, STEPS + 1):
        rows = [json.loads(line) for line in (tmp_path / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        keys = [(r["group"], r["sample_index"]) for r in rows]
        assert len(rows) == 32 and len(set(keys)) == 32, step
        assert {r["finish_reason"] for r in rows} <= {"stop", "length"}, step
        assert {r["policy_version"] for r in rows} == {step - 1}, step

    report = {e["version"]: e for e in json.loads((tmp_path / "report.json").read_text())}
    survivor = next(u for u in report[0]["states"] if u != victim)
    assert report[1]["states"] == {survivor: "up", victim: "up"}
    assert report[2]["states"][victim] in ("down", "restarting", "stale")  # still restarting: left out of the sync
    assert set(report[2]["servers"]) == {survivor}
    for version in (3, 4):  # the restarted server holds the actor's weights of each version again
        assert report[version]["states"] == {survivor: "up", victim: "up"}, report[version]
        for url in (survivor, victim):
            got = report[version]["servers"][url]
            assert got["weight_version"] == str(version) and got["max_abs_diff"] < PROBE_DIFF_TOL, (version, url, got)
    used = json.loads((tmp_path / "used.json").read_text())
    assert victim in used["1"] and victim in used["4"] and survivor in used["2"]

    scalars = _scalars(tmp_path)
    assert scalars["rollout/server_failures"] == {1: 0, 2: 1, 3: 0, 4: 0}
    assert scalars["rollout/server_restarts"] == {1: 0, 2: 1, 3: 0, 4: 0}
    assert scalars["rollout/requests_reissued"][2] >= 1
    assert scalars["rollout/servers_up"] == {1: 2, 2: 1, 3: 2, 4: 2}
    assert scalars["rollout/servers_readmitted"] == {1: 0, 2: 0, 3: 1, 4: 0}
    assert _processes_in(tmp_path / "tiny_cpu/sglang") == []


@pytest.mark.multiproc
def test_the_async_queue_trainer_loses_no_row_when_a_server_dies_mid_generation(tiny_qwen2, tmp_path):
    """The queue trainer's producers on 2 processes (DP 2, queue.max_staleness=1, pushes into paused
    generation): the killed server's requests are re-sent to the survivor by the engine, it is restarted
    and rejoins with the actor's weights; every step trains on whole groups, none twice or aborted, each
    row from a pushed version at most one behind."""
    _, victim, _ = _restart_run(tiny_qwen2, tmp_path, "queue.enable=true", "queue.max_staleness=1",
                                "queue.partial_rollout=true", "queue.num_producers=2")
    seen = set()
    for step in range(1, STEPS + 1):
        rows = [json.loads(line) for line in (tmp_path / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        keys = {(r["group"], r["sample_index"]) for r in rows}
        assert len(rows) == 32 and len(keys) == 32 and not keys & seen, step
        seen |= keys
        assert {r["finish_reason"] for r in rows} <= {"stop", "length"}, step
        assert {r["policy_version"] for r in rows} <= {step - 2, step - 1}, step
    report = {e["version"]: e for e in json.loads((tmp_path / "report.json").read_text())}
    survivor = next(u for u in report[0]["states"] if u != victim)
    assert report[4]["states"] == {survivor: "up", victim: "up"}, report[4]
    for url in (survivor, victim):  # the restarted server holds the actor's last weights too
        got = report[4]["servers"][url]
        assert got["weight_version"] == "4" and got["max_abs_diff"] < PROBE_DIFF_TOL, (url, got)
    assert _processes_in(tmp_path / "tiny_cpu/sglang") == []


@pytest.mark.multiproc
def test_the_only_server_dying_stops_every_rank_with_all_servers_down_and_keeps_the_last_checkpoint(
        tiny_qwen2, tmp_path):
    from megatron_dapo.config import load_config
    from megatron_dapo.rollout.sglang.build import sglang_launch_plan
    from megatron_dapo.rollout.sglang.server import launch_servers

    cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), [
        *_overrides(tiny_qwen2, tmp_path), "rollout.engine=sglang", f"rollout.server_base_port={free_port_pair()}",
        f"trainer.output_dir={tmp_path / 'server'}"])
    specs, launcher, env = sglang_launch_plan(cfg)
    (server,) = launch_servers(specs[:1], log_dir=tmp_path / "server", timeout_s=600, launcher=launcher, env=env)
    pids = server_tree([server])
    try:
        rc, seconds = _torchrun(tmp_path, f"kill:{server.process.pid}", *_overrides(tiny_qwen2, tmp_path),
                                f"rollout.sglang_urls=[{server.url}]", "trainer.save_freq=1",
                                f"rollout.server_down_timeout_s={DOWN_TIMEOUT_S}")
    finally:
        server.stop()
    assert_all_gone(pids)
    log = (tmp_path / "launch.log").read_text(errors="replace")
    assert rc != 0, log[-6000:]
    errors = [(tmp_path / f"error.rank{r}.txt").read_text() for r in (0, 1)]
    assert errors[0] == errors[1], errors  # the same named error on both ranks
    assert errors[0].startswith("DriverError: rollout on rank 0 failed: AllServersDown: no SGLang server took "
                                f"requests for {DOWN_TIMEOUT_S} s"), errors[0]
    events = json.loads((tmp_path / "events.json").read_text())
    down = next(e["wall"] for e in events["pool"] if e["kind"] == "down")
    assert down - events["killed_at"] < 2.0
    stopped = max((tmp_path / f"error.rank{r}.txt").stat().st_mtime for r in (0, 1)) - events["killed_at"]
    assert DOWN_TIMEOUT_S <= stopped < DOWN_TIMEOUT_S + 30, stopped
    print(f"\nonly server killed -> every rank stopped with AllServersDown after {stopped:.1f} s")
    ckpt = tmp_path / "tiny_cpu/ckpt"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith(("global_step", "tmp"))) == ["global_step_1"]

