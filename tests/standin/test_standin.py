"""The SGLang stand-in itself: its HF model samples and scores like a plain transformers forward, weights
sent over gloo weight-update groups reach every TP rank and change its output, and it refuses what the
release it emulates refuses (503 until loaded, 400 / 500 per release, unknown launch flags)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file

from megatron_dapo.rollout.base import PromptInput, SamplingParams
from megatron_dapo.rollout.sglang.engine import EngineRequestError, SGLangEngine
from tests.models.conftest import make_hf_model
from tests.standin import LAUNCHER, StandinServer, expected_checksums, free_port
from tests.standin.protocol import ASSETS

DET = ["--enable-deterministic-inference"]
PROMPTS = [PromptInput("a", (5, 17, 3, 99, 42)), PromptInput("b", (7, 7, 1))]
# fp32 in two processes (KV-cache decode there, one full forward here, different thread counts):
# differences are round-off of ~1e-6; 1e-4 also covers log_softmax of 128 logits.
ATOL = 1e-4


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    out = {}
    for name in ("qwen2", "qwen3_moe"):
        for seed in (1, 2):
            d = tmp_path_factory.mktemp(f"{name}_{seed}")
            make_hf_model(name, d, seed=seed)
            out[name, seed] = str(d)
    return out


@pytest.fixture(scope="module")
def hf_servers(hf_dirs, tmp_path_factory):
    """One server per architecture for the module (a test that replaces weights puts model 1 back)."""
    d = tmp_path_factory.mktemp("hf_standin")
    with StandinServer(model_path=hf_dirs["qwen2", 1], args=[*DET, "--enable-memory-saver"], log_dir=d) as dense, \
            StandinServer(model_path=hf_dirs["qwen3_moe", 1], tp_size=2, args=DET, log_dir=d) as moe:
        yield {"qwen2": dense, "qwen3_moe": moe}


@pytest.fixture
def hf(hf_servers):
    for s in hf_servers.values():
        s.reset()
    return hf_servers


def _reference(hf_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def _reference_logprobs(model, prompt, tokens, temperature):
    """log_softmax(logits / T) of each generated token, from one forward of prompt + tokens."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: -1].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp.gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1), logits.argmax(-1)


@pytest.mark.parametrize("name", ["qwen2", "qwen3_moe"])
def test_hf_logprobs_equal_a_plain_transformers_forward(hf_dirs, hf, name):
    ref = _reference(hf_dirs[name, 1])
    s = hf[name]
    with SGLangEngine([s.url], tp_size=s.tp_size) as eng:
        sampled = eng.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.7, top_k=20, top_p=0.9, seed=3))
        again = eng.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.7, top_k=20, top_p=0.9, seed=3))
        greedy = eng.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0))
    for sample, prompt in zip(sampled, PROMPTS, strict=True):
        want, _ = _reference_logprobs(ref, prompt.token_ids, sample.response_token_ids, 0.7)
        torch.testing.assert_close(torch.tensor(sample.rollout_log_probs), want, rtol=0, atol=ATOL)
    assert [s.response_token_ids for s in sampled] == [s.response_token_ids for s in again]  # seeded
    for sample, prompt in zip(greedy, PROMPTS, strict=True):
        want, argmax = _reference_logprobs(ref, prompt.token_ids, sample.response_token_ids, 1.0)
        assert list(sample.response_token_ids) == argmax.tolist()  # greedy = top_k 1 at temperature 1
        torch.testing.assert_close(torch.tensor(sample.rollout_log_probs), want, rtol=0, atol=ATOL)


def _greedy_logprobs(eng, ref):
    out = eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0))
    for sample, prompt in zip(out, PROMPTS, strict=True):
        want, argmax = _reference_logprobs(ref, prompt.token_ids, sample.response_token_ids, 1.0)
        assert list(sample.response_token_ids) == argmax.tolist()
        torch.testing.assert_close(torch.tensor(sample.rollout_log_probs), want, rtol=0, atol=ATOL)
    return out


@pytest.mark.multiproc
def test_weights_over_two_gloo_groups_reach_every_tp_rank_and_change_the_output(hf_dirs, hf):
    """Two senders (one weight-update group each, as one per pipeline stage) push model 2's HF tensors
    into a tp_size=2 server running model 1; one coordinator session spans both (0.5.23)."""
    new = load_file(next(Path(hf_dirs["qwen3_moe", 2]).glob("*.safetensors")))
    names = sorted(new)
    halves = [[(n, new[n]) for n in names[: len(names) // 2]], [(n, new[n]) for n in names[len(names) // 2:]]]
    s = hf["qwen3_moe"]
    with SGLangEngine([s.url], tp_size=2) as coordinator, \
            SGLangEngine([s.url], tp_size=2, open_weight_sessions=False) as second:
        before = _greedy_logprobs(coordinator, _reference(hf_dirs["qwen3_moe", 1]))
        for eng, group in ((coordinator, "stage0"), (second, "stage1")):
            eng.init_weights_update_group(master_address="127.0.0.1", master_port=free_port(), backend="gloo",
                                          group_name=group, timeout_s=60)
        assert s.stats()["groups"] == ["stage0", "stage1"]
        with coordinator.weight_update_session():
            coordinator.update_weights_from_distributed(halves[0], bucket_mb=0.01, policy_version=1)
            second.update_weights_from_distributed(halves[1], bucket_mb=0.01, policy_version=1)
        after = _greedy_logprobs(coordinator, _reference(hf_dirs["qwen3_moe", 2]))
        assert [x.rollout_log_probs for x in after] != [x.rollout_log_probs for x in before]
        assert s.checksums() == [expected_checksums(sorted(new.items()))] * 2  # every tensor, every rank
        for eng in (coordinator, second):
            eng.destroy_weights_update_group()
    control = {"/generate", "/health", "/model_info", "/server_info", "/update_weights_from_distributed"}
    assert [p for p in s.paths() if p not in control] == [
        "/init_weights_update_group", "/init_weights_update_group", "/begin_weight_update",
        "/end_weight_update", "/destroy_weights_update_group", "/destroy_weights_update_group"]
    assert s.stats()["groups"] == [] and s.ignored_fields() == {}
    with SGLangEngine([s.url], tp_size=2) as eng:
        eng.update_weights(model_path=hf_dirs["qwen3_moe", 1], policy_version=2)  # model 1 back for the module


@pytest.mark.multiproc
def test_an_unknown_or_misshaped_tensor_is_a_400_naming_it(hf):
    s = hf["qwen2"]
    with SGLangEngine([s.url]) as eng:
        eng.init_weights_update_group(master_address="127.0.0.1", master_port=free_port(), backend="gloo",
                                      group_name="g", timeout_s=60)
        with pytest.raises(EngineRequestError, match=r"HTTP 400: .*unknown parameter 'model\.bogus\.weight'"):
            eng.update_weights_from_distributed([("model.bogus.weight", torch.ones(2))], bucket_mb=1, policy_version=1)
        with pytest.raises(EngineRequestError, match=r"parameter 'model\.norm\.weight': shape \[3\] != the model's \[64\]"):
            eng.update_weights_from_distributed([("model.norm.weight", torch.ones(3))], bucket_mb=1, policy_version=1)
        assert s.stats()["weight_version"] == "default"
        eng.destroy_weights_update_group()


def test_resumed_weights_without_cpu_backup_hold_nothing_until_every_tensor_is_updated(hf_dirs, hf):
    s = hf["qwen2"]
    with SGLangEngine([s.url]) as eng:
        eng.release_memory(tags=["weights"])
        eng.resume_memory(tags=["weights"])
        with pytest.raises(EngineRequestError, match=r"resumed without --enable-weights-cpu-backup and \d+ tensors"):
            eng.generate(PROMPTS, SamplingParams(max_new_tokens=2))
        eng.update_weights(model_path=hf_dirs["qwen2", 2], policy_version=1)  # every tensor, from disk
        _greedy_logprobs(eng, _reference(hf_dirs["qwen2", 2]))
        assert s.stats()["weight_version"] == "1"
        eng.update_weights(model_path=hf_dirs["qwen2", 1], policy_version=2)  # model 1 back


def test_health_answers_503_until_the_model_is_loaded(tmp_path):
    port = free_port()
    cmd = [*LAUNCHER, "--model-path", "toy", "--toy", "--port", str(port), "--load-delay-s", "1.5",
           "--max-lifetime-s", "30"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    codes = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not codes or codes[-1] != 200):
            try:
                codes.append(requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code)
            except requests.ConnectionError:
                pass
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert codes[0] == 503 and codes[-1] == 200 and set(codes) == {503, 200}


@pytest.fixture(scope="module")
def toys(tmp_path_factory):
    d = tmp_path_factory.mktemp("toys")
    with StandinServer(toy=True, emulate_version="0.5.8", log_dir=d) as old, \
            StandinServer(toy=True, args=["--context-length", "8"], log_dir=d) as new:
        yield old, new


def _post(s, path, body):
    return requests.post(s.url + path, json=body, timeout=10)


def test_unknown_sampling_parameters_fail_as_each_release_fails(toys):
    old, new = toys
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "bogus": 1}}
    r = _post(old, "/generate", body)  # 0.5.8: SamplingParams(**params) raises TypeError, uncaught
    assert (r.status_code, r.text) == (500, "Internal Server Error")
    r = _post(new, "/generate", body)  # 0.5.22+: the JSON contract
    assert r.status_code == 400 and r.json()["error"].startswith("unknown field `bogus`, expected one of")
    r = _post(new, "/generate", {"input_ids": [1], "sampling_params": {"top_p": 0.0}})
    assert r.status_code == 400 and r.json() == {"error": {"message": "top_p must be in (0, 1], got 0.0."}}


def test_request_fields_are_checked_against_the_releases_classes(toys):
    old, new = toys
    r = _post(new, "/update_weights_from_distributed", {"dtypes": [], "shapes": []})
    assert r.status_code == 400 and "body.names\n  Field required" in r.json()["message"]
    r = _post(new, "/init_weights_update_group", {"master_address": "h", "master_port": "x", "rank_offset": 1,
                                                  "world_size": 2})
    assert r.status_code == 400 and "body.master_port" in r.json()["message"]
    # 0.5.8 has no sessions and no `selector`: the route is missing, the field silently ignored (recorded)
    assert _post(old, "/begin_weight_update", {}).status_code == 404
    old.reset()
    r = _post(old, "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [], "selector": "all",
                                                        "group_name": "none"})
    assert r.status_code == 400 and "not initialized" in r.json()["message"]
    assert old.ignored_fields() == {"/update_weights_from_distributed": ["selector"]}
    assert requests.get(new.url + "/generate", timeout=5).status_code == 405


def test_generate_checks_context_rids_and_sessions_as_sglang(toys):
    _, new = toys  # --context-length 8
    r = _post(new, "/generate", {"input_ids": list(range(8)), "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and "The input (8 tokens) is longer than the model's context length (8 tokens)" in r.text
    r = _post(new, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 20}})
    assert r.status_code == 400 and "exceeds the model's maximum context length of 8 tokens" in r.text
    r = _post(new, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5}})
    # 3 + 5 fits the context, but the scheduler keeps 2 back (measured on SGLang 0.5.23): cut to 3
    assert r.json()["meta_info"]["completion_tokens"] == 3
    r = _post(new, "/generate", {"input_ids": [[1], [2]], "rid": ["x", "x"]})
    assert r.status_code == 400 and "Duplicate request ID detected: x" in r.text
    assert _post(new, "/end_weight_update", {}).json()["message"].startswith("no weight-update session is open")
    assert _post(new, "/begin_weight_update", {}).status_code == 200
    assert "already open" in _post(new, "/begin_weight_update", {}).json()["message"]
    assert _post(new, "/end_weight_update", {}).status_code == 200


def test_launch_flags_are_the_releases_own(tmp_path):
    kinds = {v: json.loads((ASSETS / f"protocol-{v}.json").read_text())["launch_flags"] for v in ("0.5.8", "0.5.23")}
    newer = sorted(f for f, k in kinds["0.5.23"].items() if k == "switch" and f not in kinds["0.5.8"])[0]
    with StandinServer(toy=True, args=[newer], log_dir=tmp_path) as s:  # 0.5.23 has it
        assert requests.get(s.url + "/server_info", timeout=5).json()[newer[2:].replace("-", "_")] is True
    for flag, version in ((newer, "0.5.8"), ("--no-such-flag", "0.5.23")):
        proc = subprocess.run([*LAUNCHER, "--model-path", "toy", "--toy", "--emulate-version", version, flag],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and f"unrecognized arguments: {flag}" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_committed_protocol_assets_equal_a_fresh_extraction(tmp_path):
    """Re-download each release's wheel and extract it again: the committed JSON is that reading."""
    sys.path.insert(0, str(ASSETS.parents[2] / "tools"))
    import sglang_protocol

    for asset in sorted(ASSETS.glob("protocol-*.json")):
        version = asset.stem.removeprefix("protocol-")
        try:
            wheel = sglang_protocol.download_wheel(version, tmp_path)
        except (subprocess.CalledProcessError, FileNotFoundError) as e:
            pytest.skip(f"cannot download sglang=={version} with pip (no network to the package index?): {e}")
        assert sglang_protocol.dumps(sglang_protocol.extract(wheel)) == asset.read_text(), version
        wheel.unlink()
