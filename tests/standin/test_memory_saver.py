"""The stand-in's memory-saver mode, rule by rule: with --enable-memory-saver it dies exactly where SGLang
0.5.23 dies on a GPU (tests/standin/server.py cites each line), so tests of colocated servers on CPU see the
faults only a GPU would show. Each rule on its own, by raw HTTP (no engine in between)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import requests

from tests.standin import StandinServer

SAVER = ["--enable-memory-saver"]


def _post(s, path, body):
    return requests.post(s.url + path, json=body, timeout=30)


def _in_background(fn) -> threading.Thread:
    """fn() in a thread whose connection error (the server dies under it) is expected."""
    def run():
        try:
            fn()
        except requests.ConnectionError:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _died(s, message: str) -> None:
    assert s.wait_exit(10) == 1, s.log_tail()
    assert "Scheduler hit an exception" in s.log_tail() and message in s.log_tail(), s.log_tail()


@pytest.mark.parametrize("tags", [["weights"], ["kv_cache"], None])
def test_a_generation_over_released_memory_kills_the_server(tmp_path, tags):
    with StandinServer(toy=True, args=SAVER, log_dir=tmp_path) as s:
        assert _post(s, "/release_memory_occupation", {"tags": tags}).status_code == 200
        with pytest.raises(requests.ConnectionError):
            _post(s, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        _died(s, "illegal memory access")


def test_health_is_a_generation_so_a_probe_of_a_released_server_kills_it(tmp_path):
    with StandinServer(toy=True, args=SAVER, log_dir=tmp_path) as s:
        assert requests.get(s.url + "/model_info", timeout=30).status_code == 200
        assert _post(s, "/release_memory_occupation", {"tags": ["weights", "kv_cache"]}).status_code == 200
        assert requests.get(s.url + "/model_info", timeout=30).status_code == 200  # no forward: fine
        with pytest.raises(requests.ConnectionError):
            requests.get(s.url + "/health", timeout=30)
        _died(s, "illegal memory access")


def test_with_the_health_generation_switched_off_health_does_not_generate(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
    with StandinServer(toy=True, args=SAVER, log_dir=tmp_path) as s:
        _post(s, "/release_memory_occupation", {"tags": None})
        assert requests.get(s.url + "/health", timeout=30).status_code == 200 and s.is_running()


def test_a_release_while_the_health_generation_runs_trips_the_idle_assert(tmp_path):
    with StandinServer(toy=True, args=SAVER, log_dir=tmp_path) as s:
        s.knobs(health_delay_s=1.0)
        _in_background(lambda: requests.get(s.url + "/health", timeout=30))
        while s.stats()["generate_inflight"] == 0:
            time.sleep(0.01)
        with pytest.raises(requests.ConnectionError):
            _post(s, "/release_memory_occupation", {"tags": None})
        _died(s, "release_memory_occupation should be called only when server is idle")


def test_a_release_while_a_request_runs_trips_the_idle_assert(tmp_path):
    with StandinServer(toy=True, args=SAVER, log_dir=tmp_path) as s:
        s.knobs(token_delay_s=0.05)
        _in_background(lambda: _post(s, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 40}}))
        while s.stats()["generate_inflight"] == 0:
            time.sleep(0.01)
        with pytest.raises(requests.ConnectionError):
            _post(s, "/release_memory_occupation", {"tags": ["kv_cache"]})
        _died(s, "release_memory_occupation should be called only when server is idle")


@pytest.mark.parametrize("released, resumed", [(None, None), (["kv_cache"], ["weights"]), ([], ["kv_cache"])])
def test_a_resume_of_a_tag_not_released_is_a_key_error_that_kills_the_server(tmp_path, released, resumed):
    with StandinServer(toy=True, args=SAVER, log_dir=tmp_path) as s:
        if released != []:
            _post(s, "/release_memory_occupation", {"tags": released})
            assert _post(s, "/resume_memory_occupation", {"tags": released}).status_code == 200  # each once: fine
        with pytest.raises(requests.ConnectionError):
            _post(s, "/resume_memory_occupation", {"tags": resumed})
        _died(s, "KeyError")


def test_without_the_memory_saver_release_is_a_no_op_as_on_the_cpu_server(tmp_path):
    with StandinServer(toy=True, log_dir=tmp_path) as s:
        _post(s, "/release_memory_occupation", {"tags": None})
        assert requests.get(s.url + "/health", timeout=30).status_code == 200
        r = _post(s, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200 and s.is_running() and s.stats()["released"] == []
        assert os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION") is None
