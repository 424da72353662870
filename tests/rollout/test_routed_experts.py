"""Routed experts (R3): SGLang's own encoding decodes to the tensor it encoded, layer first; a reply that
does not fit the model is an error naming the request and field; the gate and the launch flag follow the
releases; and the engine against the stand-in (a tiny HF Qwen3-MoE) puts on every Sample the routing of
exactly the tokens the model was fed, prompt + response[:-1].

The real CPU SGLang server returns routing too (with the test venv's host-allocation shim,
tests/sglang_env/megatron_dapo_host_alloc.py): tests/sglang_real/test_moe_server.py trains against it with R3.
"""

import base64
import json
import mmap
import os
import subprocess
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch

from megatron_dapo.rollout.base import PromptInput, RolloutEngineError, Sample, SamplingParams
from megatron_dapo.rollout.sglang.engine import SGLangEngine
from megatron_dapo.rollout.sglang.payloads import (
    EngineReplyError,
    build_generate_payload,
    parse_generate_output,
)
from megatron_dapo.rollout.sglang.routing import (
    RoutingLayout,
    cut_routed_experts,
    decode_routed_experts,
    routed_tokens,
)
from megatron_dapo.rollout.sglang.server import SGLangServerSpec, build_launch_command
from megatron_dapo.rollout.sglang.versions import (
    ROUTED_EXPERTS_FLAG,
    SUPPORTED,
    ReleaseFeatures,
    check_routed_experts,
    features_for,
    parse_version,
)
from tests.standin import StandinServer
from tests.standin.protocol import ASSETS

ROOT = Path(__file__).resolve().parents[2]
S, L, K, E = 7, 3, 2, 5  # routed tokens, layers, top-k, experts of the hand-made payloads


def known_ids(s: int, layers: int, k: int, experts: int) -> np.ndarray:
    """[S, L, K] int32 with a different id pattern per token, layer and slot (as SGLang lays it out)."""
    t, lay, j = np.meshgrid(np.arange(s), np.arange(layers), np.arange(k), indexing="ij")
    return ((7 * t + 3 * lay + j) % experts).astype(np.int32)


def encode(ids: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(ids, dtype="<i4").tobytes()).decode()


def sglang_python() -> str:
    path = os.environ.get("MEGATRON_DAPO_SGLANG_PYTHON") or str(ROOT / ".venv-sglang/bin/python")
    if not os.access(path, os.X_OK):
        pytest.fail(
            f"no SGLang venv at {path}: build it with `make sglang-env` (make test does)", pytrace=False
        )
    return path


def test_decode_equals_what_sglangs_own_encoder_encoded():
    """The detokenizer's base64 of an int32 [S, L, K] tensor (SGLang 0.5.23's code, run in its venv)
    decodes to that tensor with layers first."""
    code = (
        "import json, torch\n"
        "from sglang.srt.managers.detokenizer_manager import DetokenizerManager\n"
        f"s, l, k, e = {S}, {L}, {K}, {E}\n"
        "t, lay, j = torch.meshgrid(torch.arange(s), torch.arange(l), torch.arange(k), indexing='ij')\n"
        "ids = ((7 * t + 3 * lay + j) % e).to(torch.int32).contiguous()\n"
        "print(json.dumps(DetokenizerManager._b64_encode_per_request([ids, None])))\n"
    )
    out = subprocess.run(
        [sglang_python(), "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    encoded, none = json.loads(out.stdout.strip().splitlines()[-1])
    assert none is None
    got = decode_routed_experts(encoded, num_layers=L, top_k=K, num_experts=E, num_tokens=S, where="rid=x")
    assert got.dtype == torch.uint8 and got.shape == (L, S, K)
    assert torch.equal(got, torch.from_numpy(known_ids(S, L, K, E)).permute(1, 0, 2).to(torch.uint8))


def test_more_than_256_experts_decode_to_int16():
    ids = known_ids(S, L, K, 300) + 250
    got = decode_routed_experts(encode(ids), num_layers=L, top_k=K, num_experts=600, num_tokens=S, where="r")
    assert got.dtype == torch.int16 and int(got.max()) == int(ids.max())


@pytest.mark.parametrize(
    "value,match",
    [
        (encode(known_ids(S + 1, L, K, E)), "holds 8 tokens, expected 7 tokens x 3 layers x top-2"),
        (encode(known_ids(S, L, K + 1, E)), "holds 63 ids, expected 7 tokens"),
        (encode(known_ids(S, L, K, E + 1)), "expert id 5, outside 0 .. 4"),
        (encode(-known_ids(S, L, K, E) - 1), "expert id -1"),
        ("not base64!", "is not base64"),
        (base64.b64encode(b"abc").decode(), "not a whole number of int32"),
        (None, "must be a base64 str, got NoneType"),
    ],
)
def test_a_payload_that_does_not_fit_the_model_names_the_request_and_field(value, match):
    with pytest.raises(ValueError, match=match) as e:
        decode_routed_experts(
            value, num_layers=L, top_k=K, num_experts=E, num_tokens=S, where="http://h/generate rid=r7"
        )
    assert str(e.value).startswith("http://h/generate rid=r7: meta_info.routed_experts")


def test_routing_cut_from_the_reply_bytes_parses_to_what_the_whole_json_gives():
    """The client cuts the routing strings out of the body before the JSON parse (sglang.routing); the rows
    it gets are those the whole body parsed as JSON gives, text that spells the key is left alone, and a
    value the cut cannot take as it is (escaped) is still decoded."""
    layout, prompt = RoutingLayout(num_layers=L, top_k=K, num_experts=256), 6
    ids = [known_ids(S, L, K, E) + k for k in range(3)]
    ids[1][0, 0, 0] = 255  # base64 of 0xff starts "/w": the item whose "/" is written escaped, "\/"
    items = [reply(encode(ids[0])), reply(None, finish="abort"), reply(encode(ids[1])), reply(encode(ids[2]))]
    items[3]["text"] = 'he wrote "routed_experts":"QUJD" and "routed_experts":'
    body = orjson.dumps(items)  # compact, as SGLang's ORJSONResponse writes it
    escaped = encode(ids[1]).replace("/", "\\/")
    body = body.replace(encode(ids[1]).encode(), escaped.encode())
    assert b"\\/" in body and orjson.loads(body)[2]["meta_info"]["routed_experts"] == encode(ids[1])

    stripped, cut = cut_routed_experts(body)
    assert len(cut) == 3 and len(stripped) < len(body) - 3 * len(encode(ids[0]))
    parsed = orjson.loads(stripped)
    assert [item["meta_info"]["routed_experts"] for item in parsed] == [0, None, 1, 2]
    assert parsed[3]["text"] == items[3]["text"]
    kw = dict(request="rid=r", max_new_tokens=4, routing=layout, prompt_len=prompt)
    got = [parse_generate_output(item, cut=cut, **kw).routed_experts for item in parsed]
    want = [parse_generate_output(item, **kw).routed_experts for item in orjson.loads(body)]
    assert got[1] is None and want[1] is None
    for k, j in ((0, 0), (2, 1), (3, 2)):
        assert torch.equal(got[k], want[k])
        assert torch.equal(got[k], torch.from_numpy(ids[j]).permute(1, 0, 2).to(torch.uint8))
    with pytest.raises(EngineReplyError, match="rid=r: meta_info.routed_experts must be a base64 str, got int"):
        parse_generate_output(parsed[0], cut=cut, **kw)  # each cut value is taken once
    mapped = mmap.mmap(-1, len(body))  # a large reply as the client reads it (sglang.client.post_read)
    mapped[:] = body
    from_map, map_cut = cut_routed_experts(mapped)
    assert from_map == stripped and [bytes(v) for v in map_cut] == [bytes(v) for v in cut_routed_experts(body)[1]]

    assert cut_routed_experts(b'[{"a":1}]') == (b'[{"a":1}]', [])
    backslash_last = b'[{"meta_info":{"routed_experts":"QUJD\\\\"}}]'  # the JSON string QUJD\, a backslash last
    same, none = cut_routed_experts(backslash_last)
    assert none == [] and orjson.loads(same)[0]["meta_info"]["routed_experts"] == "QUJD\\"
    with pytest.raises(ValueError, match="rid=r: meta_info.routed_experts is not base64"):
        decode_routed_experts("QUJD\\", num_layers=L, top_k=K, num_experts=E, num_tokens=S, where="rid=r")
    not_base64 = cut_routed_experts(b'[{"routed_experts":"QU!D"}]')[1]
    with pytest.raises(ValueError, match="rid=r: meta_info.routed_experts is not base64"):
        decode_routed_experts(0, num_layers=L, top_k=K, num_experts=E, num_tokens=S, where="rid=r", cut=not_base64)


def reply(routing, *, finish="stop", response=(4, 2)):
    meta = {
        "id": "r",
        "finish_reason": {"type": finish},
        "output_token_logprobs": [[-0.1, t, None] for t in response],
    }
    if routing is not ...:
        meta["routed_experts"] = routing
    return {"output_ids": list(response), "meta_info": meta}


def test_parse_reads_routing_of_prompt_plus_response_minus_one_and_refuses_its_absence():
    layout = RoutingLayout(num_layers=L, top_k=K, num_experts=E)
    rows = routed_tokens(6, 2)  # prompt 6, response 2 -> 7 rows
    parsed = parse_generate_output(
        reply(encode(known_ids(rows, L, K, E))),
        request="rid=r",
        max_new_tokens=4,
        routing=layout,
        prompt_len=6,
    )
    assert parsed.routed_experts.shape == (L, S, K)
    for missing in (..., None):  # 0.5.10+ omit the key, 0.5.8 / 0.5.9 send null
        with pytest.raises(
            EngineReplyError, match="rid=r: meta_info.routed_experts is missing.*--enable-return"
        ):
            parse_generate_output(
                reply(missing), request="rid=r", max_new_tokens=4, routing=layout, prompt_len=6
            )
    aborted = parse_generate_output(
        reply(..., finish="abort"), request="rid=r", max_new_tokens=4, routing=layout, prompt_len=6
    )
    assert aborted.routed_experts is None
    with pytest.raises(EngineReplyError, match="rid=r: meta_info.routed_experts holds 7 tokens, expected 8"):
        parse_generate_output(
            reply(encode(known_ids(rows, L, K, E)), response=(4, 2, 9)),
            request="rid=r",
            max_new_tokens=4,
            routing=layout,
            prompt_len=6,
        )


def test_the_request_asks_only_when_told():
    items, sampling = [(PromptInput("p", (1, 2)), 0)], SamplingParams(max_new_tokens=3)
    assert "return_routed_experts" not in build_generate_payload(items, sampling, ["r"])
    assert (
        build_generate_payload(items, sampling, ["r"], routed_experts=True)["return_routed_experts"] is True
    )


def test_sample_checks_the_routing_rows():
    common = dict(
        prompt_id="p",
        sample_index=0,
        prompt_token_ids=(1, 2, 3),
        response_token_ids=(4, 5),
        rollout_log_probs=(-0.1, -0.2),
        finish_reason="stop",
        policy_version=0,
    )
    ok = Sample(**common, routed_experts=torch.zeros(L, 4, K, dtype=torch.uint8))
    assert ok == Sample(**common)  # routing is not part of equality (tensors have no truth value)
    with pytest.raises(
        ValueError, match="routed_experts has 5 token rows, expected prompt \\+ response - 1 = 4"
    ):
        Sample(**common, routed_experts=torch.zeros(L, 5, K, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8 / int16 tensor"):
        Sample(**common, routed_experts=torch.zeros(L, 4, K, dtype=torch.int64))


def test_every_supported_release_has_the_field_key_and_switch_in_its_wheel():
    """The protocol JSON read from each wheel: field, meta_info key and launch switch from 0.5.8 (0.5.5 has none)."""
    lo = parse_version(SUPPORTED[0])
    for path in sorted(ASSETS.glob("protocol-*.json")):
        proto = json.loads(path.read_text())
        version = path.stem.removeprefix("protocol-")
        has = (
            "return_routed_experts" in proto["request_classes"]["GenerateReqInput"]["fields"]
            and "routed_experts" in proto["meta_info_keys"]
            and proto["launch_flags"].get(ROUTED_EXPERTS_FLAG) == "switch"
        )
        assert has == (parse_version(version) >= lo), version
        if parse_version(version) >= lo:
            assert features_for(version).routed_experts


def test_connect_check_names_actor_router_replay():
    with pytest.raises(RolloutEngineError, match="actor.router_replay.*SGLang 0.5.5"):
        check_routed_experts([("u", {})], ReleaseFeatures(version=(0, 5, 5)))
    with pytest.raises(
        RolloutEngineError, match=r"actor.router_replay.*\['http://b'\] run without --enable-return"
    ):
        check_routed_experts(
            [("http://a", {"enable_return_routed_experts": True}), ("http://b", {})], features_for("0.5.23")
        )


def test_launch_flag_only_when_asked():
    spec = SGLangServerSpec(model_path="m", port=1)
    assert ROUTED_EXPERTS_FLAG not in build_launch_command(spec)
    assert (
        build_launch_command(SGLangServerSpec(model_path="m", port=1, return_routed_experts=True)).count(
            ROUTED_EXPERTS_FLAG
        )
        == 1
    )


# ----------------------------------------------------------------------------- engine against the stand-in


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from tests.sglang_real.model import write_tiny_qwen3_moe

    return write_tiny_qwen3_moe(str(tmp_path_factory.mktemp("moe") / "model"))[0]


def reference_routing(model_dir: str, tokens: list[int]) -> torch.Tensor:
    """[L, len(tokens), K] top-k ids of one plain transformers forward (sorted per token)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seen = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out, i=i: seen.__setitem__(i, out[2]))
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    return torch.stack([seen[i] for i in range(len(seen))]).sort(dim=-1).values


def test_engine_returns_the_routing_of_prompt_and_response_on_every_sample(moe_dir, tmp_path):
    layout = RoutingLayout(num_layers=2, top_k=2, num_experts=4)
    prompts = [PromptInput("a", (5, 7, 3, 9, 4)), PromptInput("b", (8, 8, 1))]
    with StandinServer(model_path=moe_dir, args=[ROUTED_EXPERTS_FLAG], log_dir=tmp_path) as srv:
        engine = SGLangEngine([srv.url], return_routed_experts=layout)
        try:
            samples = engine.generate(prompts, SamplingParams(max_new_tokens=6, n=2, temperature=1.0))
            streamed = engine.generate_streaming(
                prompts[:1], SamplingParams(max_new_tokens=3, n=2), on_groups_done=lambda groups: False
            )
        finally:
            engine.close()
        assert all(body["return_routed_experts"] is True for body in srv.requests("/generate"))
    for s in samples + streamed:
        assert s.routed_experts is not None and s.routed_experts.dtype == torch.uint8
        assert s.routed_experts.shape == (2, len(s.prompt_token_ids) + len(s.response_token_ids) - 1, 2)
    for s in samples[::2]:  # the stand-in's KV-cache decode routes as one forward over prompt + response[:-1]
        fed = list(s.prompt_token_ids + s.response_token_ids[:-1])
        assert torch.equal(s.routed_experts.sort(dim=-1).values.long(), reference_routing(moe_dir, fed))


def test_routing_a_streaming_callback_releases_is_freed_in_the_batch_the_engine_returns(moe_dir, tmp_path):
    """BatchGroupsDone: the callback sets the routing of the rows it will not train to None (a group dynamic
    sampling drops), in its call or in a later one (a group found surplus once others are scored); the engine
    keeps no copy of a reported row's, so the returned batch holds None for exactly those rows and the
    others' routing intact."""
    layout = RoutingLayout(num_layers=2, top_k=2, num_experts=4)
    prompts = [PromptInput("a", (5, 7, 3, 9, 4)), PromptInput("b", (8, 8, 1)), PromptInput("c", (2, 6))]
    seen, parts = {}, []

    def release_b(batch):  # b at once; the first reported group other than b when the last group comes
        parts.append(batch)
        for i, gid in enumerate(batch.index):
            seen[(gid, i % 2)] = batch.routed_experts[i].clone()
            if gid == "b":
                batch.routed_experts[i] = None
        if len({g for p in parts for g in p.index}) == 3:  # replies that came together come in one call
            first = next(g for p in parts for g in p.index if g != "b")
            late.append(first)
            for p in parts:
                for i, gid in enumerate(p.index):
                    if gid == first:
                        p.routed_experts[i] = None
        return False

    late = []

    with StandinServer(model_path=moe_dir, args=[ROUTED_EXPERTS_FLAG], log_dir=tmp_path) as srv:
        with SGLangEngine([srv.url], return_routed_experts=layout) as engine:
            batch = engine.generate_batch_streaming(prompts, SamplingParams(max_new_tokens=4, n=2), pad_id=0,
                                                    max_response_length=4, on_groups_done=release_b)
    assert batch.index == ["a", "a", "b", "b", "c", "c"] and len(late) == 1 and late[0] in "ac"
    for i, gid in enumerate(batch.index):
        if gid in ("b", late[0]):
            assert batch.routed_experts[i] is None
        else:
            assert torch.equal(batch.routed_experts[i], seen[(gid, i % 2)])


def test_engine_refuses_servers_launched_without_the_switch_and_the_toy_cannot_launch_with_it(tmp_path):
    layout = RoutingLayout(num_layers=2, top_k=2, num_experts=4)
    with StandinServer(toy=True, emulate_version="0.5.8", log_dir=tmp_path) as srv:
        with pytest.raises(
            RolloutEngineError, match="actor.router_replay.*without --enable-return-routed-experts"
        ):
            SGLangEngine([srv.url], return_routed_experts=layout)
    with pytest.raises(RuntimeError, match="no num_experts_per_tok"):
        StandinServer(toy=True, args=[ROUTED_EXPERTS_FLAG], log_dir=tmp_path).start()
