"""Server launch: the SGLang command line, a real subprocess with its log, the health wait, and a real
gloo weight broadcast from the engine to a server process that joins the weight-update group."""

import socket
import sys
import time
from pathlib import Path

import pytest
import requests
import torch

from megatron_dapo.rollout import sglang_weights as sw
from megatron_dapo.rollout.sglang_engine import SGLangEngine
from megatron_dapo.rollout.sglang_server import (
    ServerStartError,
    SGLangServerSpec,
    build_launch_command,
    launch_server,
    launch_servers,
    wait_for_health,
)

SERVER_SCRIPT = str(Path(__file__).with_name("sglang_protocol_server.py"))
LAUNCHER = (sys.executable, SERVER_SCRIPT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        "--trust-remote-code",
    ]


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
        extra_args=("--max-lifetime-s", "30"),
    )
    proc = launch_server(
        build_launch_command(spec, launcher=LAUNCHER), url=spec.url, log_path=tmp_path / "s.log"
    )
    try:
        waited = wait_for_health(spec.url, timeout_s=30, poll_interval_s=0.1, server=proc)
        assert waited < 30
        info = requests.get(spec.url + "/get_server_info", timeout=5).json()
        assert (info["model_path"], info["tp_size"], info["mem_fraction_static"]) == ("toy", 2, 0.5)
        assert (info["speculative_algorithm"], info["speculative_num_draft_tokens"]) == ("EAGLE", 4)
    finally:
        code = proc.stop(timeout_s=10)
    assert not proc.is_running() and code is not None
    assert "protocol server ready" in proc.log_tail()


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
def test_distributed_update_broadcasts_every_bucket_to_a_server_process(tmp_path):
    spec = SGLangServerSpec(
        model_path="toy", port=_free_port(), extra_args=("--join-weight-groups", "--max-lifetime-s", "60")
    )
    proc = launch_server(
        build_launch_command(spec, launcher=LAUNCHER), url=spec.url, log_path=tmp_path / "w.log"
    )
    g = torch.Generator().manual_seed(1)
    named = [
        ("embed", torch.randn(8, 4, generator=g)),
        ("norm", torch.randn(4, generator=g).to(torch.bfloat16)),
        ("head", torch.randn(4, 8, generator=g)),
    ]  # 128 B, 8 B, 128 B
    try:
        wait_for_health(spec.url, timeout_s=30, poll_interval_s=0.1, server=proc)
        with SGLangEngine([spec.url]) as eng:
            eng.init_weights_update_group(
                master_address="127.0.0.1",
                master_port=_free_port(),
                backend="gloo",
                group_name="test_weights",
                timeout_s=30,
            )
            n = eng.update_weights_from_distributed(named, bucket_mb=140 / sw.MIB, policy_version=3)
            assert n == 2 and eng.policy_version == 3
            for name, t in named:
                got = requests.post(
                    spec.url + "/get_weights_by_name", json={"name": name, "truncate_size": 1000}, timeout=5
                ).json()
                assert got == t.flatten().float().tolist(), name
            eng.destroy_weights_update_group()
        received = requests.get(spec.url + "/_test/requests", timeout=5).json()
    finally:
        proc.stop(timeout_s=10)
    assert "Traceback" not in proc.log_tail(20000)
    bodies = {}
    for path, body in received:
        bodies.setdefault(path, []).append(body)
    assert bodies["/init_weights_update_group"] == [
        {
            "master_address": "127.0.0.1",
            "master_port": bodies["/init_weights_update_group"][0]["master_port"],
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "test_weights",
            "backend": "gloo",
        }
    ]
    updates = bodies["/update_weights_from_distributed"]
    assert [u["names"] for u in updates] == [["embed", "norm"], ["head"]]  # 136 B <= 140 B, then 128 B
    assert [u["dtypes"] for u in updates] == [["float32", "bfloat16"], ["float32"]]
    assert [u["shapes"] for u in updates] == [[[8, 4], [4]], [[4, 8]]]
    assert [(u["flush_cache"], u["weight_version"], u["group_name"]) for u in updates] == [
        (False, None, "test_weights"),
        (True, "3", "test_weights"),
    ]
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
    specs = [
        SGLangServerSpec(model_path="toy", port=_free_port(), extra_args=("--max-lifetime-s", "30"))
        for _ in range(2)
    ]
    servers = launch_servers(specs, log_dir=tmp_path, timeout_s=30, launcher=LAUNCHER)
    try:
        assert [s.url for s in servers] == [s.url for s in specs]
        assert all(requests.get(s.url + "/health", timeout=5).status_code == 200 for s in servers)
        assert (tmp_path / f"sglang_{specs[0].port}.log").exists()
    finally:
        for s in servers:
            s.stop(timeout_s=10)
    # the second server gets a flag the launcher rejects: it exits, and the first is stopped too
    bad = [specs[0], SGLangServerSpec(model_path="toy", port=_free_port(), extra_args=("--no-such-flag",))]
    with pytest.raises(ServerStartError, match="exited with code 2"):
        launch_servers(bad, log_dir=tmp_path / "bad", timeout_s=30, launcher=LAUNCHER)
    with pytest.raises(requests.ConnectionError):
        requests.get(specs[0].url + "/health", timeout=2)
