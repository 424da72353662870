"""SGLangEngine control calls: memory release/resume, cache flush, health, abort with a server down."""

import pytest

from megatron_dapo.rollout.base import PromptInput, SamplingParams
from megatron_dapo.rollout.sglang_engine import EngineRequestError, SGLangEngine

from .sglang_protocol_server import ProtocolServer


def test_release_and_resume_memory_reach_every_server_with_tags():
    with ProtocolServer() as a, ProtocolServer() as b, SGLangEngine([a.url, b.url]) as eng:
        eng.release_memory()
        assert a.state.released and b.state.released
        eng.resume_memory(tags=["weights"])
        assert not a.state.released and not b.state.released
        for s in (a, b):
            assert s.state.bodies("/release_memory_occupation") == [{"tags": None}]
            assert s.state.bodies("/resume_memory_occupation") == [{"tags": ["weights"]}]
        eng.flush_cache()
        assert a.state.paths().count("/flush_cache") == 1 and b.state.paths().count("/flush_cache") == 1


def test_a_control_call_fails_loudly_naming_the_unreachable_server():
    with ProtocolServer() as dead:
        dead_url = dead.url
    with ProtocolServer() as live, SGLangEngine([live.url, dead_url], connect_timeout_s=1.0) as eng:
        with pytest.raises(
            EngineRequestError, match=rf"{dead_url}/release_memory_occupation: ConnectionError"
        ):
            eng.release_memory()
        assert live.state.released  # the live server still got the call


def test_health_reports_each_server_model_info_and_the_policy_version():
    with ProtocolServer() as a, SGLangEngine([a.url], policy_version=4) as eng:
        h = eng.health()
        assert h["healthy"] is True and h["policy_version"] == 4
        assert h["servers"][0]["model_info"]["model_path"] == "toy-model"
        assert eng.health(deep=True)["healthy"] is True
        assert a.state.paths().count("/health") == 1 and a.state.paths().count("/health_generate") == 1
    with ProtocolServer() as dead:
        dead_url = dead.url
    with SGLangEngine([dead_url], connect_timeout_s=1.0, control_timeout_s=1.0) as eng:
        h = eng.health()
        assert h["healthy"] is False and "ConnectionError" in h["servers"][0]["error"]


def test_abort_with_a_server_down_still_aborts_the_rest_and_returns():
    with ProtocolServer() as dead:
        dead_url = dead.url
    with ProtocolServer() as live, SGLangEngine([live.url, dead_url], connect_timeout_s=1.0) as eng:
        eng.abort()  # logs the failure, raises nothing
        assert live.state.bodies("/abort_request") == [{"abort_all": True}]
        s = eng.generate([PromptInput("p", (1,))], SamplingParams(max_new_tokens=2, seed=0))
        assert s[0].finish_reason == "length"  # unaffected by the earlier abort


def test_a_closed_engine_refuses_to_generate():
    with ProtocolServer() as a:
        eng = SGLangEngine([a.url])
        eng.close()
        eng.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            eng.generate([PromptInput("p", (1,))], SamplingParams(max_new_tokens=2))
