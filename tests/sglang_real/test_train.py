"""The trainer against real SGLang 0.5.23 servers: `python -m megatron_dapo.train` with rollout.sglang_urls,
2-process layouts (TP2, DP2, PP2) with every tensor checked at every server after every sync, and the
trainer launching its own server (TP 2). The Qwen3-MoE model's tests (training against it, R3): test_moe_server.py.

Tolerances: the servers run fp32 (conftest), like the actor, so the actor's recomputed log-probs and the
servers' differ by kernel round-off only (a Megatron forward against SGLang's torch_native attention,
summed in other orders): 1e-5 on the mean per step, 2e-4 on the worst of a 20-token probe. A server that
missed one tensor of one layer after a step at lr 5e-3 is off by far more (the probe moves by > 1e-3
between versions, asserted)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.sglang_real.conftest import (
    ROOT,
    cpu_server_overrides,
    free_port_pair,
    model_overrides,
)
from tests.standin import free_port

STEPS = 3
MEAN_DIFF_TOL = 1e-5
PROBE_DIFF_TOL = 2e-4


def train_overrides(model_dir: str, tokenizer_dir: str, *more: str) -> list[str]:
    return [*model_overrides(model_dir, tokenizer_dir), "rollout.engine=sglang", "model.params_dtype=fp32",
            "rollout.require_memory_saver=false", "rollout.weight_sync_bucket_mb=0.02", "trainer.sft_warmup_steps=0",
            "algorithm.filter_groups.enable=false", "data.gen_batch_size=null", "data.train_batch_size=4",
            "rollout.n=4", "actor.ppo_mini_batch_size=2", "reward.overlong_buffer.len=4", "trainer.test_freq=0",
            "trainer.val_before_train=false", "trainer.logger=[tensorboard]", f"trainer.total_training_steps={STEPS}",
            "trainer.save_freq=-1", "actor.lr=5e-3", "actor.lr_warmup_steps=0", *more]


def _urls(real_servers) -> str:
    return f"rollout.sglang_urls=[{','.join(real_servers.urls)}]"


def _run(cmd: list[str], out: pathlib.Path, timeout_s: int = 900) -> None:
    out.mkdir(parents=True, exist_ok=True)
    log = out / "launch.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    with open(log, "w") as f:  # a file, not a pipe: torch_shm_manager may outlive the launch (ipc on CPU)
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
    assert rc == 0, log.read_text()[-8000:]


def _scalars(out: pathlib.Path) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(out / "tiny_cpu/tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


def _check_log_probs(scalars) -> None:
    diffs = scalars["rollout_corr/log_prob_abs_diff"]
    assert sorted(diffs) == list(range(1, STEPS + 1)), diffs
    assert all(d < MEAN_DIFF_TOL for d in diffs.values()), diffs
    # The peers' gates (trainer/mismatch.py), far inside their alarms (1.05, 0.015) at fp32 round-off.
    assert all(v < 1 + 5 * MEAN_DIFF_TOL for v in scalars["rollout_corr/token_mult_prob_error"].values())
    assert all(0 <= v < 1e-7 for v in scalars["rollout_corr/mismatch_kl"].values())


def _routes(server, mark: int) -> list[str]:
    """The POST routes the server answered since `mark` (its access log), repeats collapsed."""
    posts = re.findall(r'"POST (/[a-z_]+) HTTP', server.log_path.read_text(errors="replace")[mark:])
    return [r for i, r in enumerate(posts) if i == 0 or r != posts[i - 1]]


def test_python_m_train_against_real_servers(real_servers, tmp_path):
    """3 steps, colocated mode (the servers share no accelerator memory: require_memory_saver=false):
    every row carries the weight version the servers report, equal to its step's policy version; the
    actor's log-probs of the rollouts equal the servers' to round-off; each server sees memory release
    and resume around every sync in the trainer's order (no-ops on CPU, but called), and with the health
    poller at 0.2 s no /health or /health_generate (a generation in SGLang 0.5.23) between a release and the
    last resume after it, only /model_info (on a GPU that probe would run over freed memory)."""
    marks = [len(s.log_path.read_text(errors="replace")) for s in real_servers.servers]
    dumps = tmp_path / "rollouts"
    _run([sys.executable, "-m", "megatron_dapo.train", "--config", "configs/tiny_cpu.yaml",
          *train_overrides(real_servers.model_dir, real_servers.tokenizer_dir, _urls(real_servers),
                           "rollout.mode=colocate", f"trainer.rollout_data_dir={dumps}",
                           "rollout.health_check_interval_s=0.2", f"trainer.output_dir={tmp_path}")], tmp_path)
    _check_log_probs(_scalars(tmp_path))
    for step in range(1, STEPS + 1):
        rows = [json.loads(line) for line in (dumps / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(rows) == 16 and {r["policy_version"] for r in rows} == {step - 1}, step
    # The start sync, then per step: release after generation, weights back, the sync, the KV cache back.
    # (One /generate request per step carries all 16 rows and goes to one server, in turn.)
    start = ["/init_weights_update_group", "/begin_weight_update", "/update_weights_from_distributed",
             "/end_weight_update"]
    step = ["/release_memory_occupation", "/resume_memory_occupation", "/begin_weight_update",
            "/update_weights_from_distributed", "/end_weight_update", "/resume_memory_occupation"]
    for server, mark in zip(real_servers.servers, marks, strict=True):
        routes = _routes(server, mark)
        assert "/generate" in routes, server.url
        control = [r for r in routes if r != "/generate"]
        assert control == start + step * STEPS + ["/destroy_weights_update_group"], (server.url, " ".join(control))
        released, probes = 0, {"/health": 0, "/health_generate": 0, "/model_info": 0}  # probes while released
        for _method, route in re.findall(r'"(GET|POST) (/[a-z_]+) HTTP', server.log_path.read_text(errors="replace")[mark:]):
            if route == "/release_memory_occupation":
                released = 2  # weights and KV cache, resumed one call each
            elif route == "/resume_memory_occupation":
                released -= 1
            elif released and route in probes:
                probes[route] += 1
        assert probes["/health"] == probes["/health_generate"] == 0 and probes["/model_info"] > 0, (server.url, probes)


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [
    ["parallel.tensor_model_parallel_size=2"],
    ["parallel.pipeline_model_parallel_size=2"],
    [],  # data parallel 2
], ids=["tp2", "pp2", "dp2"])
def test_two_process_layouts_reach_every_server_with_every_tensor(real_servers, tmp_path, layout):
    port = free_port()
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
          "--master_port", str(port), str(ROOT / "tests/sglang_real/_mp_train.py"), str(tmp_path),
          *train_overrides(real_servers.model_dir, real_servers.tokenizer_dir, _urls(real_servers),
                           "rollout.mode=disaggregate", "trainer.n_gpus_per_node=2", "actor.entropy_coeff=0.01",
                           *layout)], tmp_path)
    _check_log_probs(_scalars(tmp_path))
    report = json.loads((tmp_path / "report.json").read_text())
    assert [e["version"] for e in report] == list(range(STEPS + 1))
    for entry in report:
        for url in real_servers.urls:
            got = entry["servers"][url]
            assert got["weight_version"] == str(entry["version"])
            assert got["max_abs_diff"] < PROBE_DIFF_TOL, (entry["version"], url, got["max_abs_diff"])
    # Every step moves the weights (the entropy bonus has a gradient even when every group scored alike
    # and the advantages are zero), so a stale tensor at any server would show above.
    for prev, entry in zip(report, report[1:]):
        for url in real_servers.urls:
            moved = max(abs(a - b) for a, b in zip(entry["servers"][url]["logprobs"], prev["servers"][url]["logprobs"]))
            assert moved > 10 * PROBE_DIFF_TOL, (entry["version"], url, moved)

def _processes_in(directory: pathlib.Path) -> list:
    """Live processes whose working directory is under `directory` (launched servers run in their log
    directory; SGLang's scheduler and detokenizer inherit it)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cwd", "status"]):
        cwd = proc.info.get("cwd")
        if cwd and cwd.startswith(str(directory)) and proc.info.get("status") != psutil.STATUS_ZOMBIE:
            found.append(proc.info["pid"])
    return found


def _self_launched(tmp_path, model_dir, tokenizer_dir, *more) -> tuple[dict, list[pathlib.Path]]:
    """python -m megatron_dapo.train launching its own servers (no rollout.sglang_urls); returns the TB
    scalars and the servers' logs, after checking that no server process is left running."""
    _run([sys.executable, "-m", "megatron_dapo.train", "--config", "configs/tiny_cpu.yaml",
          *train_overrides(model_dir, tokenizer_dir, f"rollout.server_base_port={free_port_pair()}",
                           f"trainer.output_dir={tmp_path}", *more)], tmp_path)
    logs = sorted((tmp_path / "tiny_cpu/sglang").glob("sglang_*.log"))
    assert logs, "no server log"
    assert "The server is fired up and ready to roll" in logs[0].read_text(errors="replace")
    assert _processes_in(tmp_path / "tiny_cpu/sglang") == []
    return _scalars(tmp_path), logs


def test_the_trainer_launches_a_tp2_server_itself_and_leaves_nothing_running(tiny_qwen2, tmp_path):
    """No rollout.sglang_urls: the trainer starts SGLang from rollout.sglang_python with the CPU settings
    of the configuration (device, attention backend, environment), at server TP 2, syncs over the
    distributed transport (a gloo group of the trainer and both TP ranks), and stops it at the end."""
    scalars, logs = _self_launched(tmp_path, *tiny_qwen2, *cpu_server_overrides(tp=2),
                                   "rollout.tensor_model_parallel_size=2", "rollout.mode=disaggregate")
    _check_log_probs(scalars)
    text = logs[0].read_text(errors="replace")
    assert len(logs) == 1 and "'tp_size': 2" in text and "'device': 'cpu'" in text
