"""Server launch: the SGLang command line, a real subprocess with its log, the health wait, and a real
gloo weight broadcast from the engine to a server process that joins the weight-update group. The
server is the SGLang stand-in (tests/standin), whose parser holds the emulated release's own flags."""

import sys
import time

import pytest
import requests
import torch

from megatron_dapo.rollout.sglang import weights as sw
from megatron_dapo.rollout.sglang.engine import SGLangEngine
from megatron_dapo.rollout.sglang.server import (
    ServerStartError,
    SGLangServerSpec,
    build_launch_command,
    launch_server,
    launch_servers,
    stop_servers,
    wait_for_health,
)
from tests.standin import LAUNCHER, StandinServer, available_versions, expected_checksums
from tests.standin import free_port as _free_port

TOY = ("--toy", "--max-lifetime-s", "60")


def test_launch_command_without_speculative_args():
    spec = SGLangServerSpec(
        model_path="/models/qwen", port=30001, tp_size=8, mem_fraction_static=0.85, dtype="bfloat16"
    )
    assert build_launch_command(spec, launcher=("python", "-m", "sglang.launch_server")) == [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/qwen",
        "--host",
        "127.0.0.1",
        "--port",
        "30001",
        "--tp-size",
        "8",
        "--mem-fraction-static",
        "0.85",
        "--dtype",
        "bfloat16",
    ]
    assert build_launch_command(spec)[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert spec.url == "http://127.0.0.1:30001"


def test_launch_command_with_mtp_speculative_args_and_colocation_flags():
    spec = SGLangServerSpec(
        model_path="m",
        port=1234,
        host="10.0.0.7",
        speculative_algorithm="NEXTN",
        speculative_num_steps=2,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=3,
        base_gpu_id=4,
        enable_memory_saver=True,
        deterministic_inference=True,
        context_length=4096,
        extra_args=("--trust-remote-code",),
    )
    cmd = build_launch_command(spec, launcher=("sglang",))
    assert cmd == [
        "sglang",
        "--model-path",
        "m",
        "--host",
        "10.0.0.7",
        "--port",
        "1234",
        "--tp-size",
        "1",
        "--mem-fraction-static",
        "0.85",
        "--dtype",
        "auto",
        "--context-length",
        "4096",
        "--base-gpu-id",
        "4",
        "--enable-memory-saver",
        "--enable-deterministic-inference",
        "--speculative-algorithm",
        "NEXTN",
        "--speculative-num-steps",
        "2",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "3",
        "--speculative-draft-model-path",  # the MTP layer lives in the model's own checkpoint
        "m",
        "--trust-remote-code",
    ]
    other = SGLangServerSpec(model_path="m", port=1, speculative_algorithm="EAGLE", speculative_draft_model_path="d")
    assert build_launch_command(other, launcher=())[-2:] == ["--speculative-draft-model-path", "d"]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"speculative_algorithm": "MEDUSA"}, "speculative_algorithm"),
        ({"speculative_algorithm": "EAGLE", "speculative_num_steps": 0}, "speculative_num_steps"),
        ({"host": "0.0.0.0"}, "host"),
        ({"tp_size": 0}, "tp_size"),
        ({"mem_fraction_static": 1.5}, "mem_fraction_static"),
        ({"port": 70000}, "port"),
        ({"model_path": ""}, "model_path"),
        ({"context_length": 1}, "context_length"),
    ],
)
def test_server_spec_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SGLangServerSpec\.{field}"):
        SGLangServerSpec(**{"model_path": "m", "port": 1, **kwargs})


def test_launched_server_becomes_healthy_receives_the_flags_and_stops(tmp_path):
    spec = SGLangServerSpec(
        model_path="toy",
        port=_free_port(),
        tp_size=2,
        mem_fraction_static=0.5,
        speculative_algorithm="EAGLE",
        speculative_num_draft_tokens=4,
        context_length=64,
        extra_args=TOY,
    )
    proc = launch_server(
        build_launch_command(spec, launcher=LAUNCHER), url=spec.url, log_path=tmp_path / "s.log"
    )
    try:
        waited = wait_for_health(spec.url, timeout_s=30, poll_interval_s=0.1, server=proc)
        assert waited < 30
        info = requests.get(spec.url + "/server_info", timeout=5).json()
        assert (info["model_path"], info["tp_size"], info["mem_fraction_static"]) == ("toy", 2, 0.5)
        assert (info["speculative_algorithm"], info["speculative_num_draft_tokens"]) == ("EAGLE", 4)
        assert (info["context_length"], info["version"]) == (64, "0.5.23")
    finally:
        code = proc.stop(timeout_s=10)
    assert not proc.is_running() and code is not None
    assert "The server is fired up and ready to roll!" in proc.log_tail()


@pytest.mark.parametrize("version", available_versions())
def test_every_flag_the_launcher_emits_exists_in_every_release_it_may_run(version):
    """build_launch_command's flags (all options on) are flags of each release (its own parser rejects
    any other with exit code 2), so the launch command works across the protocol assets."""
    import json

    from tests.standin.protocol import ASSETS

    flags = json.loads((ASSETS / f"protocol-{version}.json").read_text())["launch_flags"]
    spec = SGLangServerSpec(model_path="m", port=1, base_gpu_id=0, enable_memory_saver=True,
                            deterministic_inference=True, context_length=64, speculative_algorithm="EAGLE")
    emitted = [a for a in build_launch_command(spec, launcher=()) if a.startswith("--")]
    assert emitted and [f for f in emitted if f not in flags] == []


def test_wait_for_health_reports_an_exited_server_with_its_log(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('boom: no GPU'); sys.exit(3)"]
    proc = launch_server(cmd, url="http://127.0.0.1:9", log_path=tmp_path / "dead.log")
    proc.process.wait(timeout=30)
    with pytest.raises(ServerStartError, match=r"(?s)exited with code 3 .*boom: no GPU"):
        wait_for_health(proc.url, timeout_s=5, poll_interval_s=0.05, server=proc)


def test_wait_for_health_times_out_on_a_silent_address():
    with pytest.raises(ServerStartError, match=r"not healthy after 0 s \(last: ConnectionError"):
        wait_for_health(f"http://127.0.0.1:{_free_port()}", timeout_s=0.2, poll_interval_s=0.05)


@pytest.mark.multiproc
def test_distributed_update_broadcasts_every_bucket_to_every_server_tp_rank(tmp_path):
    g = torch.Generator().manual_seed(1)
    named = [
        ("embed", torch.randn(8, 4, generator=g)),
        ("norm", torch.randn(4, generator=g).to(torch.bfloat16)),
        ("head", torch.randn(4, 8, generator=g)),
    ]  # 128 B, 8 B, 128 B
    with StandinServer(toy=True, tp_size=2, log_dir=tmp_path) as srv:
        with SGLangEngine([srv.url], tp_size=2) as eng:
            eng.init_weights_update_group(master_address="127.0.0.1", master_port=_free_port(), backend="gloo",
                                          group_name="test_weights", timeout_s=30)
            n = eng.update_weights_from_distributed(named, bucket_mb=140 / sw.MIB, policy_version=3)
            assert n == 2 and eng.policy_version == 3
            got = requests.post(srv.url + "/get_weights_by_name", json={"name": "head", "truncate_size": 1000},
                                timeout=5).json()
            assert got == named[2][1].flatten().float().tolist()
            assert srv.checksums() == [expected_checksums(named)] * 2  # both TP ranks, every tensor
            eng.destroy_weights_update_group()
        bodies = {}
        for path, body in srv.requests():
            bodies.setdefault(path, []).append(body)
        assert srv.stats()["groups"] == [] and srv.ignored_fields() == {}
    assert "Traceback" not in srv.log_tail(20000)
    assert bodies["/init_weights_update_group"] == [
        {
            "master_address": "127.0.0.1",
            "master_port": bodies["/init_weights_update_group"][0]["master_port"],
            "rank_offset": 1,
            "world_size": 3,
            "group_name": "test_weights",
            "backend": "gloo",
        }
    ]
    updates = bodies["/update_weights_from_distributed"]
    assert [u["names"] for u in updates] == [["embed", "norm"], ["head"]]  # 136 B <= 140 B, then 128 B
    assert [u["dtypes"] for u in updates] == [["float32", "bfloat16"], ["float32"]]
    assert [u["shapes"] for u in updates] == [[[8, 4], [4]], [[4, 8]]]
    assert [(u["flush_cache"], u["weight_version"], u["group_name"], u["selector"]) for u in updates] == [
        (False, None, "test_weights", "all"),
        (True, "3", "test_weights", "all"),
    ]
    assert bodies["/begin_weight_update"] == [{"selector": "all"}] and bodies["/end_weight_update"] == [{}]
    assert bodies["/destroy_weights_update_group"] == [{"group_name": "test_weights"}]


def test_stop_also_ends_the_processes_the_server_spawned(tmp_path):
    import psutil

    script = (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "print('child', c.pid, flush=True)\n"
        "time.sleep(30)\n"
    )
    proc = launch_server(
        [sys.executable, "-c", script], url="http://127.0.0.1:9", log_path=tmp_path / "tree.log"
    )
    pid = None
    for _ in range(200):  # bounded wait (10 s) for the child's pid in the log
        words = proc.log_tail().split()
        if "child" in words and len(words) > words.index("child") + 1:
            pid = int(words[words.index("child") + 1])
            break
        time.sleep(0.05)
    assert pid is not None and psutil.pid_exists(pid)
    proc.stop(timeout_s=10)
    assert not proc.is_running()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_launch_servers_starts_all_and_a_failed_start_stops_the_others(tmp_path):
    specs = [SGLangServerSpec(model_path="toy", port=_free_port(), extra_args=TOY) for _ in range(2)]
    servers = launch_servers(specs, log_dir=tmp_path, timeout_s=30, launcher=LAUNCHER)
    try:
        assert [s.url for s in servers] == [s.url for s in specs]
        assert all(requests.get(s.url + "/health", timeout=5).status_code == 200 for s in servers)
        assert (tmp_path / f"sglang_{specs[0].port}.log").exists()
    finally:
        for s in servers:
            s.stop(timeout_s=10)
    # the second server gets a flag the launcher rejects: it exits, and the first is stopped too
    bad = [specs[0], SGLangServerSpec(model_path="toy", port=_free_port(), extra_args=(*TOY, "--no-such-flag"))]
    with pytest.raises(ServerStartError, match="exited with code 2"):
        launch_servers(bad, log_dir=tmp_path / "bad", timeout_s=30, launcher=LAUNCHER)
    with pytest.raises(requests.ConnectionError):
        requests.get(specs[0].url + "/health", timeout=2)


def test_the_trainer_launches_servers_with_the_context_length_and_deterministic_inference(monkeypatch, tmp_path):
    """rollout.deterministic_inference and the data limits reach every server's command line (issue #15
    items 1 and 2), and the engine is told to insist on seeded servers."""
    import pathlib

    from megatron_dapo.config import load_config
    from megatron_dapo.rollout.sglang import build as sglang_build
    from megatron_dapo.rollout.sglang import server as sglang_server

    root = pathlib.Path(__file__).resolve().parents[2]
    launched = []
    monkeypatch.setattr(sglang_server, "launch_servers", lambda specs, **kw: launched.extend(specs) or [])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for det in (True, False):
        launched.clear()
        cfg = load_config(str(root / "configs/tiny_cpu.yaml"), [
            "rollout.engine=sglang", "model.hf_path=/models/tiny", f"rollout.deterministic_inference={det}",
            "data.max_prompt_length=40", "data.max_response_length=24", f"trainer.output_dir={tmp_path}"])
        sglang_build.launch_sglang(cfg)
        assert launched and all(s.deterministic_inference is det and s.context_length == 66 for s in launched)
        cmd = build_launch_command(launched[0])
        assert cmd[cmd.index("--context-length") + 1] == "66"  # 40 + 24 + the 2 SGLang keeps back
        assert ("--enable-deterministic-inference" in cmd) is det


def test_the_trainer_engine_insists_on_seeded_servers_when_asked(monkeypatch, tmp_path):
    import pathlib
    import types

    from megatron_dapo.config import load_config
    from megatron_dapo.rollout.sglang import build as sglang_build
    from megatron_dapo.rollout.sglang import engine as sglang_engine

    root = pathlib.Path(__file__).resolve().parents[2]
    made = []

    class Recorder:
        policy_version = 0
        model_identity = None

        def __init__(self, urls, **kw):
            made.append(kw)

    monkeypatch.setattr(sglang_engine, "SGLangEngine", Recorder)
    for det in (True, False):
        cfg = load_config(str(root / "configs/tiny_cpu.yaml"), [
            "rollout.engine=sglang", "rollout.sglang_urls=[http://127.0.0.1:1]",
            f"rollout.deterministic_inference={det}", f"trainer.output_dir={tmp_path}"])
        sglang_build.build_engine(cfg, types.SimpleNamespace(rank=0, world_size=1, ctrl=None), vocab_size=64)
        assert made[-1]["require_deterministic"] is det


def test_a_server_launched_by_a_torchrun_rank_does_not_inherit_its_rendezvous(monkeypatch):
    """SGLang's scheduler joins the launching rank's torchrun store and hangs when it sees RANK, WORLD_SIZE,
    MASTER_PORT and TORCHELASTIC_USE_AGENT_STORE: the server's environment drops them, keeps the rest."""
    from megatron_dapo.rollout.sglang.server import server_environment

    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                 "GROUP_RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "x",
                 "OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NVTE_FUSED_ATTN": "0"}.items():
        monkeypatch.setenv(k, v)
    env = server_environment({"SGLANG_USE_CPU_ENGINE": "1", "MASTER_PORT": "1234"})
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "GROUP_RANK"} & set(env)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env and "NVTE_FUSED_ATTN" not in env  # the trainer's settings
    assert not [k for k in env if k.startswith("TORCHELASTIC_")]
    assert env["OMP_NUM_THREADS"] == "1" and env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["MASTER_PORT"] == "1234"  # what the configuration sets explicitly still applies


def test_launched_servers_answer_health_without_a_generation_unless_told_otherwise(monkeypatch):
    """SGLang 0.5.23's /health runs a forward, which on a colocated server with released memory kills it: the
    launch's and a relaunch's readiness waits poll /health, so launched servers get the generation off (the
    pool's generating probe is /health_generate, sent only where safe); a value the user sets wins."""
    from megatron_dapo.rollout.sglang.server import server_environment

    monkeypatch.delenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", raising=False)
    assert server_environment(None)["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"
    assert server_environment({"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "1"})[
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "1"
    monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true")
    assert server_environment(None)["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "true"


def test_servers_are_stopped_at_once_and_the_first_failure_is_raised_after_every_stop_returned():
    """stop_servers runs every stop together (each of these waits for all the others: one after the other,
    the barrier would time out), and a stop that fails does not leave the others running."""
    import threading

    barrier, stopped = threading.Barrier(4, timeout=30), []

    class Server:
        def __init__(self, name, fails=False):
            self.name, self.fails = name, fails

        def stop(self):
            barrier.wait()
            stopped.append(self.name)
            if self.fails:
                raise RuntimeError(f"{self.name} would not stop")

    stop_servers([Server("a"), Server("b"), Server("c"), Server("d")])
    assert sorted(stopped) == ["a", "b", "c", "d"]
    stopped.clear()
    barrier.reset()
    with pytest.raises(RuntimeError, match="c would not stop"):
        stop_servers([Server("a"), Server("b"), Server("c", fails=True), Server("d")])
    assert sorted(stopped) == ["a", "b", "c", "d"]
    stop_servers([])  # nothing launched: nothing to do
