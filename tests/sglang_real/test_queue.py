"""The queue trainer's async mode against the two real SGLang 0.5.23 servers of the session (conftest).

Runs tests/trainer/_fault_run.py (4 steps, a checkpoint every 2, queue.max_staleness=1) with the rollout
producers (two threads in a process beside rank 0) sending claims to both servers while the actor trains,
weight pushes into
running generation (queue.partial_rollout: /pause_generation in place, the push without a cache flush,
/continue_generation), and checks at every layout:
- exactly once (tests/trainer/test_fault_injection.py): each issued prompt consumed once, each step
  trains train_batch_size prompts, the dumps hold exactly the trained groups, no prompt issued twice;
- versions: every row's versions are ones the trainer pushed, within max_staleness of the policy it
  trains, and each server reports the last push's version;
- the servers saw every push inside a pause: /pause_generation, the update session, /continue_generation.
The kill cases SIGKILL the trainer at a stage and restart it against the same servers, or SIGKILL the
producer process mid-claim (the trainer restarts it and trains on).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys

import pytest
import requests
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.sglang_real.conftest import ROOT, model_overrides
from tests.standin import free_port
from tests.trainer import test_fault_injection as fi

STEPS = fi.STEPS


def _overrides(real_servers, *more: str) -> list[str]:
    return [*model_overrides(real_servers.model_dir, real_servers.tokenizer_dir), "rollout.engine=sglang",
            "model.params_dtype=fp32", "rollout.require_memory_saver=false", "rollout.mode=disaggregate",
            f"rollout.sglang_urls=[{','.join(real_servers.urls)}]", "queue.max_staleness=1",
            "queue.partial_rollout=true", "queue.num_producers=2", "actor.entropy_coeff=0.01",
            # the tiny random model scores 0 on every arithmetic prompt: no group would pass the filter
            "algorithm.filter_groups.enable=false", "data.gen_batch_size=null", *more]


def _scalars(out: pathlib.Path) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(out / "f/tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


def _routes(server, mark: int) -> list[str]:
    posts = re.findall(r'"POST (/[a-z_]+) HTTP', server.log_path.read_text(errors="replace")[mark:])
    return [r for r in posts if r != "/generate"]


def _check_run(out: pathlib.Path, real_servers, marks: list[int], *, resumed_at: int = 0, mode: str = "inplace"
               ) -> None:
    """`marks`: where the servers' logs stood when the (last) run started at step resumed_at + 1. mode:
    inplace (pushes inside a pause), drain (pushes after the producers' claims are written) or sync
    (queue.max_staleness=0)."""
    fi._check_exactly_once(out, sync=mode == "sync")
    s = _scalars(out)
    lag, span = s["staleness/lag_worst/max"], s["staleness/version_span/max"]
    assert sorted(lag) == list(range(1, STEPS + 1))
    assert max(lag.values()) <= (0.0 if mode == "sync" else 1.0)  # stale_policy=drop: never more than 1 push old
    if mode != "inplace":  # every row from one weight version
        assert set(span.values()) == {1.0}, span
    for step, rows in ((st, [json.loads(x) for x in (out / f"dumps/step_{st}.jsonl").read_text().splitlines()])
                       for st in range(1, STEPS + 1)):
        # The newest weights of every row: pushed ones, at most one push behind the actor (sync: none).
        assert {r["policy_version"] for r in rows} <= ({step - 1} if mode == "sync" else {step - 2, step - 1}), step
    push = r"/begin_weight_update( /update_weights_from_distributed)+ /end_weight_update"
    # A trainer's start: its weight-update groups (one per pipeline stage), the servers resumed and emptied
    # (a killed trainer may have left them paused or generating), the first push.
    start = rf"(/init_weights_update_group )+/continue_generation /abort_request {push}"
    for server, mark in zip(real_servers.servers, marks, strict=True):
        info = requests.get(server.url + "/model_info", timeout=30).json()
        assert info["weight_version"] == str(STEPS), server.url
        control = " ".join(_routes(server, mark))
        steps = STEPS - resumed_at
        if mode == "inplace":  # the start push (nothing generating yet), then one paused push per step, and
            # at the end the producers' requests still running are aborted
            assert re.fullmatch(rf"{start} (/pause_generation {push} /continue_generation ?){{{steps}}}"
                                r"(/abort_request ?)*", control), control
        elif mode == "drain":
            assert re.fullmatch(rf"{start}( {push}){{{steps}}}( /abort_request)*", control), control
        else:  # colocated: the servers' memory released after generation, taken back around each push
            resume = "/resume_memory_occupation"
            assert re.fullmatch(rf"{start}( /release_memory_occupation {resume} {push} {resume}){{{steps}}}",
                                control), control


def _marks(real_servers) -> list[int]:
    return [len(s.log_path.read_text(errors="replace")) for s in real_servers.servers]


def test_async_queue_trainer_pushes_into_running_generation_on_two_real_servers(real_servers, tmp_path):
    marks = _marks(real_servers)
    fi._ok(fi._launch(tmp_path, *_overrides(real_servers), timeout_s=900))
    _check_run(tmp_path, real_servers, marks)
    span = _scalars(tmp_path)["staleness/version_span/max"]
    print(f"\nrows spanning two weight versions in steps {[k for k, v in span.items() if v > 1]}")


@pytest.mark.parametrize("mode", ["drain", "sync"])
def test_queue_trainer_without_in_place_pushes_on_two_real_servers(real_servers, tmp_path, mode):
    """drain: queue.partial_rollout=false, each push waits for the running claims (every row from one
    version). sync: queue.max_staleness=0 with colocated servers (memory released for the update)."""
    more = ["queue.partial_rollout=false"] if mode == "drain" else ["queue.max_staleness=0", "rollout.mode=colocate"]
    marks = _marks(real_servers)
    fi._ok(fi._launch(tmp_path, *_overrides(real_servers, *more), timeout_s=900))
    _check_run(tmp_path, real_servers, marks, mode=mode)


def test_a_killed_producer_process_is_restarted_and_each_prompt_is_trained_once(real_servers, tmp_path):
    """SIGKILL of the producer process with a claim of step 3 generated and not written (its other thread's
    requests cut mid-generation): the trainer reissues the dead process's running prompts, starts a new one
    and runs to the end, every prompt trained once."""
    once = tmp_path / "fired"
    marks = _marks(real_servers)
    run = fi._launch(tmp_path, *_overrides(real_servers), fault="producer_generation:3", once=once, timeout_s=900)
    fi._ok(run)
    assert once.exists(), "the producer fault never fired"
    assert "the SGLang producer process died (exit code -9); reissued its" in run.stderr
    _check_run(tmp_path, real_servers, marks)


@pytest.mark.parametrize("fault,last_good", [("weight_sync:3", 2), ("after_update_actor:3", 2),
                                             ("checkpoint_write:4", 2)])
def test_a_killed_async_trainer_resumes_against_the_same_servers_and_trains_each_prompt_once(
        real_servers, tmp_path, fault, last_good):
    """SIGKILL during a push (the servers paused in place, holding the dead trainer's requests), after an
    update, and while writing the last checkpoint (its producer process dies with it); the
    restart reconnects to the servers (which kept running), resumes and empties them, pushes checkpoint c
    and recovers the queue."""
    c = fi._crash(tmp_path, fault, *_overrides(real_servers))
    assert c == last_good
    marks = _marks(real_servers)
    log = fi._restart(tmp_path, c, *_overrides(real_servers))
    assert "async recovery:" in log
    _check_run(tmp_path, real_servers, marks, resumed_at=c)


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [["parallel.tensor_model_parallel_size=2"],
                                    ["parallel.pipeline_model_parallel_size=2"]], ids=["tp2xdp2", "pp2xdp2"])
def test_four_process_async_queue_trainer_on_two_real_servers(real_servers, tmp_path, layout):
    """torchrun, 4 processes (TP2 x DP2, PP2 x DP2): rank 0 holds the queue and starts the producer process, every rank
    trains each step and takes part in every push."""
    import subprocess

    marks = _marks(real_servers)
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_addr", "127.0.0.1",
           "--master_port", str(port), str(fi.FAULT_RUN), str(tmp_path),
           *_overrides(real_servers, "trainer.n_gpus_per_node=4", *layout)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    log = tmp_path / "launch.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=1200).returncode
    assert rc == 0, log.read_text()[-8000:]
    _check_run(tmp_path, real_servers, marks)


@pytest.mark.multiproc
def test_a_four_process_trainer_killed_during_a_push_resumes_and_trains_each_prompt_once(real_servers, tmp_path):
    """TP2 x DP2 under torchrun: rank 0 is SIGKILLed with the servers paused for the push of version 3 (the
    other ranks wait in the push's collectives until torchrun ends them). The restarted job resumes from
    checkpoint 2 against the same servers, resumes and empties them, and trains every prompt once."""
    more = _overrides(real_servers, "trainer.n_gpus_per_node=4", "parallel.tensor_model_parallel_size=2")
    crashed = fi._launch(tmp_path, *more, fault="weight_sync:3", fault_rank=0, nproc=4, timeout_s=900)
    assert crashed.returncode != 0 and "rank      : 0 " in crashed.stderr and "exitcode  : -9" in crashed.stderr, \
        crashed.stderr[-4000:]
    assert fi._last_good_checkpoint(tmp_path) == 2 and not (tmp_path / "summary.json").exists()
    marks = _marks(real_servers)
    restarted = fi._launch(tmp_path, *more, nproc=4, timeout_s=900)
    fi._ok(restarted)
    assert f"resumed from {tmp_path}/f/ckpt/global_step_2 at step 2" in restarted.stderr
    _check_run(tmp_path, real_servers, marks, resumed_at=2)
