"""A stand-in for an SGLang server, for CPU tests: always its own process, speaking one release's HTTP
protocol (tests/assets/sglang/protocol-<version>.json, read from that release's wheel).

    python -m tests.standin.server --model-path HF_DIR --port 30000 --tp-size 2 [--emulate-version 0.5.23]
    python -m tests.standin.server --model-path toy --toy --port 30000 ...

Start it from tests with `tests.standin.StandinServer` (a free port, the /health wait, stop/kill).
What it does as SGLang does (the release's source is the reference; see protocol.py for validation):

- /generate single and batched; replies {"text", "output_ids", "meta_info": {"id", "finish_reason"
  object, "prompt_tokens", "completion_tokens", "weight_version", "output_token_logprobs" (with
  return_logprob) and the release's speculative counters, present only after a verify step
  (0.5.8+)}}; per-request `sampling_seed` honoured only with --enable-deterministic-inference; an
  input of at least the context length is a 400, a longer max_new_tokens is cut to fit; a rid
  already in flight is a 400; generation holds the reader side of the model-update lock, so a weight
  update waits for the generations in flight and blocks new ones until it is done;
- /abort_request by exact rid or abort_all: the request ends with finish_reason abort and its
  partial output;
- /health and /health_generate answer 503 until the model is loaded; then /health is a one-token
  generation when the server is idle (unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is false), as
  0.5.23's entrypoints/http_server.py:721-785 (skipped while requests run, managers/scheduler.py:2241); /model_info, /server_info and
  the deprecated /get_model_info, /get_server_info (with `version`, `context_length` = the launch
  setting, None unless --context-length is given, and `max_req_input_len` = context - 6), as the
  release has them (others: 404); /generate refuses prompt + max_new_tokens > context and cuts
  max_new_tokens to context - 2 - prompt, as the release's tokenizer manager and scheduler do;
- /flush_cache: 400 while requests run;
- /release_memory_occupation, /resume_memory_occupation with tags (weights, kv_cache,
  cuda_graph; none = all), effective with --enable-memory-saver, which then behaves as SGLang 0.5.23
  does on a GPU, each rule killing the server ("Scheduler hit an exception" in its log, connections
  dropped): a release while a request or a /health generation runs (the `is_fully_idle` assertion,
  managers/scheduler_components/weight_updater.py:338-341); a resume of a tag that is not released
  (`offload_tags.remove`, weight_updater.py:383-390: KeyError); a forward while weights, KV cache or
  CUDA graphs are released, from /generate or from /health's generation (torch_memory_saver unmapped
  them without a CPU copy: an illegal memory access, state.check_can_generate); weights resumed
  without --enable-weights-cpu-backup hold nothing until every tensor is updated again;
- weight updates (/init_weights_update_group, /update_weights_from_distributed,
  /update_weights_from_tensor, /update_weights_from_disk, /destroy_weights_update_group) on --tp-size
  receiver ranks (weights.py); from 0.5.21 distributed and tensor updates outside a
  /begin_weight_update ... /end_weight_update session are refused with 400, as SGLang does, and
  `selector` picks the runners (target, draft: the draft runner exists with --speculative-algorithm);
  before 0.5.21 a distributed update reaches the target only, a tensor update the drafter and the
  target (weight_routes.py);
- with --speculative-algorithm on an HF Qwen3-MoE model (0.5.13+) the draft runner is SGLang's MTP
  drafter (draft.py: Qwen3MoeForCausalLMMTP, its `mtp.*` names and shapes, loaded from
  --speculative-draft-model-path, which SGLang requires for this architecture); a toy server's draft
  runner keeps whatever it is sent; --forward-delay-s / --draft-delay-s emulate decoding speed with
  and without speculation (generate.py);
- `return_routed_experts` with --enable-return-routed-experts on an HF Qwen3-MoE model: the routing of
  its own forwards in the release's encoding; the switch on a model without MoE routers exits at load
  (routing.py);
- a payload the server's unpickler cannot open kills the server ("Scheduler hit an exception" in
  its log, the HTTP connection drops), as SGLang's scheduler does.

Stand-in stricter than SGLang (each catches a wrong order that real hardware would punish later):
--speculative-algorithm on an HF model SGLang has no MTP drafter for (it would load a second full model
as the drafter) exits at load; an unknown `mtp.*` name sent to the drafter is a 400 (SGLang skips it);
generation is refused with 400 naming the cause while weights resumed without CPU backup have not all
been updated (SGLang would generate from garbage); an unknown or mis-shaped
tensor name is a 400 naming it; an unknown memory tag is a 400.

Not emulated (a request needing them is a 400 saying so, or simply absent): streaming, text prompts
(no tokenizer), sampling_params.n > 1, continuous batching (items run one after another, forwards
interleave between requests), SGLang's own abort of a non-streaming request whose client disconnected
(it polls every 4 s; here a timed-out request runs on until aborted or done, the worst case).

Test-only routes (never SGLang's) live under /_standin/: knobs (delays, transient failures,
malformed replies, kill after N tokens), requests (what arrived, in order), stats, weights
(?checksum=1: per TP rank, a checksum per received HF tensor), kill.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (python tests/standin/server.py): import from the repository
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import json
import logging
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from tests.standin import generate as _gen
from tests.standin import weight_routes as _wr
from tests.standin.cli import parse_args, server_args_dict
from tests.standin.protocol import RequestError
from tests.standin.routing import check_launch
from tests.standin.state import KNOBS, MALFORMS, MEMORY_TAGS, Reply, State, check_can_generate

log = logging.getLogger("standin")


# ----------------------------------------------------------------------------- handler


class Handler(BaseHTTPRequestHandler):
    server: Server

    def log_message(self, fmt, *args):
        log.debug(fmt, *args)

    def _send(self, status: int, body: Any) -> None:
        if body is None:
            data, ctype = b"", "application/json"
        elif isinstance(body, str):
            data, ctype = body.encode(), "text/plain; charset=utf-8"
        else:
            data, ctype = json.dumps(body).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def do_PUT(self):
        self._handle("PUT")

    def _handle(self, method: str) -> None:
        st = self.server.state
        url = urlparse(self.path)
        path, query = url.path, parse_qs(url.query)
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            return self._send(400, {"object": "error", "message": "JSON decode error", "type": "Bad Request",
                                    "param": None, "code": 400})
        if path.startswith("/_standin/"):
            route = TEST_ROUTES.get(path)
            if route is None:
                return self._send(404, {"detail": "Not Found"})
            try:
                return self._send(200, route(st, body, query, self))
            except Reply as r:
                return self._send(r.status, r.body)
        st.record(path, body)
        if path not in st.proto.routes or path not in ROUTES:
            return self._send(404, {"detail": "Not Found"})
        if method not in st.proto.routes[path]["methods"]:
            return self._send(405, {"detail": "Method Not Allowed"})
        try:
            if st.proto.request_fields(path) is not None:
                ignored = st.proto.check_body(path, body)
                if ignored:
                    with st.lock:
                        st.ignored.setdefault(path, set()).update(ignored)
            status, reply = 200, ROUTES[path](st, body if body is not None else {}, query)
        except Reply as r:
            status, reply = r.status, r.body
        except RequestError as e:
            status, reply = e.status, e.body
        self._send(status, reply)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 2048  # uvicorn's default backlog, which SGLang's HTTP server runs with
    state: State


# ----------------------------------------------------------------------------- info, health, cache


HEALTH_GENERATES = os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower() not in ("0", "false")
"""SGLang 0.5.23's /health is /health_generate unless this variable is false (srt/environ.py:344,
entrypoints/http_server.py:745-749)."""


def _health(st: State, body, query):
    if not st.ready.is_set() or st.stopping.is_set():
        raise Reply(503)
    return _health_generate(st, body, query) if HEALTH_GENERATES else None


def _health_generate(st: State, body, query):
    """One greedy token over token 0 when the scheduler is idle (entrypoints/http_server.py:751-785); skipped
    while requests run (managers/scheduler.py:2241). The probe's own forward counts as a running request (a
    release meanwhile trips the idle assert) and, with memory released, kills the server (state.py)."""
    if not st.ready.is_set() or st.stopping.is_set():
        raise Reply(503)
    with st.lock:
        idle = st.generate_inflight == 0
        if idle:
            st.generate_inflight += 1
    if not idle:
        return None
    try:
        check_can_generate(st, "health_generate")
        from tests.standin.toy import ItemSampling

        time.sleep(st.knobs["health_delay_s"])
        s = ItemSampling.from_params({"max_new_tokens": 1, "temperature": 0.0}, seed=0)
        next(iter(st.model.decoder([0], s)), None)
    finally:
        with st.lock:
            st.generate_inflight -= 1
    return None


def _model_info(st: State, body, query):
    return {"model_path": st.args.model_path, "tokenizer_path": st.args.model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": st.weight_version,
            "model_type": "toy" if st.args.toy else getattr(st.model.model.config, "model_type", None)
            if st.model is not None else None}


def _server_info(st: State, body, query):
    ctx = st.model.context_length if st.model is not None else None
    return {**server_args_dict(st.args), "version": st.proto.version, "max_total_num_tokens": ctx,
            "max_req_input_len": None if ctx is None else ctx - 6, "internal_states": [{}]}  # max_req_len - 5


def _deprecated(st: State, old: str, new: str) -> None:
    """SGLang 0.5.8+ logs this for every call of the old route (0.5.5 has only the old one)."""
    if new in st.proto.routes:
        log.warning("Endpoint '%s' is deprecated and will be removed in a future version. Please use '%s' instead.",
                    old, new)


def _flush_cache(st: State, body, query):
    with st.lock:
        busy = st.generate_inflight
    if busy:
        raise Reply(400, f"Flush cache failed: {busy} requests are running or waiting.\n")
    return "Cache flushed.\n"


def _abort(st: State, body, query):
    with st.lock:
        if body.get("abort_all"):
            targets = list(st.inflight.values())
        else:
            rid = body.get("rid")
            targets = [st.inflight[rid]] if isinstance(rid, str) and rid in st.inflight else []
    for e in targets:
        e.set()
    return None


# ----------------------------------------------------------------------------- memory


def _tags(body) -> list[str]:
    tags = body.get("tags") or list(MEMORY_TAGS)
    for t in tags:
        if t not in MEMORY_TAGS:
            raise Reply(400, {"error": {"message": f"unknown memory tag {t!r}; SGLang's are {list(MEMORY_TAGS)}"}})
    return tags


def _release(st: State, body, query):
    tags = _tags(body)
    with st.scheduler:
        with st.lock:
            busy = st.generate_inflight
        if busy:
            st.crash("release_memory_occupation", AssertionError(
                "release_memory_occupation should be called only when server is idle."))
        if not st.args.enable_memory_saver:
            log.warning("release_memory_occupation without --enable-memory-saver frees nothing")
            return None
        st.released.update(tags)
    return None


def _resume(st: State, body, query):
    tags = _tags(body)
    with st.scheduler:
        if st.args.enable_memory_saver:
            missing = [t for t in tags if t not in st.released]
            if missing:
                st.crash("resume_memory_occupation", KeyError(missing[0]))
            st.released.difference_update(tags)
            if "weights" in tags and not st.args.enable_weights_cpu_backup:
                st.stale = set(st.model.expected_names())
    return None



ROUTES = {
    "/health": _health,
    "/health_generate": _health_generate,
    "/model_info": _model_info,
    "/get_model_info": lambda st, b, q: _deprecated(st, "/get_model_info", "/model_info") or _model_info(st, b, q),
    "/server_info": _server_info,
    "/get_server_info": lambda st, b, q: _deprecated(st, "/get_server_info", "/server_info") or _server_info(st, b, q),
    "/flush_cache": _flush_cache,
    "/abort_request": _abort,
    "/generate": _gen.generate,
    "/release_memory_occupation": _release,
    "/resume_memory_occupation": _resume,
    **_wr.ROUTES,
}


# ----------------------------------------------------------------------------- test-only routes


def _t_knobs(st: State, body, query, handler):
    body = body or {}
    unknown = sorted(set(body) - set(KNOBS))
    if unknown:
        raise Reply(400, {"error": f"unknown knobs {unknown}; known: {sorted(KNOBS)}"})
    if body.get("malform", None) not in MALFORMS:
        raise Reply(400, {"error": f"malform must be one of {MALFORMS}"})
    with st.lock:
        st.knobs.update(body)
        return dict(st.knobs)


def _t_requests(st: State, body, query, handler):
    want = query.get("path", [None])[0]
    with st.lock:
        return [r for r in st.requests if want is None or r[0] == want]


def _t_stats(st: State, body, query, handler):
    with st.lock:
        return {"generate_inflight": st.generate_inflight, "generate_max_inflight": st.generate_max_inflight,
                "tokens_generated": st.tokens_generated, "weight_version": st.weight_version,
                "released": sorted(st.released), "stale": len(st.stale), "session": st.session,
                "ignored_fields": {p: sorted(v) for p, v in st.ignored.items()}, "version": st.proto.version,
                "groups": sorted(st.ranks.groups[0]) if st.ranks else [], "pid": os.getpid()}


def _t_weights(st: State, body, query, handler):
    role = query.get("role", ["target"])[0]
    if role not in st.role_weights:
        raise Reply(400, {"error": f"role {role!r}: this server has {sorted(st.role_weights)}"})
    from tests.standin.weights import tensor_checksum

    ranks = st.role_weights[role]
    with st.lock:
        if query.get("checksum", ["0"])[0] in ("1", "true"):
            return {"tp_size": len(ranks), "ranks": [{n: tensor_checksum(t) for n, t in sorted(w.items())}
                                                     for w in ranks]}
        return {"tp_size": len(ranks), "ranks": [sorted(w) for w in ranks]}


def _t_reset(st: State, body, query, handler):
    """Forget the records and restore the knobs (a server shared by a test module)."""
    with st.lock:
        st.requests.clear()
        st.ignored.clear()
        st.knobs = dict(KNOBS)
        st.generate_max_inflight = st.generate_inflight
        st.tokens_generated = 0
    return {"reset": True}


def _t_kill(st: State, body, query, handler):
    threading.Timer(0.05, lambda: os._exit(9)).start()  # after this reply is written
    return {"killing": os.getpid()}


TEST_ROUTES = {"/_standin/knobs": _t_knobs, "/_standin/requests": _t_requests, "/_standin/stats": _t_stats,
               "/_standin/weights": _t_weights, "/_standin/kill": _t_kill, "/_standin/reset": _t_reset}


# ----------------------------------------------------------------------------- main


def _load(st: State) -> None:
    a = st.args
    time.sleep(a.load_delay_s)
    try:
        if a.toy:
            from tests.standin.toy import ToyModel

            st.model = ToyModel(vocab_size=a.toy_vocab_size, context_length=a.context_length or (1 << 20))
        else:
            import torch

            from tests.standin.model import HFModel

            torch.set_num_threads(1)  # several stand-ins and trainer ranks share two cores in the tests
            st.model = HFModel(a.model_path, dtype=a.dtype, context_length=a.context_length)
            if a.speculative_algorithm:
                st.draft = _load_drafter(st)
        check_launch(a, st.model)
        st.role_weights = {role: [{} for _ in range(a.tp_size)] for role in st.roles}
    except Exception as e:  # noqa: BLE001 - a failed start is a dead server, as for SGLang
        st.crash("load", e)
    st.ready.set()
    print(f"The server is fired up and ready to roll! (stand-in for SGLang {st.proto.version}, "
          f"{'toy' if a.toy else a.model_path}, tp_size={a.tp_size})", flush=True)


def _load_drafter(st: State):
    """The MTP drafter SGLang's draft worker builds for this model (draft.py), with the `mtp.*` tensors
    of --speculative-draft-model-path loaded (a checkpoint without them leaves the initial weights, as
    SGLang leaves whatever the parameters held)."""
    from tests.standin.draft import MTP_DRAFTERS, drafter_for

    a, config = st.args, st.model.model.config
    if not a.speculative_draft_model_path:
        raise ValueError("--speculative-algorithm without --speculative-draft-model-path: SGLang defaults the "
                         "draft path to --model-path only for DeepSeek-style architectures, not for "
                         f"{config.architectures}")
    draft = drafter_for(config, st.proto.version)
    if draft is None:
        raise ValueError(f"SGLang {st.proto.version} has no MTP drafter for {config.architectures} (the stand-in "
                         f"emulates {sorted(MTP_DRAFTERS.items())}: model type and first release)")
    from safetensors import safe_open

    for f in sorted(Path(a.speculative_draft_model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            named = {k: handle.get_tensor(k) for k in handle.keys() if draft.accepts(k)}
        if draft.check(named) is None:
            draft.load(named)
    return draft


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="[standin %(levelname)s] %(message)s")
    args, proto = parse_args(argv)
    st = State(args, proto)
    httpd = Server((args.host, args.port), Handler)
    httpd.state = st

    def stop(*_):
        st.stopping.set()
        threading.Thread(target=httpd.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    watchdog = threading.Timer(args.max_lifetime_s, stop)
    watchdog.daemon = True
    watchdog.start()
    threading.Thread(target=_load, args=(st,), daemon=True).start()
    print(f"stand-in listening on http://{args.host}:{args.port}", flush=True)
    httpd.serve_forever(poll_interval=0.05)
    httpd.server_close()
    os._exit(0)  # rank threads may sit in a collective; nothing is left to flush


if __name__ == "__main__":
    main()
