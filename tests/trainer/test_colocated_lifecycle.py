"""Colocated SGLang servers through whole training steps, as on a GPU: the trainer launches two stand-ins in
memory-saver mode (they die wherever SGLang 0.5.23 dies on a GPU: a forward over released memory, /health
included; a release while busy; a resume of a tag never released; tests/standin/test_memory_saver.py), on
2 trainer processes, with the health poller at 0.2 s so probes certainly fall into every training phase
(tests/trainer/_mp_colocated.py drives the runs).

- One server SIGKILLed while the actor trains, the other while a generation has requests on it: the run
  finishes every step on the survivor, each dead server is relaunched by the trainer (the first only when
  the rollout phase begins), goes through a release and resume before its first weight sync, and ends up
  with the actor's weights; no server ever sees a forward while released.
- One server hung (SIGSTOP, then SIGKILL) during a bucket of a distributed weight push: every rank stops
  with the same WeightSyncError naming it once rollout.weight_sync_bucket_timeout_s has passed (not after
  the group's timeout), and a new start resumes from the checkpoint.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.sglang_real.conftest import free_port_pair
from tests.standin import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHIM = ROOT / "tests/standin/sglang_shim"
BUCKET_TIMEOUT_S = 20


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tests.trainer.test_cluster_in_a_box import _hf_model

    return _hf_model(tmp_path_factory.mktemp("colocated"), "dense")


def _overrides(hf_dir: str, steps: int, *more: str) -> list[str]:
    return ["rollout.engine=sglang", "rollout.mode=colocate", "rollout.require_memory_saver=true",
            "model.arch=hf", f"model.hf_path={hf_dir}", f"rollout.sglang_python={sys.executable}",
            f"rollout.server_env=[PYTHONPATH={SHIM}:{ROOT}]", "rollout.server_device=cpu",
            "rollout.server_extra_args=[--receive-timeout-s=30,--forward-delay-s=0.01]",
            f"rollout.server_base_port={free_port_pair()}", "rollout.health_check_interval_s=0.2",
            "rollout.weight_sync_bucket_mb=0.02", f"rollout.weight_sync_bucket_timeout_s={BUCKET_TIMEOUT_S}",
            "trainer.n_gpus_per_node=2", "data.train_batch_size=4", "data.gen_batch_size=null", "rollout.n=4",
            "actor.ppo_mini_batch_size=2", "data.max_response_length=6", "reward.overlong_buffer.len=4",
            "algorithm.filter_groups.enable=false", "trainer.sft_warmup_steps=0", "trainer.test_freq=0",
            "trainer.val_before_train=false", "trainer.logger=[tensorboard]", f"trainer.total_training_steps={steps}",
            *more]


def _torchrun(out: pathlib.Path, mode: str, overrides: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    with open(out / "launch.log", "w") as f:
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                               "127.0.0.1", "--master_port", str(free_port()), str(ROOT / "tests/trainer/_mp_colocated.py"),
                               str(out), mode, *overrides], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                              timeout=900).returncode


def _scalars(out: pathlib.Path) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(out / "tiny_cpu/tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


def _check_memory_order(rows: list) -> list[str]:
    """A server's requests in order (one process): no forward (/generate, /health_generate) while anything is
    released, each resume only of released tags; returns the memory calls and the first weight update and
    generate. (/health is no forward on servers the trainer launches: server.SERVER_DEFAULTS; the stand-in
    would die on it otherwise, which the logs' check below would show.)"""
    released: set[str] = set()
    story: list[str] = []
    for path, body in rows:
        if path == "/release_memory_occupation":
            released |= set(body.get("tags") or ["weights", "kv_cache", "cuda_graph"])
            story.append(f"release:{','.join(sorted(body.get('tags') or ['all']))}")
        elif path == "/resume_memory_occupation":
            tags = set(body.get("tags") or ["weights", "kv_cache", "cuda_graph"])
            assert tags <= released, (tags, released, story)
            released -= tags
            story.append(f"resume:{','.join(sorted(tags))}")
        elif path in ("/generate", "/health_generate"):  # (/health runs no forward on launched servers)
            assert not released, (path, released, story)
            if path == "/generate" and "/generate" not in story:
                story.append(path)
        elif path == "/update_weights_from_distributed" and path not in story:
            story.append(path)
    return story


@pytest.mark.timeout(900)
@pytest.mark.multiproc
def test_colocated_servers_killed_in_training_and_in_generation_are_relaunched_and_the_run_finishes(hf_dir, tmp_path):
    steps = 6
    rc = _torchrun(tmp_path, "kills", _overrides(hf_dir, steps))
    log = (tmp_path / "launch.log").read_text(errors="replace")
    assert rc == 0, log[-8000:]
    report = json.loads((tmp_path / "report.json").read_text())
    first, second = report["urls"]
    assert [(k["when"], k["step"]) for k in report["kills"]] == [("training", 1), ("generation", 4)]
    assert report["kills"][0]["url"] == second
    # No server died but the two killed: no scheduler exception in any log (a probe or generation into
    # released memory, a release while busy or a resume of a tag never released would have written one).
    for url, path in report["logs"].items():
        assert "Scheduler hit an exception" not in pathlib.Path(path).read_text(errors="replace"), url
    scalars = _scalars(tmp_path)
    assert sum(scalars["rollout/server_failures"].values()) == 2 and sorted(scalars["rollout/server_failures"]) == list(
        range(1, steps + 1))
    for url in (first, second):  # each relaunched once per kill
        assert len(report["pids"][url]) == 1 + sum(k["url"] == url for k in report["kills"]), report["pids"]
    # The server killed in training was relaunched only when the rollout phase began (the push of version 1,
    # after the trainer gave the memory back), then released before its first sync; each came back with the
    # actor's weights.
    restart = next(e["wall"] for e in report["events"] if e["kind"] == "restart" and e["url"] == second)
    assert report["kills"][0]["wall"] < report["push_started"]["1"] < restart, (report["kills"], restart)
    assert report["states"] == {first: "up", second: "up"} and report["weights_equal"] == {first: True, second: True}
    for url in (first, second):
        story = _check_memory_order(report["requests"][url])
        if story[0].startswith("release:"):  # up while the actor trained: it joined the release, then the sync
            assert story.index("resume:weights") < story.index("/update_weights_from_distributed") < story.index(
                "resume:kv_cache") < story.index("/generate"), story
        else:  # a relaunch that answered before the rollout phase's push (a loaded machine: the push came
            # later) holds its memory: that push, then generation, then the next release
            assert story[:3] == ["/update_weights_from_distributed", "/generate", "release:kv_cache,weights"], story
    assert scalars["rollout/servers_up"][steps] == 2


@pytest.mark.timeout(900)
@pytest.mark.multiproc
def test_a_server_hung_then_killed_during_a_distributed_push_stops_every_rank_at_the_bucket_deadline_and_resumes(
        hf_dir, tmp_path):
    """SIGSTOP during bucket 2 of version 2 (a wedged server: the broadcast cannot complete for any member),
    SIGKILL once the run has stopped. (A server that vanishes outright fails the bucket at once, with the
    same error.)"""
    more = ("trainer.save_freq=1", f"trainer.default_local_dir={tmp_path / 'ckpt'}", "rollout.weight_sync_bucket_timeout_s=5")
    rc = _torchrun(tmp_path / "run", "push-hang", _overrides(hf_dir, 3, *more))
    assert rc != 0, (tmp_path / "run/launch.log").read_text(errors="replace")[-6000:]
    (hang,) = json.loads((tmp_path / "run/report.json").read_text())["kills"]
    assert hang["when"] == "push" and hang["step"] == 2
    errors = [(tmp_path / f"run/error.rank{r}.txt").read_text() for r in (0, 1)]
    assert errors[0] == errors[1] and errors[0].startswith("WeightSyncError: weight sync failed: rank 0 (stage 0): "), errors
    # The hung server never answers; the other waits in the same broadcast, so it may not have either.
    silent = re.search(r"did not complete within 5 s \(rollout.weight_sync_bucket_timeout_s\); no answer from "
                       r"(\[[^]]*\])", errors[0])
    assert silent and hang["url"] in silent.group(1), errors[0]
    stopped = max((tmp_path / f"run/error.rank{r}.txt").stat().st_mtime for r in (0, 1)) - hang["wall"]
    assert stopped < 5 + 10, stopped  # the bucket deadline, not the group's 600 s
    print(f"\nserver hung mid-push -> every rank stopped with one WeightSyncError after {stopped:.1f} s")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("global_step")) == ["global_step_1"]

    rc = _torchrun(tmp_path / "again", "steady", _overrides(hf_dir, 3, *more))
    assert rc == 0, (tmp_path / "again/launch.log").read_text(errors="replace")[-6000:]
    assert sorted(_scalars(tmp_path / "again")["actor/pg_loss"]) == [2, 3]  # resumed after step 1
    report = json.loads((tmp_path / "again/report.json").read_text())
    assert report["weights_equal"] == dict.fromkeys(report["urls"], True)
