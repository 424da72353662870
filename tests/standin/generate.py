"""The stand-in's POST /generate: SGLang's request normalisation, checks and reply layout.

Rids: a batch with a str rid uses it as a prefix (`<rid>_<i>`), none gets uuid hex rids (SGLang's
normalisation). Speculative counters (with --speculative-algorithm): the first token comes from the
prefill, each verify step accepts one draft token and adds the bonus token, so a response of n
tokens had verify = ceil((n - 1) / 2) steps and (n - 1) - verify accepted drafts; proposed drafts
are verify * (speculative_num_draft_tokens - 1) (verify * speculative_num_steps in 0.5.5). From
0.5.8 the counters appear only when verify > 0, under the names the release's tokenizer manager
sets (protocol JSON `meta_info_keys`).

Routed experts (`return_routed_experts`, --enable-return-routed-experts): routing.py.

Emulated speed (--forward-delay-s F, --draft-delay-s D, both 0 by default): the prefill takes F; then
without speculation every token takes F, with it every verify step takes F + speculative_num_steps * D
and yields two tokens (the schedule of the counters above). So speculation is faster per token exactly
when F + steps * D < 2 F.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from typing import Any

from tests.standin import routing
from tests.standin.protocol import value_error
from tests.standin.state import Reply, State, check_can_generate
from tests.standin.toy import ItemSampling

DEFAULT_SEED = 42  # SGLang's seed for a request without sampling_seed under deterministic inference
ABORT = {"type": "abort", "message": "Abort request by user", "status_code": None, "err_type": None}


def _as_list(value, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise value_error(f"{name} has {len(value)} entries for a batch of {n}")
        return value
    return [value] * n


def _rids(rid, n: int, single: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(rid, str):
        return [rid] if single else [f"{rid}_{i}" for i in range(n)]
    return _as_list(rid, n, "rid")


def _seed(st: State, params: dict) -> int:
    if st.args.enable_deterministic_inference:
        s = params.get("sampling_seed")
        return DEFAULT_SEED if s is None else s
    return st.rng.getrandbits(62)  # sampling_seed is validated but ignored without the flag


def generate(st: State, body: dict, query) -> Any:
    if body.get("stream"):
        raise value_error("the stand-in does not stream: send stream=false")
    ids = body.get("input_ids")
    if ids is None:
        if body.get("text") is not None:
            raise value_error("the stand-in has no tokenizer: send input_ids, not text")
        raise value_error("Either text, input_ids or input_embeds should be provided.")
    single = len(ids) == 0 or isinstance(ids[0], int)
    batch = [ids] if single else ids
    n = len(batch)
    params = _as_list(body.get("sampling_params") or {}, n, "sampling_params")
    rids = _rids(body.get("rid"), n, single)
    want_lp = _as_list(body.get("return_logprob") or False, n, "return_logprob")
    want_routes = bool(body.get("return_routed_experts"))
    for p in params:
        st.proto.check_sampling_params(p)
        if (p.get("n") or 1) != 1:
            raise value_error("the stand-in does not emulate sampling_params.n > 1; send n items")
    check_can_generate(st)
    ctx = st.model.context_length
    max_req_len = ctx - 1  # the scheduler's min(context_len - 1, KV pool - 1); the stand-in's pool is unbounded
    samplings = []
    for item, p in zip(batch, params, strict=True):
        if len(item) >= ctx:
            raise value_error(f"The input ({len(item)} tokens) is longer than the model's context length "
                              f"({ctx} tokens).")
        if any(t < 0 or t >= st.model.vocab_size for t in item):
            raise value_error(f"The input_ids {item} contains values greater than the vocab size "
                              f"({st.model.vocab_size}).")
        s = ItemSampling.from_params(p, seed=_seed(st, p))
        if p.get("max_new_tokens") is not None and len(item) + s.max_new_tokens > ctx:  # as the tokenizer manager
            raise value_error(f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                              f"You requested a total of {len(item) + s.max_new_tokens} tokens.")
        if len(item) + s.max_new_tokens > max_req_len - 1:  # the scheduler cuts max_new_tokens silently
            s = dataclasses.replace(s, max_new_tokens=max(0, max_req_len - 1 - len(item)))
        samplings.append(s)
    with st.lock:
        dup = next((r for r in rids if r in st.inflight), None) or (
            next((r for i, r in enumerate(rids) if r in rids[:i]), None))
        if dup is not None:
            raise value_error(f"Duplicate request ID detected: {dup}")
        if st.knobs["fail_next"] > 0:
            st.knobs["fail_next"] -= 1
            status = st.knobs["fail_status"]
            raise Reply(status, {"error": {"message": "transient overload" if status >= 500 else "bad request"}})
        events = {r: threading.Event() for r in rids}
        st.inflight.update(events)
        st.generate_inflight += 1
        st.generate_max_inflight = max(st.generate_max_inflight, st.generate_inflight)
    try:
        with st.rw.read():
            _sleep(st, st.knobs["delay_s"], list(events.values()))
            results = [_one(st, item, s, rid, events[rid], lp, want_routes)
                       for item, s, rid, lp in zip(batch, samplings, rids, want_lp, strict=True)]
    finally:
        with st.lock:
            st.generate_inflight -= 1
            for r in rids:
                st.inflight.pop(r, None)
    if st.knobs["malform"] == "not_list" and not single:
        return results[0]
    return results[0] if single else results


def _sleep(st: State, seconds: float, events) -> bool:
    """Sleep up to `seconds`; True when every event was set (aborted) or the server stops."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if all(e.is_set() for e in events) or st.stopping.is_set():
            return True
        time.sleep(min(0.005, max(0.0, end - time.monotonic())))
    return all(e.is_set() for e in events) or st.stopping.is_set()


def _one(st: State, input_ids, s: ItemSampling, rid: str, aborted: threading.Event, want_lp: bool,
         want_routes: bool = False) -> dict:
    start = time.monotonic()
    stops = set(s.stop_token_ids)
    if not s.ignore_eos and st.model.eos_token_id is not None:
        stops.add(st.model.eos_token_id)
    tokens, logps = [], []
    finish: dict = {"type": "length", "length": s.max_new_tokens}
    steps = [] if want_routes and getattr(st.args, routing.FLAG_DEST, False) else None
    decoder = st.model.decoder(input_ids, s) if steps is None else st.model.decoder(input_ids, s, routes=steps)
    while len(tokens) < s.max_new_tokens:
        if aborted.is_set() or st.stopping.is_set():
            finish = dict(ABORT)
            break
        delay = _forward_delay(st, len(tokens))
        if delay and _sleep(st, delay, [aborted]):
            finish = dict(ABORT)
            break
        tok, lp = next(decoder)
        tokens.append(tok)
        logps.append(lp)
        _count_token(st)
        if tok in stops:
            finish = {"type": "stop", "matched": tok}
            break
        if st.knobs["token_delay_s"] and _sleep(st, st.knobs["token_delay_s"], [aborted]):
            finish = dict(ABORT)
            break
    meta: dict[str, Any] = {"id": rid, "finish_reason": finish, "prompt_tokens": len(input_ids),
                            "completion_tokens": len(tokens), "cached_tokens": 0,
                            "e2e_latency": time.monotonic() - start}
    keys = st.proto.meta_info_keys
    if "weight_version" in keys:
        meta["weight_version"] = st.weight_version
    for k in ("num_retractions", "total_retractions"):
        if k in keys:
            meta[k] = 0
    if want_lp:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logps, tokens, strict=True)]
    if st.args.speculative_algorithm:
        meta.update(_spec_counters(st, len(tokens)))
    routing.add_to_meta(meta, st, asked=want_routes, steps=steps)
    output_ids = list(tokens)
    m = st.knobs["malform"]
    if m == "logprobs_short" and want_lp:
        meta["output_token_logprobs"] = meta["output_token_logprobs"][:-1]
    elif m == "finish_reason":
        meta["finish_reason"] = {"type": "eos"}
    elif m == "output_ids":
        output_ids = output_ids + [0]
    elif m == "spec_negative":
        meta["spec_verify_ct"] = -1
    return {"text": " ".join(f"t{t}" for t in tokens), "output_ids": output_ids, "meta_info": meta}


def _forward_delay(st: State, i: int) -> float:
    """Emulated seconds before token i (module docstring): the prefill, each token, or each verify step."""
    a = st.args
    if not a.speculative_algorithm or i == 0:
        return a.forward_delay_s
    if (i - 1) % 2:
        return 0.0  # the second token of a verify step
    return a.forward_delay_s + (a.speculative_num_steps or 3) * a.draft_delay_s


def _count_token(st: State) -> None:
    with st.lock:
        st.tokens_generated += 1
        kill = st.knobs["kill_after_tokens"]
    if kill is not None and st.tokens_generated >= kill:
        os._exit(9)  # the kill switch: the server dies mid-request


def _spec_counters(st: State, n: int) -> dict:
    verify = n // 2  # = ceil((n - 1) / 2) for n >= 1
    accepted = max(n - 1 - verify, 0)
    if not st.proto.at_least("0.5.8"):
        proposed = verify * (st.args.speculative_num_steps or 3)
        return {"spec_verify_ct": verify, "spec_accept_rate": accepted / proposed if proposed else 0.0,
                "spec_accept_length": n / verify if verify else 0}
    if verify == 0:
        return {}
    proposed = verify * ((st.args.speculative_num_draft_tokens or 4) - 1)
    values = {"spec_verify_ct": verify, "spec_accept_rate": accepted / proposed if proposed else 0.0,
              "spec_accept_length": n / verify, "spec_accept_token_num": accepted, "spec_draft_token_num": proposed,
              "spec_accepted_drafts": accepted, "spec_proposed_drafts": proposed,
              "spec_num_correct_drafts": accepted, "spec_num_proposed_drafts": proposed}
    return {k: v for k, v in values.items() if k in st.proto.meta_info_keys}
