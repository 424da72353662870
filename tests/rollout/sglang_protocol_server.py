"""A protocol-faithful stand-in for an SGLang server, for CPU tests of the real SGLang engine code.

It is a real HTTP server on 127.0.0.1 that speaks the endpoints and reply formats SGLang documents
(/generate single and batched with output_token_logprobs and finish_reason objects, /abort_request,
/health, /health_generate, /get_model_info, /get_server_info, /flush_cache, the weight-update and
memory-occupation endpoints). Only the model is a toy: a deterministic hash of the context picks
each next token (`toy_continuation`), so tests know the exact expected output.

Test knobs live in `ProtocolState` (delays, transient 503s, malformed replies, speculative counts)
and it records what it received (requests, concurrency, weights). Run as a script it accepts the
`python -m sglang.launch_server` flags that `build_launch_command` emits (an unknown flag is an
error), serves until SIGTERM or `--max-lifetime-s`, and with `--join-weight-groups` really joins the
weight-update process group and receives broadcast weights.
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

VOCAB = 97
SAMPLING_KEYS = {  # SGLang's SamplingParams API fields; anything else is rejected like SGLang does
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "custom_params",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
}


def toy_next_token(context: Sequence[int], seed: int) -> int:
    h = seed & 0x7FFFFFFF
    for t in context[-4:]:
        h = (h * 1000003 + t + 1) % (1 << 31)
    return (h + 7919 * len(context)) % VOCAB


def toy_logprob(token: int, step: int) -> float:
    return -0.01 * (1 + (token + step) % 50)


def toy_continuation(
    input_ids: Sequence[int], *, seed: int, max_new_tokens: int, stop_token_ids: Sequence[int] = ()
) -> tuple[list[int], list[float], dict]:
    """(tokens, log-probs, finish_reason) the toy model produces; the stop token is included."""
    ctx, tokens, logps = list(input_ids), [], []
    for step in range(max_new_tokens):
        tok = toy_next_token(ctx, seed)
        tokens.append(tok)
        logps.append(toy_logprob(tok, step))
        ctx.append(tok)
        if tok in stop_token_ids:
            return tokens, logps, {"type": "stop", "matched": tok}
    return tokens, logps, {"type": "length", "length": max_new_tokens}


@dataclass
class ProtocolState:
    """Knobs (set by tests) and records (read by tests). Guard mutations with `lock`."""

    model_path: str = "toy-model"
    server_args: dict = field(default_factory=dict)
    delay_s: float = 0.0  # before generating each /generate request
    token_delay_s: float = 0.0  # per generated token
    fail_next: int = 0  # answer the next k /generate requests with HTTP `fail_status`
    fail_status: int = 503
    malform: str | None = None  # logprobs_short | finish_reason | output_ids | not_list | spec_negative
    spec_num_draft_tokens: int | None = None  # report speculative counts (current SGLang names)
    spec_legacy_names: bool = False  # ... or the names of earlier SGLang releases
    join_weight_groups: bool = False  # really join the process group (subprocess mode)
    tp_size: int = 1
    released: bool = False
    weight_version: str = "default"
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: list = field(default_factory=list)  # (path, body) in arrival order
    generate_inflight: int = 0
    generate_max_inflight: int = 0
    aborts: dict = field(default_factory=dict)  # rid -> Event of in-flight requests
    tensor_buckets: list = field(
        default_factory=list
    )  # per /update_weights_from_tensor: [(name, shape, dtype, nbytes)]
    weights: dict = field(default_factory=dict)  # name -> tensor received
    weight_group: Any = None
    stopping: threading.Event = field(default_factory=threading.Event)

    def paths(self) -> list[str]:
        with self.lock:
            return [p for p, _ in self.requests]

    def bodies(self, path: str) -> list:
        with self.lock:
            return [b for p, b in self.requests if p == path]


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args):  # keep test output clean
        pass

    def _reply(self, status: int, body: Any = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n)) if n else None

    def do_GET(self):
        self._dispatch(None)

    def do_POST(self):
        try:
            body = self._body()
        except ValueError:
            return self._reply(400, {"error": "body is not JSON"})
        self._dispatch(body)

    def _dispatch(self, body: Any) -> None:
        st = self.server.state
        path = self.path.split("?")[0]
        with st.lock:
            st.requests.append((path, body))
        route = _ROUTES.get(path)
        if route is None:
            return self._reply(404, {"error": f"no route {path}"})
        try:
            status, reply = route(st, body)
        except (KeyError, TypeError, ValueError) as e:  # SGLang answers bad requests with 400
            status, reply = 400, {"error": f"{type(e).__name__}: {e}"}
        self._reply(status, reply)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: ProtocolState


def _health(st, _):
    return (200, None) if not st.stopping.is_set() else (503, None)


def _model_info(st, _):
    return 200, {
        "model_path": st.model_path,
        "tokenizer_path": st.model_path,
        "is_generation": True,
        "weight_version": st.weight_version,
    }


def _server_info(st, _):
    return 200, dict(st.server_args)


def _generate(st: ProtocolState, body: dict):
    with st.lock:
        if st.fail_next > 0:
            st.fail_next -= 1
            return st.fail_status, {"error": "transient overload" if st.fail_status >= 500 else "bad request"}
        st.generate_inflight += 1
        st.generate_max_inflight = max(st.generate_max_inflight, st.generate_inflight)
    try:
        return _generate_locked_out(st, body)
    finally:
        with st.lock:
            st.generate_inflight -= 1


def _generate_locked_out(st: ProtocolState, body: dict):
    ids = body["input_ids"]
    single = bool(ids) and isinstance(ids[0], int)
    batch = [ids] if single else ids
    params = body.get("sampling_params") or {}
    params = [params] * len(batch) if isinstance(params, dict) else params
    rids = body.get("rid")
    rids = [rids] if isinstance(rids, str) else (rids or [f"auto-{random.getrandbits(48):x}" for _ in batch])
    if not (len(params) == len(rids) == len(batch)):
        raise ValueError("input_ids, sampling_params and rid lengths differ")
    for p in params:
        unknown = set(p) - SAMPLING_KEYS
        if unknown:
            raise TypeError(f"SamplingParams got unexpected keyword arguments {sorted(unknown)}")
    events = [threading.Event() for _ in batch]
    with st.lock:
        st.aborts.update(zip(rids, events, strict=True))
    try:
        _interruptible_sleep(st, st.delay_s, events)
        results = [
            _one(st, b, p, r, e, body.get("return_logprob", False))
            for b, p, r, e in zip(batch, params, rids, events, strict=True)
        ]
    finally:
        with st.lock:
            for r in rids:
                st.aborts.pop(r, None)
    if st.malform == "not_list" and not single:
        return 200, results[0]
    return 200, results[0] if single else results


def _interruptible_sleep(st: ProtocolState, seconds: float, events: Sequence[threading.Event]) -> bool:
    """Sleep up to `seconds`; True when every event was set (aborted) or the server stops."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if all(e.is_set() for e in events) or st.stopping.is_set():
            return True
        time.sleep(min(0.005, max(0.0, end - time.monotonic())))
    return all(e.is_set() for e in events) or st.stopping.is_set()


def _one(
    st: ProtocolState, input_ids, params: dict, rid: str, aborted: threading.Event, want_logprob: bool
) -> dict:
    seed = params.get("sampling_seed")
    seed = random.getrandbits(31) if seed is None else seed
    max_new = params.get("max_new_tokens", 128)
    tokens, logps, finish = toy_continuation(
        input_ids, seed=seed, max_new_tokens=max_new, stop_token_ids=params.get("stop_token_ids") or ()
    )
    for i in range(len(tokens)):  # decode step by step so an abort lands mid-generation
        if (
            aborted.is_set()
            or st.stopping.is_set()
            or (st.token_delay_s and _interruptible_sleep(st, st.token_delay_s, [aborted]))
        ):
            tokens, logps, finish = (
                tokens[:i],
                logps[:i],
                {"type": "abort", "message": "Abort request by user"},
            )
            break
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": len(input_ids),
        "completion_tokens": len(tokens),
        "cached_tokens": 0,
        "e2e_latency": 0.0,
        "weight_version": st.weight_version,
    }
    if want_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logps, tokens, strict=True)]
    output_ids = list(tokens)
    if st.spec_num_draft_tokens and tokens:
        verify = (len(tokens) + 1) // 2  # the toy accepts one draft token every other verify step
        accepted = len(tokens) - verify
        proposed = verify * (st.spec_num_draft_tokens - 1)
        if st.spec_legacy_names:
            meta.update(spec_verify_ct=verify, spec_accept_token_num=accepted, spec_draft_token_num=proposed)
        else:
            meta.update(
                spec_verify_ct=verify,
                spec_num_correct_drafts=accepted,
                spec_num_proposed_drafts=proposed,
                spec_accept_rate=accepted / max(proposed, 1),
                spec_accept_length=len(tokens) / verify,
            )
    if st.malform == "logprobs_short" and want_logprob:
        meta["output_token_logprobs"] = meta["output_token_logprobs"][:-1]
    elif st.malform == "finish_reason":
        meta["finish_reason"] = {"type": "eos"}
    elif st.malform == "output_ids":
        output_ids = output_ids + [0]
    elif st.malform == "spec_negative":
        meta["spec_verify_ct"] = -1
    return {"text": " ".join(f"t{t}" for t in tokens), "output_ids": output_ids, "meta_info": meta}


def _abort(st: ProtocolState, body: dict):
    body = body or {}
    with st.lock:
        targets = list(st.aborts.values()) if body.get("abort_all") else [st.aborts.get(body.get("rid", ""))]
    for e in targets:
        if e is not None:
            e.set()
    return 200, None


def _flush(st, _):
    return 200, None


def _memory(released: bool):
    def route(st: ProtocolState, body):
        if body is not None and not isinstance(body.get("tags", None), (list, type(None))):
            raise TypeError("tags must be a list or null")
        with st.lock:
            st.released = released
        return 200, None  # SGLang answers these with an empty 200

    return route


def _from_disk(st: ProtocolState, body: dict):
    with st.lock:
        st.weight_version = body.get("weight_version") or st.weight_version
    return 200, {"success": True, "message": f"loaded {body['model_path']}", "num_paused_requests": 0}


def _from_tensor(st: ProtocolState, body: dict):
    from multiprocessing.reduction import ForkingPickler

    entries = body["serialized_named_tensors"]
    if len(entries) != st.tp_size:
        return 400, {
            "success": False,
            "message": f"expected {st.tp_size} entries (one per TP rank), got {len(entries)}",
        }
    # Trusted input: the test process itself serialized it (SGLang does the same unpickling).
    named = ForkingPickler.loads(base64.b64decode(entries[0], validate=True))
    with st.lock:
        st.tensor_buckets.append(
            [(n, tuple(t.shape), str(t.dtype), t.numel() * t.element_size()) for n, t in named]
        )
        st.weights.update({n: t.clone() for n, t in named})
        if body.get("weight_version"):
            st.weight_version = body["weight_version"]
    return 200, {"success": True, "message": "Succeeded to update model weights."}


def _init_group(st: ProtocolState, body: dict):
    if st.join_weight_groups:
        from megatron_dapo.rollout.sglang_weights import init_weight_update_group

        st.weight_group = init_weight_update_group(
            master_address=body["master_address"],
            master_port=body["master_port"],
            rank=body["rank_offset"],
            world_size=body["world_size"],
            group_name=body["group_name"],
            backend=body["backend"],
            timeout_s=60,
        )
    return 200, {"success": True, "message": "Succeeded to initialize custom process group."}


def _from_distributed(st: ProtocolState, body: dict):
    names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError("names, dtypes and shapes lengths differ")
    if st.weight_group is not None:
        from megatron_dapo.rollout.sglang_weights import receive_bucket

        received = receive_bucket(names, dtypes, shapes, group=st.weight_group)
        with st.lock:
            st.weights.update(dict(received))
    with st.lock:
        if body.get("weight_version"):
            st.weight_version = body["weight_version"]
    return 200, {"success": True, "message": "Succeeded to update parameter online."}


def _get_weights(st: ProtocolState, body: dict):
    t = st.weights[body["name"]]
    return 200, t.flatten().float()[: body.get("truncate_size", 100)].tolist()


def _recorded(st: ProtocolState, _):
    """Test-only (not an SGLang endpoint): what a subprocess server received, for assertions."""
    with st.lock:
        return 200, [[p, b] for p, b in st.requests if p != "/_test/requests"]


def _destroy_group(st: ProtocolState, body: dict):
    if st.weight_group is not None:
        import torch.distributed

        torch.distributed.destroy_process_group(st.weight_group)
        st.weight_group = None
    return 200, {"success": True, "message": "destroyed"}


_ROUTES = {
    "/health": _health,
    "/health_generate": _health,
    "/get_model_info": _model_info,
    "/get_server_info": _server_info,
    "/generate": _generate,
    "/abort_request": _abort,
    "/flush_cache": _flush,
    "/release_memory_occupation": _memory(True),
    "/resume_memory_occupation": _memory(False),
    "/update_weights_from_disk": _from_disk,
    "/update_weights_from_tensor": _from_tensor,
    "/init_weights_update_group": _init_group,
    "/update_weights_from_distributed": _from_distributed,
    "/get_weights_by_name": _get_weights,
    "/destroy_weights_update_group": _destroy_group,
    "/_test/requests": _recorded,
}


class ProtocolServer:
    """Serve `ProtocolState` on 127.0.0.1 (port 0 = a free port) in a thread; stops itself after
    `max_lifetime_s` if the test never does."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        state: ProtocolState | None = None,
        max_lifetime_s: float = 120.0,
    ):
        self.state = state or ProtocolState()
        self._httpd = _Server((host, port), _Handler)
        self._httpd.state = self.state
        self.url = f"http://{host}:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._watchdog = threading.Timer(max_lifetime_s, self.stop)
        self._watchdog.daemon = True
        self._stopped = threading.Lock()

    def start(self) -> ProtocolServer:
        self._thread.start()
        self._watchdog.start()
        return self

    def stop(self) -> None:
        if not self._stopped.acquire(blocking=False):
            return
        self.state.stopping.set()  # ends delays in handler threads
        self._watchdog.cancel()
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> ProtocolServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--mem-fraction-static", type=float)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--base-gpu-id", type=int)
    ap.add_argument("--enable-memory-saver", action="store_true")
    ap.add_argument("--enable-deterministic-inference", action="store_true")
    ap.add_argument("--speculative-algorithm", choices=["EAGLE", "NEXTN"])
    ap.add_argument("--speculative-num-steps", type=int)
    ap.add_argument("--speculative-eagle-topk", type=int)
    ap.add_argument("--speculative-num-draft-tokens", type=int)
    ap.add_argument("--max-lifetime-s", type=float, default=60.0, help="test-only: stop by itself")
    ap.add_argument("--join-weight-groups", action="store_true", help="test-only: really receive weights")
    args = ap.parse_args(argv)
    state = ProtocolState(
        model_path=args.model_path,
        server_args=vars(args),
        tp_size=args.tp_size,
        join_weight_groups=args.join_weight_groups,
        spec_num_draft_tokens=args.speculative_num_draft_tokens if args.speculative_algorithm else None,
    )
    server = ProtocolServer(host=args.host, port=args.port, state=state, max_lifetime_s=args.max_lifetime_s)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.stop, daemon=True).start())
    server.start()
    print(f"protocol server ready on {server.url}", flush=True)
    server._thread.join()


if __name__ == "__main__":
    main()
