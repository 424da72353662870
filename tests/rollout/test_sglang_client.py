"""The engine's HTTP client at the recipes' request count (rollout/sglang/client.py): 1,536 generation
requests per batch must not need 1,536 sockets, and running out of them is the client's fault, never a
server's."""

from __future__ import annotations

import errno
import json
import mmap
import resource
import subprocess
import sys
import textwrap

import orjson
import pytest
import requests

from megatron_dapo.rollout.sglang import client
from tests.standin import ROOT, StandinServer


def test_request_slots_stay_within_half_the_open_file_limit_after_the_reserve():
    assert client.request_slots(256, 32, 1 << 20) == 256 * 32  # a generous limit: max_concurrency per server
    assert client.request_slots(1024, 2, 1024) == (1024 - client.FD_RESERVE) // 2 == 384
    assert client.request_slots(256, 32, 100) == client.MIN_SLOTS
    assert client.per_host(1024, 2, 384) == 192 and client.per_host(8, 2, 384) == 8


def test_out_of_file_descriptors_is_told_apart_from_a_refused_connection():
    emfile = requests.ConnectionError(OSError(errno.EMFILE, "Too many open files"))
    refused = requests.ConnectionError(ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"))
    assert client.is_client_resource_error(emfile)
    assert not client.is_client_resource_error(refused)
    try:
        try:
            raise OSError(errno.ENFILE, "file table overflow")
        except OSError as inner:
            raise requests.ConnectionError("wrapped") from inner
    except requests.ConnectionError as e:
        assert client.is_client_resource_error(e)


def test_the_soft_open_file_limit_is_raised_to_the_hard_one():
    code = textwrap.dedent("""
        import resource
        from megatron_dapo.rollout.sglang.client import raise_open_file_limit
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        print(soft, hard, *raise_open_file_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    """)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    assert out.returncode == 0, out.stderr
    assert [int(x) for x in out.stdout.split()] == [256, hard, hard, hard, hard]


def test_1536_requests_under_ulimit_n_1024_finish_with_no_server_marked_down(tmp_path):
    """The recipe's generation batch in requests (1,536), every one held by the server for a while so
    they would all be in flight at once, from a client whose soft and hard open-file limit is 1,024 (a
    common default that a scheduler passes on). Before the bound, one thread and one socket per request
    failed with EMFILE, and the engine took healthy servers down for it."""
    script = textwrap.dedent("""
        import json, resource, sys
        from megatron_dapo.rollout.base import PromptInput, SamplingParams
        from megatron_dapo.rollout.sglang.engine import SGLangEngine
        urls = sys.argv[1:]
        with SGLangEngine(urls, max_batch_size=1, max_concurrency=1024, connect_timeout_s=30) as eng:
            out = eng.generate([PromptInput(f"p{i}", (1, 2)) for i in range(1536)], SamplingParams(max_new_tokens=1))
            counts = eng.pool.take_counts()
            print(json.dumps({"samples": len(out), "finished": sum(s.finish_reason == "length" for s in out),
                              "slots": eng.request_slots, "limit": resource.getrlimit(resource.RLIMIT_NOFILE),
                              "failures": counts["failures"], "up": counts["up"], "states": eng.pool.state}))
    """)
    with StandinServer(toy=True, log_dir=tmp_path) as a, StandinServer(toy=True, log_dir=tmp_path) as b:
        for s in (a, b):
            s.knobs(delay_s=0.5)
        r = subprocess.run([sys.executable, "-c", script, a.url, b.url], capture_output=True, text=True, cwd=ROOT,
                           timeout=600, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)))
        assert r.returncode == 0, r.stderr[-4000:]
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert got["limit"] == [1024, 1024] and got["slots"] == 384
        assert got["samples"] == got["finished"] == 1536
        assert got["failures"] == 0 and got["up"] == 2, got
        assert len(a.requests("/generate")) + len(b.requests("/generate")) == 1536


class _Replies:
    """A loopback HTTP/1.1 server answering each POST with `body` (then `.body`), or with a Content-Length above what it
    then sends before it closes the connection (`cut`); records the client port of every request."""

    def __init__(self, body: bytes, *, cut: bool = False):
        import http.server
        import threading

        outer = self
        self.ports: list[int] = []
        self.body = body  # what the next POST is answered with

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.ports.append(self.client_address[1])
                self.send_response(200)
                self.send_header("Content-Length", str(len(outer.body) + (100 if cut else 0)))
                self.end_headers()
                self.wfile.write(outer.body)
                if cut:
                    self.close_connection = True

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/generate"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_reply_larger_than_a_read_chunk_arrives_whole_in_its_own_map_and_the_connection_is_reused():
    assert client.MAPPED_BODY <= client.READ_CHUNK
    body = json.dumps([{"text": "x" * (client.READ_CHUNK + 12_345)}, {"i": 2}]).encode()
    small = json.dumps([{"text": "x" * 1000}]).encode()
    srv = _Replies(body)
    try:
        session = client.shared_session(1, 4)
        for _ in range(3):
            status, got = client.post_read(session, srv.url, {"rid": ["a"]}, timeout=(5, 5))
            assert status == 200 and isinstance(got, mmap.mmap) and len(got) == len(body) and got[:] == body
            assert orjson.loads(client.json_bytes(got))[1] == {"i": 2}
        srv.body = small
        status, got = client.post_read(session, srv.url, {"rid": ["a"]}, timeout=(5, 5))
        assert status == 200 and got == small and client.json_bytes(got) is got  # a small body stays bytes
        assert len(set(srv.ports)) == 1  # the connection went back to the pool after each body was read
    finally:
        srv.close()


@pytest.mark.parametrize("size", [50_000, client.MAPPED_BODY + 50_000], ids=["bytes", "mapped"])
def test_a_connection_lost_mid_body_raises_what_the_engine_reads_as_a_lost_server(size):
    srv = _Replies(b'{"text": "' + b"y" * size, cut=True)
    try:
        session = client.shared_session(1, 4)
        try:
            client.post_read(session, srv.url, {"rid": ["a"]}, timeout=(5, 5))
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:
            assert not client.is_client_resource_error(e)
        else:
            raise AssertionError("a body cut short was returned as a whole reply")
    finally:
        srv.close()


def test_an_error_body_is_cut_to_the_characters_asked_for_even_mid_character():
    assert client.body_text("é".encode() * 400, 5) == "ééééé"
    assert client.body_text(b"abc\xff", 10) == "abc\ufffd"


def test_a_burst_of_finished_requests_holds_at_most_replies_at_once_bodies_and_every_exit_gives_its_slot(
        tmp_path, monkeypatch):
    """48 requests that finish together (the end of a batch), each made rows slowly: at most REPLIES_AT_ONCE
    replies are read and in parse at once, the bound is reached, and every sample arrives. Replies that
    fail (HTTP 503, retried; a reply that is not a list, an error) give their slot back."""
    import time as _time

    from megatron_dapo.rollout.base import PromptInput, RolloutEngineError, SamplingParams
    from megatron_dapo.rollout.sglang import engine as engine_mod
    from megatron_dapo.rollout.sglang.engine import SGLangEngine

    parse = engine_mod.parse_generate_output

    def slow_parse(*a, **k):  # every reply's rows take a while: without the bound the burst would pile up
        _time.sleep(0.02)
        return parse(*a, **k)

    monkeypatch.setattr(engine_mod, "parse_generate_output", slow_parse)
    prompts = [PromptInput(f"p{i}", (1, 2, 3)) for i in range(48)]
    with StandinServer(toy=True, log_dir=tmp_path) as srv:
        with SGLangEngine([srv.url], max_batch_size=1, max_concurrency=48, max_retries=2, backoff_s=0.01) as eng:
            slots = eng._reply_slots
            srv.knobs(delay_s=0.5)
            out = eng.generate(prompts, SamplingParams(max_new_tokens=4))
            assert len(out) == 48 and all(s.finish_reason == "length" for s in out)
            assert slots.most == client.REPLIES_AT_ONCE and slots.held == 0, (slots.most, slots.held)

            srv.knobs(delay_s=0.0, fail_next=6, fail_status=503)  # retried: each failed attempt gives its slot
            assert len(eng.generate(prompts[:12], SamplingParams(max_new_tokens=4))) == 12
            assert slots.held == 0
            srv.knobs(malform="not_list")
            with pytest.raises(RolloutEngineError, match="expected a list"):
                eng.generate(prompts[:12], SamplingParams(max_new_tokens=4))
            deadline = _time.monotonic() + 30  # the call raised at its first error; its other requests end now
            while slots.held and _time.monotonic() < deadline:
                _time.sleep(0.01)
            assert slots.held == 0
            srv.knobs(malform=None)
            assert len(eng.generate(prompts, SamplingParams(max_new_tokens=4))) == 48 and slots.held == 0
