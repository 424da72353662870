"""SGLangEngine generation against the SGLang stand-in (tests/standin: its own process, speaking
SGLang 0.5.23's HTTP protocol, with the toy model so each output is known exactly)."""

import dataclasses
import threading
import time

import pytest
import requests
import torch

from megatron_dapo.rollout.base import (
    PromptInput,
    SamplingParams,
    check_generate_output,
    derive_sample_seed,
    samples_to_batch,
)
from megatron_dapo.rollout.ragged import RaggedRows, to_dense
from megatron_dapo.rollout.sglang.engine import (
    AllServersDown,
    EngineReplyError,
    EngineRequestError,
    EngineTimeoutError,
    SGLangEngine,
    parse_generate_output,
)
from megatron_dapo.rollout.sglang.payloads import first_span_version
from tests.standin import StandinServer, toy_continuation

PROMPTS = [PromptInput("p0", (3, 1, 4)), PromptInput("p1", (1, 5, 9, 2))]
SEEDED = ["--enable-deterministic-inference"]  # the toy honours sampling_seed only then, as SGLang


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("standin")
    with StandinServer(toy=True, args=SEEDED, log_dir=log_dir) as a, \
            StandinServer(toy=True, args=SEEDED, log_dir=log_dir) as b:
        yield a, b


@pytest.fixture
def server(servers):
    servers[0].reset()
    yield servers[0]
    assert servers[0].ignored_fields() == {}  # the engine sends no field 0.5.23 lacks


def _engine(urls, **kw):
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("request_timeout_s", 10.0)
    return SGLangEngine(urls if isinstance(urls, list) else [urls], **kw)


def _expected(prompt, j, seed, max_new, stop=()):
    return toy_continuation(prompt.token_ids, seed=derive_sample_seed(seed, prompt.prompt_id, j),
                            max_new_tokens=max_new, stop_token_ids=stop)


def _wait_until(pred, timeout_s=5.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.005)
    return False


def test_generate_returns_each_samples_tokens_and_logprobs_in_prompt_major_order(server):
    sp = SamplingParams(max_new_tokens=6, n=3, seed=11, temperature=0.7, top_p=0.9, top_k=20)
    with _engine(server.url, max_batch_size=4, policy_version=5) as eng:
        assert eng.sglang_version == "0.5.23" and eng.seeds_honoured
        samples = eng.generate(PROMPTS, sp)
    check_generate_output(PROMPTS, sp, samples)
    for s in samples:
        prompt = PROMPTS[0] if s.prompt_id == "p0" else PROMPTS[1]
        tokens, logps, _ = _expected(prompt, s.sample_index, 11, 6)
        assert s.response_token_ids == tuple(tokens)
        assert s.rollout_log_probs == tuple(logps)
        assert s.prompt_token_ids == prompt.token_ids
        assert (s.finish_reason, s.policy_version, s.meta) == ("length", 5, {})
    # samples of one prompt differ: each carries its own sampling_seed
    assert len({s.response_token_ids for s in samples[:3]}) == 3
    bodies = sorted(server.requests("/generate"), key=lambda b: b["rid"][0])  # arrival order varies
    assert [len(b["input_ids"]) for b in bodies] == [4, 2]  # 6 items in batches of <= 4
    first = bodies[0]
    assert first["input_ids"] == [[3, 1, 4]] * 3 + [[1, 5, 9, 2]]
    assert first["return_logprob"] is True and first["logprob_start_len"] == -1 and first["stream"] is False
    assert first["sampling_params"][0] == {"max_new_tokens": 6, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
                                           "sampling_seed": derive_sample_seed(11, "p0", 0)}
    assert len(set(first["rid"])) == 4


def test_stop_token_ends_a_sample_with_stop_and_is_kept_while_others_hit_length(server):
    free, _, _ = _expected(PROMPTS[0], 0, 3, 8)
    k = next(i for i in range(1, 8) if free[i] not in free[:i])  # first position with a new token
    sp = SamplingParams(max_new_tokens=8, n=1, seed=3, stop_token_ids=(free[k],))
    with _engine(server.url) as eng:
        s = eng.generate(PROMPTS[:1], sp)[0]
    assert s.response_token_ids == tuple(free[: k + 1])
    assert s.finish_reason == "stop"
    assert len(s.rollout_log_probs) == k + 1
    assert server.requests("/generate")[0]["sampling_params"][0]["stop_token_ids"] == [free[k]]


def test_min_new_tokens_is_sent_as_sglangs_sampling_param_only_when_set(server):
    """SGLang masks EOS and the stop tokens before `min_new_tokens`; the engine forwards it (the
    fixture checks the release accepts the field) and leaves the default 0 out of the body."""
    with _engine(server.url) as eng:
        eng.generate(PROMPTS[:1], SamplingParams(max_new_tokens=8, seed=3, min_new_tokens=5))
        eng.generate(PROMPTS[:1], SamplingParams(max_new_tokens=8, seed=3))
    sent, default = (b["sampling_params"][0] for b in server.requests("/generate"))
    assert sent["min_new_tokens"] == 5 and sent["max_new_tokens"] == 8
    assert "min_new_tokens" not in default


def test_concurrency_per_server_never_exceeds_the_limit(server):
    server.knobs(delay_s=0.1)
    sp = SamplingParams(max_new_tokens=2, n=2, seed=0)
    prompts = [PromptInput(f"q{i}", (i + 1,)) for i in range(6)]
    with _engine(server.url, max_concurrency=2, max_batch_size=2) as eng:
        samples = eng.generate(prompts, sp)
    assert len(samples) == 12
    assert len(server.requests("/generate")) == 6
    assert server.stats()["generate_max_inflight"] == 2  # reached, never exceeded


def test_requests_spread_over_servers_each_within_its_limit(servers):
    a, b = servers
    for s in servers:
        s.reset()
        s.knobs(delay_s=0.1)
    prompts = [PromptInput(f"q{i}", (i + 1,)) for i in range(4)]
    with _engine([a.url, b.url], max_concurrency=1, max_batch_size=1) as eng:
        eng.generate(prompts, SamplingParams(max_new_tokens=2, seed=1))
    assert len(a.requests("/generate")) == 2 and len(b.requests("/generate")) == 2
    assert a.stats()["generate_max_inflight"] == 1 and b.stats()["generate_max_inflight"] == 1


def test_transient_503s_are_retried_then_succeed(server):
    server.knobs(fail_next=2)
    with _engine(server.url, max_retries=3) as eng:
        s = eng.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, seed=2))[0]
    assert s.response_token_ids == tuple(_expected(PROMPTS[0], 0, 2, 3)[0])
    assert server.paths().count("/generate") == 3


def test_persistent_503s_fail_after_all_retries_naming_the_status(server):
    server.knobs(fail_next=10)
    with (_engine(server.url, max_retries=2) as eng,
          pytest.raises(EngineRequestError, match=r"after 3 attempts: HTTP 503")):
        eng.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3))
    assert server.paths().count("/generate") == 3


def test_a_server_that_dies_fails_over_to_a_live_one(server, tmp_path):
    doomed = StandinServer(toy=True, args=SEEDED, log_dir=tmp_path).start()
    try:
        with (_engine([doomed.url, server.url], max_retries=2) as both,
              _engine([doomed.url], max_retries=1, server_down_timeout_s=0.5) as alone):
            doomed.kill()
            s = both.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, seed=4))[0]
            assert s.response_token_ids == tuple(_expected(PROMPTS[0], 0, 4, 2)[0])
            assert both.pool.state == {doomed.url: "down", server.url: "up"}
            assert both.pool.take_counts() == {"failures": 1, "reissued_requests": 1, "restarts": 0, "readmitted": 0,
                                               "up": 1}
            t0 = time.monotonic()
            with pytest.raises(AllServersDown, match=r"for 0\.5 s \(rollout.server_down_timeout_s\).*down: "
                                                     r"/generate: ConnectionError"):
                alone.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))
            assert time.monotonic() - t0 < 5
    finally:
        doomed.stop()


def test_a_server_killed_mid_request_fails_over(servers, tmp_path):
    doomed = StandinServer(toy=True, args=SEEDED, log_dir=tmp_path).start()
    live = servers[1]
    live.reset()
    try:
        doomed.knobs(kill_after_tokens=2)  # the kill switch: dies inside its first /generate
        with _engine([doomed.url, live.url], max_retries=2, max_concurrency=1) as eng:
            s = eng.generate(PROMPTS[:1], SamplingParams(max_new_tokens=5, seed=6))[0]
        assert s.response_token_ids == tuple(_expected(PROMPTS[0], 0, 6, 5)[0])
        assert doomed.wait_exit() == 9 and live.paths().count("/generate") == 1
    finally:
        doomed.stop()


def test_a_request_slower_than_the_timeout_raises_a_timeout_error(server):
    server.knobs(delay_s=3.0)
    with (_engine(server.url, request_timeout_s=0.2, max_retries=0) as eng,
          pytest.raises(EngineTimeoutError, match=r"failed after 1 attempts: timed out after 0\.2 s")):
        eng.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))


def test_a_timed_out_request_is_aborted_on_the_server_before_the_retry(server):
    """Issue #15 item 8: the server would keep generating the timed-out request next to its retry.
    The engine aborts the old rids first, and the retry carries fresh ones (SGLang refuses a rid in flight)."""
    server.knobs(token_delay_s=0.1)  # 20 tokens: 2 s, the timeout is 0.5 s
    sp = SamplingParams(max_new_tokens=20, n=2, seed=5)
    with (_engine(server.url, request_timeout_s=0.5, max_retries=1, max_batch_size=2) as eng,
          pytest.raises(EngineTimeoutError, match="after 2 attempts")):
        eng.generate(PROMPTS[:1], sp)
    rows = server.requests()
    generates = [b for p, b in rows if p == "/generate"]
    first, retry = generates[0]["rid"], generates[1]["rid"]
    assert len(generates) == 2 and not set(first) & set(retry)
    order = [(p, b.get("rid") if isinstance(b, dict) else None) for p, b in rows]
    retry_at = order.index(("/generate", retry))
    aborted_before = [rid for p, rid in order[:retry_at] if p == "/abort_request"]
    assert sorted(aborted_before) == sorted(first)  # every old rid, before the retry was sent
    assert _wait_until(lambda: server.stats()["generate_inflight"] == 0)  # the retry's rids were aborted too


def test_a_4xx_reply_is_not_retried(server):
    server.knobs(fail_next=5, fail_status=400)
    with (_engine(server.url, max_retries=3) as eng,
          pytest.raises(EngineRequestError, match="HTTP 400: .*bad request")):
        eng.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))
    assert server.paths().count("/generate") == 1


def test_engine_payloads_pass_sglangs_strict_sampling_params(server):
    # 0.5.23's JSON contract rejects an unknown sampling parameter with 400 naming it.
    with _engine(server.url) as eng:
        r = eng._session().post(server.url + "/generate", json={"input_ids": [[1]], "sampling_params": [{"bogus": 1}]})
        assert r.status_code == 400 and "unknown field `bogus`" in r.text
        samples = eng.generate(PROMPTS, SamplingParams(max_new_tokens=2, n=2, seed=1, stop_token_ids=(5,)))
    assert len(samples) == 4


def test_abort_returns_partial_samples_and_skips_unsent_batches(server):
    server.knobs(token_delay_s=0.05)  # 40 tokens would take 2 s
    sp = SamplingParams(max_new_tokens=40, n=3, seed=9)
    out = {}
    with _engine(server.url, max_concurrency=1, max_batch_size=1) as eng:
        t = threading.Thread(target=lambda: out.setdefault("samples", eng.generate(PROMPTS[:1], sp)))
        t.start()
        assert _wait_until(lambda: server.stats()["tokens_generated"] >= 3)
        eng.abort()
        t.join(timeout=10)
        assert not t.is_alive()
        samples = out["samples"]
        assert [s.finish_reason for s in samples] == ["abort"] * 3
        first = samples[0]
        full_tokens, full_logps, _ = _expected(PROMPTS[0], 0, 9, 40)
        n = len(first.response_token_ids)
        assert 0 < n < 40
        assert first.response_token_ids == tuple(full_tokens[:n])
        assert first.rollout_log_probs == tuple(full_logps[:n])
        assert samples[1].response_token_ids == () and samples[2].response_token_ids == ()
        assert server.paths().count("/generate") == 1  # the other two were never sent
        assert server.requests("/abort_request") == [{"abort_all": True}]
        # an abort ends only the calls in flight: the next generate runs normally
        server.knobs(token_delay_s=0.0)
        again = eng.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, seed=9))
        assert again[0].finish_reason == "length" and len(again[0].response_token_ids) == 3


@pytest.mark.parametrize("mode, message", [
    ("logprobs_short", r"rid=\S+ \(prompt_id='p0', sample_index=0\): output_ids \(3 tokens\) disagree"),
    ("finish_reason", r"prompt_id='p0'.*meta_info\.finish_reason must be"),
    ("output_ids", r"output_ids \(4 tokens\) disagree with meta_info\.output_token_logprobs \(3 tokens\)"),
    ("not_list", r"/generate batch \S+: expected a list of 2 results, got dict"),
])
def test_a_malformed_reply_raises_naming_the_request_and_field(server, mode, message):
    server.knobs(malform=mode)
    with _engine(server.url) as eng, pytest.raises(EngineReplyError, match=message):
        eng.generate(PROMPTS, SamplingParams(max_new_tokens=3, seed=0))


def test_generate_batch_is_the_ragged_form_of_generate(server):
    """The engine's own generate_batch (rows made into tensors as each reply arrives) holds exactly what
    generate's Samples hold, without padding: same seeds, so the same tokens and log-probs."""
    sampling = SamplingParams(max_new_tokens=6, n=3, seed=7)
    with _engine(server.url) as eng:
        samples = eng.generate(PROMPTS, sampling)
        batch = eng.generate_batch(PROMPTS, sampling, pad_id=0, max_response_length=6)
    assert isinstance(batch.responses, RaggedRows) and batch.response_mask is None
    assert batch.responses.values.numel() == sum(len(s.response_token_ids) for s in samples)
    ref = samples_to_batch(samples, pad_id=0, max_response_length=6)
    dense = to_dense(batch)
    for f in dataclasses.fields(ref):
        a, b = getattr(dense, f.name), getattr(ref, f.name)
        assert (torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b), f.name


def _item(tokens, finish="length", **meta):
    m = {"finish_reason": {"type": finish}, "output_token_logprobs": [[-0.1, t, None] for t in tokens],
         "completion_tokens": len(tokens), **meta}
    return {"text": "", "output_ids": list(tokens), "meta_info": m}


def test_parse_generate_output_checks_each_field():
    ok = parse_generate_output(_item([4, 5]), request="R", max_new_tokens=2)
    assert (ok.token_ids.tolist(), ok.log_probs.tolist(), ok.finish_reason, ok.meta) == ([4, 5], [-0.1, -0.1], "length", {})
    assert (ok.token_ids.dtype, ok.log_probs.dtype) == (torch.int32, torch.float64)  # ids as held ragged; doubles exact
    no_lp = _item([4])
    del no_lp["meta_info"]["output_token_logprobs"]
    with pytest.raises(EngineReplyError, match="R: meta_info.output_token_logprobs missing"):
        parse_generate_output(no_lp, request="R", max_new_tokens=4)
    with pytest.raises(EngineReplyError, match=r"completion_tokens=3 but output_token_logprobs has 2"):
        parse_generate_output(_item([4, 5], completion_tokens=3), request="R", max_new_tokens=4)
    with pytest.raises(EngineReplyError, match=r"2 tokens > max_new_tokens=1"):
        parse_generate_output(_item([4, 5]), request="R", max_new_tokens=1)
    bad_lp = _item([4])
    bad_lp["meta_info"]["output_token_logprobs"] = [[float("nan"), 4, None]]
    with pytest.raises(EngineReplyError, match=r"output_token_logprobs\[0\] log-prob nan is not finite"):
        parse_generate_output(bad_lp, request="R", max_new_tokens=4)
    with pytest.raises(EngineReplyError, match="meta_info missing"):
        parse_generate_output({"text": ""}, request="R", max_new_tokens=4)
    aborted = {"meta_info": {"finish_reason": {"type": "abort"}, "completion_tokens": 0}}
    assert parse_generate_output(aborted, request="R", max_new_tokens=4).token_ids.tolist() == []
    spec = (("spec_verify_ct", "spec_verify_ct"),)
    with pytest.raises(EngineReplyError, match=r"meta_info\.spec_verify_ct must be an int >= 0, got -1"):
        parse_generate_output(_item([4], spec_verify_ct=-1), request="R", max_new_tokens=4, spec=spec)


@pytest.mark.parametrize("entry, message", [
    ([-0.1, True, None], r"output_token_logprobs\[1\] token id True is not an int >= 0"),
    ([-0.1, 4.0, None], r"output_token_logprobs\[1\] token id 4.0 is not an int >= 0"),
    ([-0.1, "4", None], r"output_token_logprobs\[1\] token id '4' is not an int >= 0"),
    ([-0.1, -4, None], r"output_token_logprobs\[1\] token id -4 is not an int >= 0"),
    ([-0.1, 2**31, None], r"output_token_logprobs\[1\] token id 2147483648 is not a vocabulary id"),
    ([-0.1, 2**64, None], r"output_token_logprobs\[1\] token id 18446744073709551616 is not a vocabulary id"),
    ([float("inf"), 4, None], r"output_token_logprobs\[1\] log-prob inf is not finite"),
    (["-0.1", 4, None], r"output_token_logprobs\[1\] log-prob '-0.1' is not finite"),
    ([-0.1], r"output_token_logprobs\[1\] must be \[logprob, token_id, text\], got \[-0.1\]"),
    ([0.5, 4, None], r"output_token_logprobs\[1\] log-prob 0.5 is above 0 \(more than the round-off 0.001"),
    (None, r"output_token_logprobs\[1\] must be \[logprob, token_id, text\], got None"),
])
def test_a_bad_log_prob_entry_is_named_by_its_position(entry, message):
    """The columns are checked in bulk; a failed check names the first bad entry, as the per-entry loop did."""
    item = _item([4, 5, 6])
    item["meta_info"]["output_token_logprobs"][1] = entry
    item.pop("output_ids")
    with pytest.raises(EngineReplyError, match=message):
        parse_generate_output(item, request="R", max_new_tokens=4)


def _spans(*versions):
    """meta_info.weight_versions as SGLang sends it: contiguous spans over the output tokens, oldest first
    (two tokens each here)."""
    return [{"version": v, "start": 2 * i, "end": 2 * i + 2} for i, v in enumerate(versions)]


@pytest.mark.parametrize("reported, spans, first", [
    ("3", _spans("2", "3"), 2),  # a push mid-request: the first tokens came from version 2
    ("3", _spans("1", "2", "3"), 1),  # two pushes: the oldest span counts
    ("3", _spans("3"), None),  # one version made every token
    ("3", _spans("3", "3"), None),  # the first span is the reported version: nothing older
    ("3", _spans("default", "3"), None),  # the server's launch weights: no version the trainer set
    ("default", _spans("2", "3"), None),  # no reported trainer version to compare with
    ("3", None, None),  # a release without spans
])
def test_first_weight_version_is_the_first_span_only_when_it_differs_from_the_reported_one(reported, spans, first):
    meta = {"weight_version": reported} if spans is None else {"weight_version": reported, "weight_versions": spans}
    parsed = parse_generate_output(_item([4, 5, 6, 7], **meta), request="R", max_new_tokens=4)
    assert parsed.weight_version == (None if reported == "default" else int(reported))
    assert parsed.first_weight_version == first


@pytest.mark.parametrize("spans", [
    {"version": "2", "start": 0, "end": 2},  # one span, not a list of them
    [],
    [{"start": 0, "end": 2}],
    [{"version": "2", "start": 0, "end": 2}, {"start": 2, "end": 4}],  # a later span without its version
    ["2", "3"],
])
def test_malformed_weight_version_spans_raise_naming_the_request_and_field(spans):
    item = _item([4, 5, 6, 7], weight_version="3", weight_versions=spans)
    with pytest.raises(EngineReplyError, match=r"^R: meta_info\.weight_versions must be a non-empty list of "
                                               r"objects with a version, got "):
        parse_generate_output(item, request="R", max_new_tokens=4)


def test_spans_starting_newer_than_the_reported_version_are_a_bad_reply_naming_both():
    item = _item([4, 5, 6, 7], weight_version="3", weight_versions=_spans("5", "3"))
    with pytest.raises(EngineReplyError, match=r"^R: meta_info\.weight_versions starts at version 5, newer than "
                                               r"meta_info\.weight_version 3$"):
        parse_generate_output(item, request="R", max_new_tokens=4)


def test_first_span_version_reads_only_versions_the_trainer_set():
    assert first_span_version(None, request="R") is None
    assert first_span_version(_spans("7", "9"), request="R") == 7
    assert first_span_version(_spans("v7", "9"), request="R") is None


def test_without_spans_a_reply_newer_than_the_queued_version_starts_at_the_queued_version(tmp_path):
    """0.5.12 reports only the version at the end of a request: one queued at client version 0 and
    answered under 1 (a push the client has not counted yet) may hold tokens of 0, so it counts from 0."""
    with StandinServer(toy=True, emulate_version="0.5.12", args=SEEDED, log_dir=tmp_path) as s, \
            _engine(s.url, policy_version=0) as eng:
        assert not eng.features.weight_version_spans
        sp = SamplingParams(max_new_tokens=3, seed=4)
        launch = eng.generate(PROMPTS[:1], sp)[0]  # the server still reports its launch weights, "default"
        assert (launch.policy_version, launch.first_policy_version, launch.min_policy_version) == (0, None, 0)
        r = requests.post(s.url + "/update_weights_from_disk", json={"model_path": "toy", "weight_version": "1"},
                          timeout=30)
        assert r.status_code == 200, r.text
        pushed = eng.generate(PROMPTS[:1], sp)[0]  # queued at 0, answered under 1
        assert (pushed.policy_version, pushed.first_policy_version, pushed.min_policy_version) == (1, 0, 0)
        eng.update_weights(model_path="toy", policy_version=1)  # the client counts the push now
        after = eng.generate(PROMPTS[:1], sp)[0]
        assert (after.policy_version, after.first_policy_version, after.min_policy_version) == (1, None, 1)
        assert launch.response_token_ids == pushed.response_token_ids == tuple(_expected(PROMPTS[0], 0, 4, 3)[0])


def test_with_spans_the_first_span_not_the_queued_version_gives_the_first_tokens_version(server):
    """0.5.23 sends meta_info.weight_versions; the stand-in does not emulate them (it reports only
    weight_version), so the engine's _sample is fed parsed replies directly: the span decides, and a
    reply without spans on such a release means one version made every token."""
    with _engine(server.url, policy_version=0) as eng:
        assert eng.features.weight_version_spans

        def sample(**meta):
            parsed = parse_generate_output(_item([4, 5, 6, 7], **meta), request="R", max_new_tokens=4)
            return eng._sample(PROMPTS[0], 0, parsed, 0)  # queued at client version 0

        spanning = sample(weight_version="2", weight_versions=_spans("1", "2"))
        assert (spanning.policy_version, spanning.first_policy_version, spanning.min_policy_version) == (2, 1, 1)
        one = sample(weight_version="2", weight_versions=_spans("2"))
        assert (one.policy_version, one.first_policy_version) == (2, None)
        assert sample(weight_version="2").first_policy_version is None  # not the queued 0: spans are trusted


def test_without_spans_the_queued_version_is_used_only_when_older_than_the_reported_one(tmp_path):
    with StandinServer(toy=True, emulate_version="0.5.12", log_dir=tmp_path) as s, _engine(s.url) as eng:
        def sample(reported, queued):
            parsed = parse_generate_output(_item([4, 5], weight_version=reported), request="R", max_new_tokens=4)
            return eng._sample(PROMPTS[0], 0, parsed, queued)

        assert (sample("3", 1).policy_version, sample("3", 1).first_policy_version) == (3, 1)
        assert (sample("3", 3).policy_version, sample("3", 3).first_policy_version) == (3, None)
        assert (sample("default", 2).policy_version, sample("default", 2).first_policy_version) == (2, None)


def test_generate_validates_its_inputs(server):
    with _engine(server.url) as eng:
        with pytest.raises(ValueError, match="repeated"):
            eng.generate([PROMPTS[0], PROMPTS[0]], SamplingParams(max_new_tokens=2))
        with pytest.raises(TypeError, match="SamplingParams"):
            eng.generate(PROMPTS, {"max_new_tokens": 2})
    with pytest.raises(ValueError, match="max_concurrency"):
        SGLangEngine([server.url], max_concurrency=0)
    with pytest.raises(ValueError, match="urls"):
        SGLangEngine(server.url)
