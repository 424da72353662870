"""Fixtures of the real SGLang server tests: the SGLang venv, a tiny Qwen2 model, and two servers shared
by the whole test session.

The servers are real `sglang.launch_server` processes (SGLang 0.5.23 from PyPI, in the venv that
`make sglang-env` builds; tests/sglang_env holds the shims it needs on a CPU machine), started
through the trainer's own launch path (`rollout.sglang.build.sglang_launch_plan` -> `build_launch_command` ->
`launch_servers`), with the CPU settings given as configuration (CPU_SERVER). They serve the model in
fp32, so that their log-probs and greedy tokens can be compared with the fp32 actor's tightly.
Server 0 runs with --context-length (data.max_prompt_length + data.max_response_length + 2, as the
trainer launches) and decodes at most SERVER0_RUNNING sequences at once, server 1 without either (the
model's 512 positions). Both run without a radix cache, as the queue trainer's in-place weight pushes need.

A missing or broken SGLang venv fails these tests: they are never skipped.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time

import psutil
import pytest

from tests.standin import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
SGLANG_VENV = ROOT / ".venv-sglang"

PROMPT_LEN, RESPONSE_LEN = 24, 40
"""data.max_prompt_length / data.max_response_length the shared servers are launched for."""
SERVER0_RUNNING = 8
"""Server 0's --max-running-requests (the sequences it decodes at once; SGLang's default on this CPU is 2048)."""


def sglang_python() -> str:
    """The SGLang venv's interpreter ($MEGATRON_DAPO_SGLANG_PYTHON, else .venv-sglang/bin/python)."""
    path = os.environ.get("MEGATRON_DAPO_SGLANG_PYTHON") or str(SGLANG_VENV / "bin/python")
    if not os.access(path, os.X_OK):
        pytest.fail(f"no SGLang venv at {path}: build it with `make sglang-env` (make test does)", pytrace=False)
    return path


def cpu_server_overrides(*, tp: int = 1) -> list[str]:
    """Config overrides that launch SGLang 0.5.23 on a CPU machine (measured: ../notes real-sglang-on-cpu):
    the CPU platform needs SGLANG_USE_CPU_ENGINE=1, the default x86 attention backend (intel_amx) needs
    SGLang's compiled CPU kernels, so torch_native; the KV pool is sized from RAM unless bounded; an idle
    scheduler busy-polls half a core without --sleep-on-idle. A TP-2 server binds one core per rank."""
    env = ["SGLANG_USE_CPU_ENGINE=1", "OMP_NUM_THREADS=1"] + (["SGLANG_CPU_OMP_THREADS_BIND=0|1"] if tp == 2 else [])
    return [f"rollout.sglang_python={sglang_python()}", "rollout.server_device=cpu",
            "rollout.server_attention_backend=torch_native", "rollout.server_max_total_tokens=4096",
            f"rollout.server_env=[{','.join(env)}]", "rollout.server_extra_args=[--sleep-on-idle,--skip-server-warmup]",
            "rollout.require_memory_saver=false", "model.params_dtype=fp32"]


def free_port_pair() -> int:
    """A port p with p and p + 1 free on loopback (the trainer launches servers at consecutive ports), below
    the ephemeral range (tests.standin.free_port says why)."""
    return free_port(2)


def model_overrides(model_dir: str, tokenizer_dir: str) -> list[str]:
    return ["model.arch=hf", f"model.hf_path={model_dir}", f"data.tokenizer={tokenizer_dir}",
            f"data.max_prompt_length={PROMPT_LEN}", f"data.max_response_length={RESPONSE_LEN}"]


def server_tree(servers) -> set[int]:
    """PIDs of the servers and every process they spawned (scheduler, detokenizer, TP ranks)."""
    pids = set()
    for s in servers:
        try:
            proc = psutil.Process(s.process.pid)
            pids |= {proc.pid} | {c.pid for c in proc.children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    return pids


def assert_all_gone(pids: set[int], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return
        time.sleep(0.2)
    raise AssertionError(f"SGLang processes left running: {alive}")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """(model directory, tokenizer directory) of the tiny random Qwen2 (tests/sglang_real/model.py)."""
    from tests.sglang_real.model import write_tiny_qwen2

    return write_tiny_qwen2(str(tmp_path_factory.mktemp("tiny_qwen2") / "model"))


@dataclasses.dataclass
class RealServers:
    model_dir: str
    tokenizer_dir: str
    servers: list
    start_s: float
    """Seconds from launch until both answered /health."""

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]


@pytest.fixture(scope="session")
def real_servers(tiny_qwen2, tmp_path_factory):
    """Two real SGLang servers (TP 1, fp32) for the session; stopped at its end with nothing left behind."""
    from megatron_dapo.config import load_config
    from megatron_dapo.rollout.sglang.build import sglang_launch_plan
    from megatron_dapo.rollout.sglang.server import launch_servers, stop_servers

    model_dir, tokenizer_dir = tiny_qwen2
    log_dir = tmp_path_factory.mktemp("sglang_logs")
    cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), [
        *model_overrides(model_dir, tokenizer_dir), *cpu_server_overrides(), "rollout.engine=sglang",
        "trainer.n_gpus_per_node=2", f"rollout.server_base_port={free_port_pair()}", f"trainer.output_dir={log_dir}"])
    specs, launcher, env = sglang_launch_plan(cfg)
    assert len(specs) == 2 and specs[0].context_length == PROMPT_LEN + RESPONSE_LEN + 2
    # No radix cache: the queue trainer's pushes into running generation keep the servers' cache.
    specs[0] = dataclasses.replace(specs[0], extra_args=(*specs[0].extra_args, "--max-running-requests",
                                                         str(SERVER0_RUNNING), "--disable-radix-cache"))
    specs[1] = dataclasses.replace(specs[1], context_length=None,
                                   extra_args=(*specs[1].extra_args, "--disable-radix-cache"))
    t0 = time.monotonic()
    servers = launch_servers(specs, log_dir=log_dir, timeout_s=600, launcher=launcher, env=env)
    fixture = RealServers(model_dir, tokenizer_dir, servers, start_s=time.monotonic() - t0)
    print(f"\nreal SGLang servers {fixture.urls} up in {fixture.start_s:.1f} s")
    yield fixture
    pids = server_tree(servers)
    stop_servers(servers)
    assert_all_gone(pids)
