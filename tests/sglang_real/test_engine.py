"""The SGLang engine against two real SGLang 0.5.23 servers (conftest.real_servers): what it reads at
connect, the request limit it enforces before sending, abort, pause / continue, and the colocation check.

Server 0 was launched for PROMPT_LEN + RESPONSE_LEN tokens (--context-length 2 more, as the trainer
launches), server 1 without --context-length (the model's 512 positions)."""

from __future__ import annotations

import threading
import time

import pytest

from megatron_dapo.rollout.base import PromptInput, RolloutEngineError, SamplingParams
from megatron_dapo.rollout.sglang.engine import SGLangEngine
from tests.sglang_real.conftest import PROMPT_LEN, RESPONSE_LEN, SERVER0_RUNNING

MODEL_POSITIONS = 512  # tests/sglang_real/model.py: max_position_embeddings


def _log_mark(server) -> int:
    return len(server.log_path.read_text(errors="replace"))


def _log_since(server, mark: int) -> str:
    return server.log_path.read_text(errors="replace")[mark:]


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def _prompt(pid: str = "p", n: int = 10) -> PromptInput:
    return PromptInput(pid, tuple([1] + [4 + i % 10 for i in range(n - 1)]))


def test_connect_reads_the_release_and_each_servers_request_limit(real_servers):
    """0.5.23 needs weight-update sessions; the longest request is min(context, KV pool) - 2 whether
    or not the server was launched with --context-length (SGLang reports it as max_req_input_len + 4)."""
    url0, url1 = real_servers.urls
    with SGLangEngine([url0]) as e0, SGLangEngine([url1]) as e1, SGLangEngine([url0, url1]) as both:
        assert e0.sglang_version == "0.5.23" and e0.features.weight_update_session
        assert e0.max_sequence_length == PROMPT_LEN + RESPONSE_LEN
        assert e1.max_sequence_length == MODEL_POSITIONS - 2
        assert both.max_sequence_length == PROMPT_LEN + RESPONSE_LEN
        assert both.health()["healthy"]


@pytest.mark.parametrize("which", [0, 1])
def test_a_request_at_the_limit_is_generated_in_full_and_one_token_more_is_refused_before_sending(
        real_servers, which):
    """Without the engine's check SGLang would cut max_new_tokens silently (or refuse the request with
    HTTP 400 past its context length); nothing is posted for the refused one."""
    server = real_servers.servers[which]
    limit = [PROMPT_LEN + RESPONSE_LEN, MODEL_POSITIONS - 2][which]
    prompt = _prompt()
    with SGLangEngine([server.url]) as engine:
        n = limit - len(prompt.token_ids)
        (full,) = engine.generate([prompt], SamplingParams(max_new_tokens=n, min_new_tokens=n))
        assert (len(full.response_token_ids), full.finish_reason) == (n, "length")
        mark = _log_mark(server)
        with pytest.raises(ValueError, match=rf"prompt 'p': 10 prompt tokens \+ max_new_tokens={n + 1} = "
                                             rf"{limit + 1} > {limit}, the longest request"):
            engine.generate([prompt], SamplingParams(max_new_tokens=n + 1))
        time.sleep(0.2)  # an access-log line would have been written by now
        assert "POST /generate" not in _log_since(server, mark)


def _start_long_generation(engine, server, n: int):
    """One greedy request of n tokens in a thread; returns (thread, result list) once the server logged
    that it decodes it."""
    mark = _log_mark(server)
    out: list = []
    thread = threading.Thread(target=lambda: out.extend(engine.generate(
        [_prompt("long")], SamplingParams(max_new_tokens=n, min_new_tokens=n, temperature=0.0))))
    thread.start()
    _wait_for(lambda: "Decode batch" in _log_since(server, mark), 60, "the server to decode")
    return thread, out


def test_abort_ends_a_running_request_with_its_partial_output(real_servers):
    server = real_servers.servers[1]
    n = MODEL_POSITIONS - 2 - 10
    with SGLangEngine([server.url]) as engine:
        thread, out = _start_long_generation(engine, server, n)
        engine.abort()
        thread.join(60)
        assert not thread.is_alive()
        (sample,) = out
        assert sample.finish_reason == "abort"
        assert 0 < len(sample.response_token_ids) < n
        assert len(sample.rollout_log_probs) == len(sample.response_token_ids)


def test_pause_in_place_holds_a_running_request_until_continue(real_servers):
    server = real_servers.servers[1]
    n = MODEL_POSITIONS - 2 - 10
    with SGLangEngine([server.url]) as engine:
        thread, out = _start_long_generation(engine, server, n)
        engine.pause_generation("in_place")
        try:
            thread.join(2.0)
            assert thread.is_alive(), "the request finished while generation was paused"
        finally:
            engine.continue_generation()
        thread.join(60)
        (sample,) = out
        assert (sample.finish_reason, len(sample.response_token_ids)) == ("length", n)
    with SGLangEngine([server.url]) as engine, pytest.raises(ValueError, match="mode must be one of"):
        engine.pause_generation("sometimes")


def test_colocated_mode_refuses_servers_without_the_memory_saver_unless_the_config_says_so(real_servers, tmp_path):
    """The server reports --enable-memory-saver in /server_info; colocated servers without it would keep
    their memory while the actor trains."""
    from megatron_dapo.config import load_config
    from megatron_dapo.rollout.sglang.build import connect as _connect

    with pytest.raises(RolloutEngineError, match=r"rollout.mode=colocate but .* run without --enable-memory-saver.*"
                                                 r"rollout.require_memory_saver=false"):
        SGLangEngine(real_servers.urls, require_memory_saver=True)
    overrides = ["rollout.engine=sglang", f"rollout.sglang_urls=[{','.join(real_servers.urls)}]",
                 f"trainer.output_dir={tmp_path}"]
    with pytest.raises(RolloutEngineError, match="rollout.require_memory_saver"):
        _connect(load_config("configs/tiny_cpu.yaml", overrides), real_servers.urls)
    for more in (["rollout.require_memory_saver=false"], ["rollout.mode=disaggregate"]):
        _connect(load_config("configs/tiny_cpu.yaml", overrides + more), real_servers.urls).close()


def test_a_batch_many_times_longer_than_the_request_timeout_completes_without_a_timeout(real_servers):
    """The engine sends a request only when its server decodes it at once (its running capacity from
    /server_info: --max-running-requests 8 on server 0), so a request's deadline is spent generating,
    never queued behind the batch: 20 waves of fixed-length requests, request_timeout_s about 3 waves,
    no retries allowed. (Posted at once, the last waves would wait ~19 waves in SGLang's queue.)"""
    server = real_servers.servers[0]
    n = PROMPT_LEN + RESPONSE_LEN - 10  # fixed length: min_new_tokens = max_new_tokens
    fixed = SamplingParams(max_new_tokens=n, min_new_tokens=n, temperature=1.0)
    with SGLangEngine([server.url]) as probe:
        cap = probe.capacity[server.url]
        assert cap == SERVER0_RUNNING
        t0 = time.perf_counter()
        probe.generate([_prompt(f"w{i}") for i in range(cap)], fixed)
        wave_s = time.perf_counter() - t0
    mark = _log_mark(server)
    with SGLangEngine([server.url], request_timeout_s=3 * wave_s + 0.5, max_retries=0) as engine:
        t0 = time.perf_counter()
        out = engine.generate([_prompt(f"p{i}") for i in range(20 * cap)], fixed)
        total_s = time.perf_counter() - t0
    print(f"capacity {cap}: one wave {wave_s:.2f} s, 20 waves {total_s:.2f} s, request_timeout_s "
          f"{engine.request_timeout_s:.2f}")
    assert [(s.finish_reason, len(s.response_token_ids)) for s in out] == [("length", n)] * (20 * cap)
    assert _log_since(server, mark).count("POST /generate") == 20, "requests of `cap` sequences, none sent twice"
    assert total_s > 2 * engine.request_timeout_s


def test_a_reply_read_into_a_memory_map_gives_the_samples_the_same_reply_read_as_bytes_gives(
        real_servers, monkeypatch):
    """The client reads a reply of sglang.client.MAPPED_BODY bytes or more into an anonymous map (the real
    server's replies carry a Content-Length); with the threshold at one byte every reply is mapped, and
    greedy generation on the same server gives the samples a reply read as bytes gives."""
    from megatron_dapo.rollout.sglang import client

    server = real_servers.servers[1]
    prompts = [_prompt(f"p{i}", 6 + i) for i in range(3)]
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, n=2)
    with SGLangEngine([server.url]) as engine:
        as_bytes = engine.generate(prompts, greedy)
    mapped = []
    read_mapped = client._read_mapped
    monkeypatch.setattr(client, "MAPPED_BODY", 1)
    monkeypatch.setattr(client, "_read_mapped", lambda r, size: mapped.append(size) or read_mapped(r, size))
    with SGLangEngine([server.url]) as engine:
        from_map = engine.generate(prompts, greedy)
    assert len(mapped) >= 1 and len(from_map) == len(as_bytes) == 6
    for a, b in zip(as_bytes, from_map, strict=True):
        assert (a.prompt_id, a.sample_index, a.response_token_ids) == (b.prompt_id, b.sample_index, b.response_token_ids)
        assert max(abs(x - y) for x, y in zip(a.rollout_log_probs, b.rollout_log_probs, strict=True)) < 1e-5
