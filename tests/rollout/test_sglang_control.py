"""SGLangEngine control calls against the SGLang stand-in (its own process, SGLang 0.5.23's protocol):
memory release/resume, cache flush, health, abort with a server down, a closed engine."""

import threading
import time

import pytest

from megatron_dapo.rollout.base import PromptInput, RolloutEngineError, SamplingParams
from megatron_dapo.rollout.sglang.engine import AllServersDown, EngineRequestError, SGLangEngine
from tests.standin import StandinServer

SAVER = ["--enable-memory-saver", "--enable-deterministic-inference"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("standin")
    with StandinServer(toy=True, args=SAVER, log_dir=log_dir) as a, \
            StandinServer(toy=True, args=SAVER, log_dir=log_dir) as b:
        yield a, b


@pytest.fixture
def servers(pair):
    for s in pair:
        s.reset()
    return pair


def test_release_and_resume_memory_reach_every_server_with_tags(servers):
    a, b = servers
    with SGLangEngine([a.url, b.url]) as eng:
        eng.release_memory()
        assert a.stats()["released"] == ["cuda_graph", "kv_cache", "weights"] == b.stats()["released"]
        assert eng.pool.state == {a.url: "released", b.url: "released"}
        # generating while released is refused by the client: SGLang on a GPU would run it over freed memory
        with pytest.raises(RolloutEngineError, match="memory is released: call resume_memory first"):
            eng.generate([PromptInput("p", (1,))], SamplingParams(max_new_tokens=2))
        eng.resume_memory(tags=["weights"])
        assert a.stats()["released"] == ["cuda_graph", "kv_cache"]
        eng.resume_memory(tags=["kv_cache", "cuda_graph", "weights"])  # weights is resumed already: not sent again
        assert a.stats()["released"] == [] == b.stats()["released"]
        assert eng.generate([PromptInput("p", (1,))], SamplingParams(max_new_tokens=2))[0].finish_reason == "length"
        for s in (a, b):
            assert s.requests("/release_memory_occupation") == [{"tags": ["cuda_graph", "kv_cache", "weights"]}]
            assert s.requests("/resume_memory_occupation") == [{"tags": ["weights"]}, {"tags": ["cuda_graph", "kv_cache"]}]
        eng.flush_cache()
        assert a.paths().count("/flush_cache") == 1 and b.paths().count("/flush_cache") == 1


def test_flush_cache_is_refused_while_a_request_runs(servers):
    a, _ = servers
    a.knobs(token_delay_s=0.05)
    with SGLangEngine([a.url]) as eng:
        t = threading.Thread(target=eng.generate, args=([PromptInput("p", (1,))], SamplingParams(max_new_tokens=40)))
        t.start()
        try:
            deadline = time.monotonic() + 5
            while a.stats()["generate_inflight"] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            with pytest.raises(EngineRequestError, match=r"/flush_cache: HTTP 400: Flush cache failed"):
                eng.flush_cache()
        finally:
            eng.abort()
            t.join(timeout=10)


def test_a_release_waits_for_the_generation_in_flight_and_the_server_survives(tmp_path):
    """SGLang asserts the scheduler is idle in release_memory_occupation (the stand-in dies there as it
    does: tests/standin/test_memory_saver.py); the engine's release waits for the request to return."""
    with (StandinServer(toy=True, args=SAVER, log_dir=tmp_path) as s,
          SGLangEngine([s.url], max_retries=0) as eng):
        s.knobs(token_delay_s=0.02)
        done = []
        t = threading.Thread(target=lambda: done.append(
            eng.generate([PromptInput("p", (1,))], SamplingParams(max_new_tokens=20))))
        t.start()
        while s.stats()["generate_inflight"] == 0:
            time.sleep(0.01)
        eng.release_memory()
        # The release came after the reply: the stand-in, like SGLang, dies on a release while busy, and the
        # reply is whole. (generate returns to the thread just after the engine counted the request done.)
        assert s.is_running() and s.stats()["released"] == ["cuda_graph", "kv_cache", "weights"]
        t.join(timeout=10)
        assert done and done[0][0].finish_reason == "length" and len(done[0][0].response_token_ids) == 20
        eng.resume_memory()


def test_a_control_call_failing_on_one_server_marks_it_down_and_the_rest_go_on(servers, tmp_path):
    live = servers[0]
    doomed = StandinServer(toy=True, args=SAVER, log_dir=tmp_path).start()
    with SGLangEngine([live.url, doomed.url], connect_timeout_s=1.0) as eng:
        doomed.kill()
        eng.release_memory()  # no error: the unreachable server leaves the rotation
        assert eng.pool.state == {live.url: "released", doomed.url: "down"}
        assert eng.pool.last_error[doomed.url].startswith("/release_memory_occupation: ConnectionError")
        assert live.stats()["released"]  # the live server still got the call
        eng.resume_memory()
        assert live.stats()["released"] == [] and eng.pool.state[live.url] == "up"
    lone = StandinServer(toy=True, args=SAVER, log_dir=tmp_path).start()
    with SGLangEngine([lone.url], connect_timeout_s=1.0) as eng:
        lone.kill()
        with pytest.raises(AllServersDown, match=rf"release_memory_occupation failed on every server: {lone.url}"):
            eng.release_memory()


def test_health_reports_each_server_model_info_and_the_policy_version(servers, tmp_path):
    a, _ = servers
    with SGLangEngine([a.url], policy_version=4, health_check_interval_s=600) as eng:  # no poll in between
        h = eng.health()
        assert h["healthy"] is True and h["policy_version"] == 4
        assert h["servers"][0]["model_info"]["model_path"] == "toy"
        assert eng.health(deep=True)["healthy"] is True
        assert a.paths().count("/health_generate") == 1 and a.paths().count("/health") == 0
        assert a.paths().count("/model_info") == 3 and "/get_model_info" not in a.paths()  # not the deprecated one
        eng.release_memory()
        assert eng.health(deep=True)["servers"][0]["state"] == "released"
        assert a.paths().count("/health_generate") == 1 and a.is_running()  # released: no generating probe
        eng.resume_memory()
    doomed = StandinServer(toy=True, args=SAVER, log_dir=tmp_path).start()
    with SGLangEngine([doomed.url], connect_timeout_s=1.0, control_timeout_s=1.0) as eng:
        doomed.kill()
        h = eng.health()
        assert h["healthy"] is False and "ConnectionError" in h["servers"][0]["error"]


def test_abort_with_a_server_down_still_aborts_the_rest_and_returns(servers, tmp_path):
    live = servers[0]
    doomed = StandinServer(toy=True, args=SAVER, log_dir=tmp_path).start()
    with SGLangEngine([live.url, doomed.url], connect_timeout_s=1.0) as eng:
        doomed.kill()
        eng.abort()  # logs the failure, raises nothing
        assert live.requests("/abort_request") == [{"abort_all": True}]
        s = eng.generate([PromptInput("p", (1,))], SamplingParams(max_new_tokens=2, seed=0))
        assert s[0].finish_reason == "length"  # unaffected by the earlier abort


def test_a_closed_engine_refuses_to_generate(servers):
    eng = SGLangEngine([servers[0].url])
    eng.close()
    eng.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate([PromptInput("p", (1,))], SamplingParams(max_new_tokens=2))


def test_an_unreachable_server_is_an_error_at_connect():
    with pytest.raises(EngineRequestError, match=r"127\.0\.0\.1:9/server_info: cannot connect"):
        SGLangEngine(["http://127.0.0.1:9"], connect_timeout_s=1.0)
