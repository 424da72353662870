"""SGLang /generate: the request body the engine sends and the validation of each reply item.

Request (SGLang's GenerateReqInput and SamplingParams, every field checked against the release
protocols in tests/assets/sglang): a batch with `input_ids` (one token list per item),
`sampling_params` (one dict per item: max_new_tokens, temperature, top_p, top_k, stop_token_ids,
min_new_tokens when > 0 (every supported release masks EOS and the stop tokens before it), and
sampling_seed when the servers honour seeds), `rid` (one id per item), `return_logprob: true`,
`logprob_start_len: -1` (output tokens only), `stream: false`, and `return_routed_experts: true` when the
engine replays routing (sglang.routing).

Reply: a list, one result per item in order: `{"text", "output_ids", "meta_info": {"id",
"finish_reason": {"type": "stop"|"length"|"abort", ...}, "prompt_tokens", "completion_tokens",
"output_token_logprobs": [[logprob, token_id, text|null], ...], speculative counters}}`. Response
tokens are read from `output_token_logprobs` and cross-checked with `output_ids` and
`completion_tokens` when present; a mismatch raises EngineReplyError naming the request and field.
The counters' names depend on the release (sglang.versions); they become
Sample.meta["spec_draft_tokens" | "spec_accepted_tokens" | "spec_verify_ct"]. Asked for, `meta_info.routed_experts`
(sglang.routing) must be present unless the request was aborted; its absence means a server launched
without --enable-return-routed-experts (SGLang then captures nothing and says nothing).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import requests
import torch

from megatron_dapo.rollout.base import (
    FINISH_REASONS,
    LOGPROB_ROUNDOFF,
    PromptInput,
    RolloutEngineError,
    SamplingParams,
    derive_sample_seed,
)
from megatron_dapo.rollout.ragged import TOKEN_DTYPE
from megatron_dapo.rollout.sglang.routing import (
    META_KEY,
    REQUEST_FIELD,
    RoutingLayout,
    decode_routed_experts,
    routed_tokens,
)
from megatron_dapo.rollout.sglang.versions import ROUTED_EXPERTS_FLAG, SPEC_VERIFY_KEY, ReleaseFeatures

MAX_TOKEN_ID = 2**31
"""Token ids are held and sent between ranks as int32 (rollout.ragged.TOKEN_DTYPE): a larger id is refused at
the reply."""


class EngineReplyError(RolloutEngineError):
    """A server reply that does not follow the protocol; the message names the request and field."""


class EngineRequestError(RolloutEngineError):
    """A request that failed (HTTP 4xx, or 5xx / connection errors after every retry)."""


class EngineTimeoutError(EngineRequestError):
    """A request that timed out on its last attempt."""


@dataclass(frozen=True)
class ParsedOutput:
    """One /generate result, validated."""

    token_ids: torch.Tensor
    """[R] int32 (rollout.ragged.TOKEN_DTYPE), the response tokens."""
    log_probs: torch.Tensor
    """[R] float64, their log-probs as the server wrote them."""
    finish_reason: str
    meta: dict[str, int]
    weight_version: int | None = None
    """meta_info.weight_version as the server reports it, when it is a version this trainer set (an int);
    None for the server's initial "default" or releases without the field."""
    routed_experts: Any = None
    """[L, P + R - 1, K] expert ids (sglang.routing) when asked for; None otherwise or for an abort without them."""
    first_weight_version: int | None = None
    """The version of the first of meta_info.weight_versions (0.5.19+: the spans of output tokens each weight
    version produced) when the weights changed during the request; None when one version made every token."""


def build_generate_payload(
    items: Sequence[tuple[PromptInput, int]], sampling: SamplingParams, rids: Sequence[str], *, seeds: bool = True,
    routed_experts: bool = False,
) -> dict[str, Any]:
    """JSON body of one batched POST /generate; `items` are (prompt, sample_index) pairs. With
    `seeds` false no sampling_seed is sent (a server without deterministic inference ignores it);
    `routed_experts` asks for the MoE routing of every item."""
    params = []
    for prompt, j in items:
        p: dict[str, Any] = {
            "max_new_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
        }
        if sampling.stop_token_ids:
            p["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.min_new_tokens:
            p["min_new_tokens"] = sampling.min_new_tokens
        if seeds and sampling.seed is not None:
            p["sampling_seed"] = derive_sample_seed(sampling.seed, prompt.prompt_id, j)
        params.append(p)
    body = {
        "input_ids": [list(prompt.token_ids) for prompt, _ in items],
        "sampling_params": params,
        "rid": list(rids),
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
    }
    if routed_experts:
        body[REQUEST_FIELD] = True
    return body


def spec_fields(features: ReleaseFeatures) -> tuple[tuple[str, str], ...]:
    """(Sample.meta key, the release's meta_info name) of the speculative-decoding counters."""
    return (("spec_draft_tokens", features.spec_proposed_key), ("spec_accepted_tokens", features.spec_accepted_key),
            ("spec_verify_ct", SPEC_VERIFY_KEY))


def parse_spec_meta(meta_info: dict[str, Any], *, request: str, fields: Sequence[tuple[str, str]]) -> dict[str, int]:
    """Speculative-decoding counts of one request: empty when the server ran without speculative
    decoding or the request had no verify step (SGLang then sends no counters)."""
    out: dict[str, int] = {}
    for key, name in fields:
        if name is None or name not in meta_info:
            continue
        v = meta_info[name]
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise EngineReplyError(f"{request}: meta_info.{name} must be an int >= 0, got {v!r}")
        out[key] = v
    return out


def parse_generate_output(
    item: Any, *, request: str, max_new_tokens: int, spec: Sequence[tuple[str, str]] = (),
    routing: RoutingLayout | None = None, prompt_len: int = 0, cut: list | None = None,
) -> ParsedOutput:
    """Validate one /generate result and pull out tokens, log-probs, finish reason and spec meta; with
    `routing` (the model's layout) also the routed experts of the prompt (`prompt_len` tokens) and response
    (`cut`: the routing strings cut from the reply's bytes, sglang.routing.cut_routed_experts)."""
    if not isinstance(item, dict):
        raise EngineReplyError(f"{request}: result must be a JSON object, got {type(item).__name__}")
    meta = item.get("meta_info")
    if not isinstance(meta, dict):
        raise EngineReplyError(f"{request}: field meta_info missing or not an object")
    fr = meta.get("finish_reason")
    if not isinstance(fr, dict) or fr.get("type") not in FINISH_REASONS:
        raise EngineReplyError(
            f"{request}: meta_info.finish_reason must be an object with type in {FINISH_REASONS}, got {fr!r}"
        )
    finish = fr["type"]
    entries = meta.get("output_token_logprobs")
    if entries is None and finish == "abort":
        entries = []  # aborted before the first decode step: SGLang may send no log-probs at all
    if not isinstance(entries, list):
        raise EngineReplyError(f"{request}: meta_info.output_token_logprobs missing or not a list")
    tokens, logps = _entries_to_tensors(entries, request=request)
    output_ids = item.get("output_ids")
    if output_ids is not None and (not isinstance(output_ids, list) or len(output_ids) != len(tokens)
                                   or output_ids != tokens.tolist()):
        got = f"{len(output_ids)} tokens" if isinstance(output_ids, list) else type(output_ids).__name__
        raise EngineReplyError(
            f"{request}: output_ids ({got}) disagree with meta_info.output_token_logprobs ({len(tokens)} tokens)"
        )
    completion = meta.get("completion_tokens")
    if completion is not None and finish != "abort" and completion != len(tokens):
        raise EngineReplyError(
            f"{request}: meta_info.completion_tokens={completion!r} but output_token_logprobs has {len(tokens)} entries"
        )
    if len(tokens) > max_new_tokens:
        raise EngineReplyError(
            f"{request}: meta_info.output_token_logprobs has {len(tokens)} tokens > max_new_tokens={max_new_tokens}"
        )
    wv = meta.get("weight_version")
    version = int(wv) if isinstance(wv, str) and wv.isdigit() else None
    first = first_span_version(meta.get("weight_versions"), request=request)
    if first is not None and version is not None and first > version:
        raise EngineReplyError(f"{request}: meta_info.weight_versions starts at version {first}, newer than "
                               f"meta_info.weight_version {version}")
    routed = None if routing is None else parse_routing(meta, request=request, layout=routing, finish=finish,
                                                        num_tokens=routed_tokens(prompt_len, len(tokens)), cut=cut)
    return ParsedOutput(tokens, logps, finish, parse_spec_meta(meta, request=request, fields=spec),
                        weight_version=version, routed_experts=routed,
                        first_weight_version=first if version is not None and first != version else None)


def _entries_to_tensors(entries: list, *, request: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids int32, log-probs float64) of output_token_logprobs ([[logprob, token_id, text], ...]).

    A reply carries up to 16 x 20k entries: the columns are pulled out and checked at C speed (type sets,
    min, isfinite), about 0.15 us a token; the loop that names the offending entry runs only when a check
    fails. The checks are those a Sample makes (rollout.base), which generate_batch's rows never become."""
    try:
        tokens, logps = [e[1] for e in entries], [e[0] for e in entries]
    except (TypeError, IndexError, KeyError):
        tokens = logps = None
    if (tokens is not None and set(map(type, tokens)) <= {int} and set(map(type, logps)) <= {float, int}):
        try:
            tok = torch.tensor(tokens, dtype=TOKEN_DTYPE)
            lp = torch.tensor(logps, dtype=torch.float64)
        except (ValueError, OverflowError, RuntimeError):  # an int beyond int32: named below
            tok = lp = None
        if tok is not None and (not len(tokens) or (int(tok.min()) >= 0 and int(tok.max()) < MAX_TOKEN_ID
                                                     and bool(torch.isfinite(lp).all())
                                                     and float(lp.max()) <= LOGPROB_ROUNDOFF)):
            return tok, lp
    for i, e in enumerate(entries):
        if not (isinstance(e, (list, tuple)) and len(e) >= 2):
            raise EngineReplyError(
                f"{request}: meta_info.output_token_logprobs[{i}] must be [logprob, token_id, text], got {e!r}"
            )
        lp, tok = e[0], e[1]
        if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
            raise EngineReplyError(
                f"{request}: meta_info.output_token_logprobs[{i}] token id {tok!r} is not an int >= 0"
            )
        if tok >= MAX_TOKEN_ID:
            raise EngineReplyError(f"{request}: meta_info.output_token_logprobs[{i}] token id {tok} is not a "
                                   f"vocabulary id (>= 2**31)")
        if not isinstance(lp, (int, float)) or isinstance(lp, bool) or not math.isfinite(lp):
            raise EngineReplyError(
                f"{request}: meta_info.output_token_logprobs[{i}] log-prob {lp!r} is not finite"
            )
        if lp > LOGPROB_ROUNDOFF:
            raise EngineReplyError(f"{request}: meta_info.output_token_logprobs[{i}] log-prob {lp!r} is above 0 "
                                   f"(more than the round-off {LOGPROB_ROUNDOFF:g} allowed)")
    raise AssertionError(f"{request}: output_token_logprobs failed a check that no entry fails")


def first_span_version(spans: Any, *, request: str) -> int | None:
    """The version of the first span of meta_info.weight_versions ([{version, start, end}, ...] over the
    output tokens, oldest first); None without spans or when it is not a version this trainer set."""
    if spans is None:
        return None
    if not isinstance(spans, list) or not spans or not all(isinstance(s, dict) and "version" in s for s in spans):
        raise EngineReplyError(f"{request}: meta_info.weight_versions must be a non-empty list of objects "
                               f"with a version, got {spans!r}")
    v = spans[0]["version"]
    return int(v) if isinstance(v, str) and v.isdigit() else None


def parse_routing(meta_info: dict[str, Any], *, request: str, layout: RoutingLayout, finish: str, num_tokens: int,
                  cut: list | None = None):
    """The routed experts of one result ([L, num_tokens, K], sglang.routing); None for an abort without them.
    cut: the routing strings cut from the reply's bytes (sglang.routing.cut_routed_experts)."""
    value = meta_info.get(META_KEY)
    if value is None:
        if finish == "abort":
            return None  # aborted before the scheduler ran it: SGLang collects routing only at the finish
        raise EngineReplyError(f"{request}: meta_info.{META_KEY} is missing although the request asked for it: "
                               f"the server runs without {ROUTED_EXPERTS_FLAG} (SGLang then captures nothing)")
    try:
        return decode_routed_experts(value, num_layers=layout.num_layers, top_k=layout.top_k,
                                     num_experts=layout.num_experts, num_tokens=num_tokens, where=request,
                                     cut=cut)
    except ValueError as e:
        raise EngineReplyError(str(e)) from e


def post_control(url: str, path: str, payload: Any, *, timeout_s: float, connect_timeout_s: float = 10.0) -> str | None:
    """POST one control request (weights, memory, sessions); None on success, else the error text. An HTTP
    status other than 200 or a JSON `success: false` is a failure; a 200 with an empty or non-JSON body
    (some endpoints answer so) is a success."""
    try:
        r = requests.post(url + path, json=payload, timeout=(connect_timeout_s, timeout_s))
    except requests.RequestException as e:
        return f"{type(e).__name__}: {e}"
    if r.status_code != 200:
        return f"HTTP {r.status_code}: {r.text[:500]}"
    try:
        body = r.json() if r.content else None
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("success") is False:
        return f"success=false: {body.get('message', '')}"
    return None
