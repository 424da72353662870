"""Issue #15: the SGLang client per release. Each point runs against the stand-in speaking the release it
claims (tests/standin, its protocol read from that release's wheel), and the release table is checked
against what the wheels say (tests/assets/sglang)."""

import json
import logging

import pytest
import torch
import torch.multiprocessing as tmp

from megatron_dapo.rollout.base import PromptInput, RolloutEngineError, SamplingParams
from megatron_dapo.rollout.sglang.engine import EngineRequestError, SGLangEngine
from megatron_dapo.rollout.sglang.server import (
    SGLangServerSpec,
    build_launch_command,
    launch_server,
    wait_for_health,
)
from megatron_dapo.rollout.sglang.versions import (
    SUPPORTED,
    UnsupportedSGLangVersion,
    features_for,
    parse_version,
)
from tests.standin import LAUNCHER, StandinServer, available_versions, expected_checksums, free_port
from tests.standin.protocol import ASSETS, version_key

IN_RANGE = [v for v in available_versions() if version_key(SUPPORTED[0]) <= version_key(v) <= version_key(SUPPORTED[1])]
PROMPT = [PromptInput("p", (3, 1, 4))]


def test_the_supported_range_and_the_releases_the_tests_speak():
    assert SUPPORTED == ("0.5.8", "0.5.23")
    assert IN_RANGE == ["0.5.8", "0.5.11", "0.5.12", "0.5.20", "0.5.21", "0.5.22", "0.5.23"]
    assert parse_version("0.5.13.post1") == (0, 5, 13) and parse_version("0.5.24.dev3+g1a2b") == (0, 5, 24)


@pytest.mark.parametrize("version, want", [
    ("0.5.8", ("/model_info", "/server_info", "spec_draft_token_num", "spec_accept_token_num", False)),
    ("0.5.10", ("/model_info", "/server_info", "spec_draft_token_num", "spec_accept_token_num", False)),
    ("0.5.11", ("/model_info", "/server_info", "spec_proposed_drafts", "spec_accepted_drafts", False)),
    ("0.5.12", ("/model_info", "/server_info", "spec_num_proposed_drafts", "spec_num_correct_drafts", False)),
    ("0.5.20", ("/model_info", "/server_info", "spec_num_proposed_drafts", "spec_num_correct_drafts", False)),
    ("0.5.21", ("/model_info", "/server_info", "spec_num_proposed_drafts", "spec_num_correct_drafts", True)),
    ("0.5.23.post1", ("/model_info", "/server_info", "spec_num_proposed_drafts", "spec_num_correct_drafts", True)),
])
def test_release_table(version, want):
    f = features_for(version)
    assert (f.model_info_path, f.server_info_path, f.spec_proposed_key, f.spec_accepted_key,
            f.weight_update_session) == want
    assert f.update_selector == f.weight_update_session


@pytest.mark.parametrize("version", ["0.5.5", "0.4.10", "0.5.24", "1.0.0"])
def test_a_release_outside_the_range_is_a_named_error(version):
    with pytest.raises(UnsupportedSGLangVersion, match=rf"runs SGLang {version}; megatron_dapo supports SGLang "
                                                       r"0\.5\.8 to 0\.5\.23"):
        features_for(version)


@pytest.mark.parametrize("version", IN_RANGE)
def test_release_table_agrees_with_the_wheel(version):
    """Each table entry is what the release's own source has (tools/sglang_protocol.py extracted it)."""
    p = json.loads((ASSETS / f"protocol-{version}.json").read_text())
    f = features_for(version)
    assert f.model_info_path in p["routes"] and f.server_info_path in p["routes"]
    assert {f.spec_proposed_key, f.spec_accepted_key, "spec_verify_ct"} <= set(p["meta_info_keys"])
    assert f.weight_update_session == ("/begin_weight_update" in p["routes"] and "/end_weight_update" in p["routes"])
    for cls in ("UpdateWeightsFromDistributedReqInput", "UpdateWeightsFromTensorReqInput"):
        assert f.update_selector == ("selector" in p["request_classes"][cls]["fields"])
    assert "/abort_request" in p["routes"] and "rid" in p["request_classes"]["AbortReq"]["fields"]
    assert "sampling_seed" in p["sampling_params"] and "--enable-deterministic-inference" in p["launch_flags"]
    assert "min_new_tokens" in p["sampling_params"]  # SamplingParams.min_new_tokens is sent as is
    assert "--context-length" in p["launch_flags"] and "/destroy_weights_update_group" in p["routes"]


def test_connect_refuses_a_release_below_the_range(tmp_path):
    # 0.5.5 has no /server_info: the engine reads the deprecated /get_server_info and refuses the release
    with StandinServer(toy=True, emulate_version="0.5.5", log_dir=tmp_path) as s:
        with pytest.raises(UnsupportedSGLangVersion, match=r"runs SGLang 0\.5\.5; megatron_dapo supports"):
            SGLangEngine([s.url])
        assert s.paths() == ["/server_info", "/get_server_info"]


def test_connect_refuses_servers_of_different_releases(tmp_path):
    with StandinServer(toy=True, emulate_version="0.5.8", log_dir=tmp_path) as a, \
            StandinServer(toy=True, log_dir=tmp_path) as b:
        with pytest.raises(UnsupportedSGLangVersion, match=r"different SGLang releases .*0\.5\.8.*0\.5\.23"):
            SGLangEngine([a.url, b.url])


@pytest.mark.parametrize("version", ["0.5.8", "0.5.11", "0.5.12", "0.5.20", "0.5.23"])
def test_speculative_counters_are_read_under_each_releases_names(tmp_path, version):
    """Item 3: 5 tokens = 1 from the prefill + 2 verify steps (the stand-in accepts one draft per step):
    accepted 2, proposed 2 x (4 - 1). A 1-token response had no verify step: SGLang sends no counters."""
    args = ["--enable-deterministic-inference", "--speculative-algorithm", "EAGLE", "--speculative-num-draft-tokens", "4"]
    with StandinServer(toy=True, emulate_version=version, args=args, log_dir=tmp_path) as s, SGLangEngine([s.url]) as eng:
        five = eng.generate(PROMPT, SamplingParams(max_new_tokens=5, seed=0))[0]
        one = eng.generate(PROMPT, SamplingParams(max_new_tokens=1, seed=0))[0]
    assert five.meta == {"spec_draft_tokens": 6, "spec_accepted_tokens": 2, "spec_verify_ct": 2}
    assert one.meta == {}


def _launch(spec, tmp_path, version):
    extra = ("--toy", "--emulate-version", version, "--max-lifetime-s", "60")
    spec = SGLangServerSpec(**{**spec.__dict__, "extra_args": extra})
    proc = launch_server(build_launch_command(spec, launcher=LAUNCHER), url=spec.url, log_path=tmp_path / "s.log")
    wait_for_health(spec.url, timeout_s=60, poll_interval_s=0.05, server=proc)
    return proc


@pytest.mark.parametrize("version", ["0.5.8", "0.5.23"])
def test_the_launcher_passes_the_context_length_so_the_pre_check_runs(tmp_path, version):
    """Item 1: SGLang reports its scheduler's max_req_input_len in /server_info, with or without
    --context-length; the engine refuses what the scheduler would cut."""
    port = free_port()
    proc = _launch(SGLangServerSpec(model_path="toy", port=port, context_length=16), tmp_path, version)
    try:
        with SGLangEngine([f"http://127.0.0.1:{port}"]) as eng:
            assert eng.max_sequence_length == 14 and eng.sglang_version == version  # context - 2
            with pytest.raises(ValueError, match=r"12 prompt tokens \+ max_new_tokens=8 = 20 > 14, the longest"):
                eng.generate([PromptInput("p", tuple(range(1, 13)))], SamplingParams(max_new_tokens=8))
    finally:
        proc.stop(timeout_s=10)
    with StandinServer(toy=True, emulate_version=version, log_dir=tmp_path) as s, SGLangEngine([s.url]) as eng:
        assert eng.max_sequence_length == (1 << 20) - 2  # without --context-length: the model's, less 2


@pytest.mark.parametrize("version", ["0.5.8", "0.5.23"])
def test_seeds_are_sent_and_honoured_only_with_deterministic_inference(tmp_path, version, caplog):
    """Item 2: sampling_seed takes effect only under --enable-deterministic-inference (which the
    launcher now passes when rollout.deterministic_inference is set)."""
    sp = SamplingParams(max_new_tokens=6, n=2, seed=7)
    port = free_port()
    proc = _launch(SGLangServerSpec(model_path="toy", port=port, deterministic_inference=True), tmp_path, version)
    try:
        with SGLangEngine([f"http://127.0.0.1:{port}"], require_deterministic=True) as eng:
            assert eng.seeds_honoured
            first, again = eng.generate(PROMPT, sp), eng.generate(PROMPT, sp)
        assert [s.response_token_ids for s in first] == [s.response_token_ids for s in again]
    finally:
        proc.stop(timeout_s=10)
    with StandinServer(toy=True, emulate_version=version, log_dir=tmp_path) as s:
        with pytest.raises(RolloutEngineError, match="without --enable-deterministic-inference"):
            SGLangEngine([s.url], require_deterministic=True)
        with SGLangEngine([s.url]) as eng, caplog.at_level(logging.WARNING):
            assert not eng.seeds_honoured
            eng.generate(PROMPT, sp)
            eng.generate(PROMPT, sp)
        assert all("sampling_seed" not in p for b in s.requests("/generate") for p in b["sampling_params"])
        warned = [r for r in caplog.records if "sampling seeds are not sent" in r.getMessage()]
        assert len(warned) == 1  # once per engine, not per call


@pytest.fixture
def file_system_sharing():
    """CPU tensors by named shared memory, which a server process can open (see test_sglang_weights)."""
    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    yield
    tmp.set_sharing_strategy(before)


def _named():
    g = torch.Generator().manual_seed(2)
    return [("a", torch.randn(3, 4, generator=g)), ("b", torch.randn(5, generator=g))]


@pytest.mark.parametrize("version", ["0.5.8", "0.5.20", "0.5.21", "0.5.23"])
def test_weight_updates_run_in_a_session_where_the_release_has_one(tmp_path, file_system_sharing, version):
    """Item 4: 0.5.21+ refuses tensor / distributed updates outside /begin_weight_update ...
    /end_weight_update; earlier releases have no such routes (and would ignore a `selector`)."""
    with StandinServer(toy=True, emulate_version=version, log_dir=tmp_path) as s, SGLangEngine([s.url]) as eng:
        eng.update_weights(_named(), policy_version=1, bucket_mb=1)
        session = version_key(version) >= (0, 5, 21)
        paths = [p for p in s.paths() if "weight" in p]
        assert paths == (["/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"] if session
                         else ["/update_weights_from_tensor"])
        assert ("selector" in s.requests("/update_weights_from_tensor")[0]) == session
        assert s.ignored_fields() == {} and s.checksums() == [expected_checksums(_named())]


def test_the_drafter_is_selected_through_the_session_selector(tmp_path, file_system_sharing):
    args = ["--speculative-algorithm", "EAGLE"]
    with StandinServer(toy=True, args=args, log_dir=tmp_path) as s, SGLangEngine([s.url]) as eng:
        with eng.weight_update_session(selector="draft"):
            eng.update_weights(_named(), policy_version=1, bucket_mb=1)  # runs inside, no second begin
            with pytest.raises(RolloutEngineError, match="selector 'draft' is already open"):
                with eng.weight_update_session(selector="target"):
                    pass
        assert s.requests("/begin_weight_update") == [{"selector": "draft"}]
        assert [b["selector"] for b in s.requests("/update_weights_from_tensor")] == ["draft"]
        assert s.checksums(role="draft") == [expected_checksums(_named())] and s.checksums() == [{}]
        with pytest.raises(ValueError, match="selector must be one of"):
            with eng.weight_update_session(selector="mtp"):
                pass


def test_a_begin_refused_on_one_server_takes_it_out_and_the_session_goes_on_with_the_others(tmp_path):
    with StandinServer(toy=True, log_dir=tmp_path) as a, StandinServer(toy=True, log_dir=tmp_path) as b:
        import requests

        assert requests.post(b.url + "/begin_weight_update", json={}, timeout=5).status_code == 200  # left open
        with SGLangEngine([a.url, b.url]) as eng:
            with eng.weight_update_session():
                assert a.stats()["session"] is not None
            assert eng.pool.state == {a.url: "up", b.url: "down"}
            assert eng.pool.last_error[b.url].startswith("/begin_weight_update: HTTP 400")
        assert a.stats()["session"] is None  # closed again at the end
        with SGLangEngine([b.url]) as eng:  # refused on every server: the error, nothing opened
            with pytest.raises(EngineRequestError, match=r"/begin_weight_update: HTTP 400: .*already open"):
                with eng.weight_update_session():
                    pass


@pytest.mark.parametrize("version", ["0.5.8", "0.5.23"])
def test_model_and_server_info_use_the_current_routes(tmp_path, version):
    """Item 5: /get_model_info and /get_server_info are deprecated from 0.5.8 (a warning per call)."""
    with (StandinServer(toy=True, emulate_version=version, log_dir=tmp_path) as s,
          SGLangEngine([s.url], health_check_interval_s=600) as eng):
        assert eng.health()["servers"][0]["model_info"]["weight_version"] == "default"
        assert s.paths() == ["/server_info", "/model_info", "/model_info"]  # connect, then health()


def test_running_capacity_is_what_the_schedulers_decode_at_once():
    from megatron_dapo.rollout.sglang.versions import running_capacity

    per_dp = {"effective_max_running_requests_per_dp": 48}
    assert running_capacity({"internal_states": [per_dp, per_dp], "max_running_requests": 8}) == 96  # 2 DP ranks
    assert running_capacity({"internal_states": [{}], "max_running_requests": 8}) == 8  # older: the launch flag
    assert running_capacity({"max_running_requests": None}) is None
    assert running_capacity({"internal_states": [{"effective_max_running_requests_per_dp": True}]}) is None


def test_the_gpu_extra_pins_sglang_to_the_supported_range():
    import pathlib
    import tomllib

    pyproject = tomllib.loads((pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    (spec,) = [s for s in pyproject["project"]["optional-dependencies"]["gpu"] if s.startswith("sglang")]
    assert spec == f"sglang>={SUPPORTED[0]},<={SUPPORTED[1]}"
