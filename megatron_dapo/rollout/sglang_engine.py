"""SGLang rollout engine: an HTTP client of one or more SGLang servers (`RolloutEngine`).

Protocol (SGLang's documented native API, checked against the SGLang docs and its io_struct.py):

- POST /generate with a batch: `input_ids` (list of token lists), `sampling_params` (one dict per
  item: temperature, top_p, top_k, max_new_tokens, stop_token_ids, sampling_seed), `rid` (one id
  per item), `return_logprob: true`, `logprob_start_len: -1` (output tokens only), `stream: false`.
  The reply is a list, one result per item in order: `{"text", "output_ids", "meta_info": {"id",
  "finish_reason": {"type": "stop"|"length"|"abort", ...}, "prompt_tokens", "completion_tokens",
  "output_token_logprobs": [[logprob, token_id, text|null], ...], spec_* counts}}`.
  Response tokens are read from `output_token_logprobs` and cross-checked with `output_ids` and
  `completion_tokens` when present; a mismatch raises EngineReplyError naming the field.
- n > 1 is expanded here into n batch items (SGLang's own `n` reorders batch outputs); with a seed,
  item j of prompt p gets `sampling_seed = derive_sample_seed(seed, p, j)`. SGLang honours
  sampling_seed only when launched with --enable-deterministic-inference.
- rollout_log_probs are what SGLang returns: by default log_softmax(logits / temperature) of the
  sampled token, before top-k / top-p filtering (SGLANG_RETURN_ORIGINAL_LOGPROB switches to the
  pre-temperature distribution: leave it unset so they match the actor's log-probs at temperature).
- POST /abort_request {"abort_all": true}: in-flight requests finish with finish_reason "abort"
  and their partial output. GET /health, /health_generate, /get_model_info.
  POST /release_memory_occupation and /resume_memory_occupation {"tags": null | [...]}.
  Weight updates: see sglang_weights.py.
- Speculative decoding: per-request `spec_verify_ct` plus the proposed / accepted draft counts,
  named `spec_num_proposed_drafts` / `spec_num_correct_drafts` in current SGLang and
  `spec_draft_token_num` / `spec_accept_token_num` in earlier releases. They become
  Sample.meta["spec_draft_tokens" | "spec_accepted_tokens" | "spec_verify_ct"].

Concurrency: at most `max_concurrency` requests in flight per server (blocking `requests` calls on
a thread pool of max_concurrency x servers threads); each request carries up to `max_batch_size`
items; a request goes to the server with the fewest requests in flight.
Connection errors, timeouts and HTTP 5xx are retried `max_retries` times with exponential backoff
(possibly on another server); HTTP 4xx is not retried.
"""

from __future__ import annotations

import functools
import logging
import threading
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import requests
import torch

from megatron_dapo.rollout import sglang_weights as sw
from megatron_dapo.rollout.base import (
    FINISH_REASONS,
    PromptInput,
    RolloutEngine,
    RolloutEngineError,
    Sample,
    SamplingParams,
    check_generate_inputs,
    derive_sample_seed,
)

logger = logging.getLogger(__name__)

# (meta key in Sample.meta, SGLang names in order of preference: current release first)
_SPEC_FIELDS = (
    ("spec_draft_tokens", ("spec_num_proposed_drafts", "spec_draft_token_num", "spec_proposed_drafts")),
    ("spec_accepted_tokens", ("spec_num_correct_drafts", "spec_accept_token_num", "spec_accepted_drafts")),
    ("spec_verify_ct", ("spec_verify_ct",)),
)


class EngineReplyError(RolloutEngineError):
    """A server reply that does not follow the protocol; the message names the request and field."""


class EngineRequestError(RolloutEngineError):
    """A request that failed (HTTP 4xx, or 5xx / connection errors after every retry)."""


class EngineTimeoutError(EngineRequestError):
    """A request that timed out on its last attempt."""


@dataclass(frozen=True)
class ParsedOutput:
    """One /generate result, validated."""

    token_ids: tuple[int, ...]
    log_probs: tuple[float, ...]
    finish_reason: str
    meta: dict[str, int]


def build_generate_payload(
    items: Sequence[tuple[PromptInput, int]], sampling: SamplingParams, rids: Sequence[str]
) -> dict[str, Any]:
    """JSON body of one batched POST /generate; `items` are (prompt, sample_index) pairs."""
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
        if sampling.seed is not None:
            p["sampling_seed"] = derive_sample_seed(sampling.seed, prompt.prompt_id, j)
        params.append(p)
    return {
        "input_ids": [list(prompt.token_ids) for prompt, _ in items],
        "sampling_params": params,
        "rid": list(rids),
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
    }


def parse_spec_meta(meta_info: dict[str, Any], *, request: str) -> dict[str, int]:
    """Speculative-decoding counts of one request (empty when the server ran without them)."""
    out: dict[str, int] = {}
    for key, names in _SPEC_FIELDS:
        name = next((n for n in names if n in meta_info), None)
        if name is None:
            continue
        v = meta_info[name]
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise EngineReplyError(f"{request}: meta_info.{name} must be an int >= 0, got {v!r}")
        out[key] = v
    return out


def parse_generate_output(item: Any, *, request: str, max_new_tokens: int) -> ParsedOutput:
    """Validate one /generate result and pull out tokens, log-probs, finish reason and spec meta."""
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
    tokens, logps = [], []
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
        if (
            not isinstance(lp, (int, float))
            or isinstance(lp, bool)
            or not (lp == lp and abs(lp) != float("inf"))
        ):
            raise EngineReplyError(
                f"{request}: meta_info.output_token_logprobs[{i}] log-prob {lp!r} is not finite"
            )
        tokens.append(tok)
        logps.append(float(lp))
    output_ids = item.get("output_ids")
    if output_ids is not None and list(output_ids) != tokens:
        raise EngineReplyError(
            f"{request}: output_ids ({len(output_ids)} tokens) disagree with meta_info.output_token_logprobs "
            f"({len(tokens)} tokens)"
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
    return ParsedOutput(tuple(tokens), tuple(logps), finish, parse_spec_meta(meta, request=request))


class SGLangEngine(RolloutEngine):
    """Rollout over SGLang servers at `urls` (see the module docstring for the protocol)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        max_concurrency: int = 64,
        max_batch_size: int = 16,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        control_timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        tp_size: int = 1,
        policy_version: int = 0,
    ):
        if isinstance(urls, str) or not urls:
            raise ValueError(f"urls must be a non-empty list of server URLs, got {urls!r}")
        for name, v, lo in (
            ("max_concurrency", max_concurrency, 1),
            ("max_batch_size", max_batch_size, 1),
            ("max_retries", max_retries, 0),
            ("tp_size", tp_size, 1),
            ("policy_version", policy_version, 0),
        ):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"SGLangEngine {name} must be an int >= {lo}, got {v!r}")
        for name, v in (
            ("request_timeout_s", request_timeout_s),
            ("connect_timeout_s", connect_timeout_s),
            ("control_timeout_s", control_timeout_s),
            ("max_backoff_s", max_backoff_s),
        ):
            if not v > 0:
                raise ValueError(f"SGLangEngine {name} must be > 0, got {v!r}")
        if not backoff_s >= 0:
            raise ValueError(f"SGLangEngine backoff_s must be >= 0, got {backoff_s!r}")
        self.urls = [u.rstrip("/") for u in urls]
        self.max_concurrency = max_concurrency
        self.max_batch_size = max_batch_size
        self.request_timeout_s = float(request_timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.control_timeout_s = float(control_timeout_s)
        self.max_retries = max_retries
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.tp_size = tp_size
        self._policy_version = policy_version
        self._inflight = dict.fromkeys(self.urls, 0)
        self._slot_free = threading.Condition()
        self._next_url = 0  # round-robin tie break between equally loaded servers
        self._abort_event = threading.Event()  # replaced by abort(); generate calls keep theirs
        self._pool = ThreadPoolExecutor(
            max_workers=max_concurrency * len(self.urls), thread_name_prefix="sglang"
        )
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        self._sessions_lock = threading.Lock()
        self._weight_group = None
        self._weight_group_name: str | None = None
        self._closed = False

    # ----------------------------------------------------------------------------- generation

    @property
    def max_sequence_length(self) -> int | None:
        """The servers' context length (SGLang's /get_server_info `context_length`), read once; None if
        the servers do not report one."""
        if not hasattr(self, "_context_length"):
            info = {}
            try:
                info = self._session().get(self.urls[0] + "/get_server_info", timeout=self.control_timeout_s).json()
            except Exception:  # noqa: BLE001 - an old server without the endpoint: no check
                info = {}
            value = info.get("context_length") if isinstance(info, dict) else None
            self._context_length = int(value) if isinstance(value, int) and value > 0 else None
        return self._context_length

    def _check_context(self, prompts: Sequence[PromptInput], sampling: SamplingParams) -> None:
        """A prompt that cannot fit with max_new_tokens is a named error before any request is sent."""
        limit = self.max_sequence_length
        if limit is None:
            return
        for p in prompts:
            total = len(p.token_ids) + sampling.max_new_tokens
            if total > limit:
                raise ValueError(f"prompt {p.prompt_id!r}: {len(p.token_ids)} prompt tokens + max_new_tokens="
                                 f"{sampling.max_new_tokens} = {total} > the server's context length={limit}")

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def generate(self, prompts: Sequence[PromptInput], sampling: SamplingParams) -> list[Sample]:
        if self._closed:
            raise RolloutEngineError("SGLangEngine is closed")
        check_generate_inputs(prompts, sampling)
        self._check_context(prompts, sampling)
        items = [(p, j) for p in prompts for j in range(sampling.n)]
        batches = [items[i : i + self.max_batch_size] for i in range(0, len(items), self.max_batch_size)]
        aborted = self._abort_event
        failed = threading.Event()  # set when one batch fails: the others stop before sending
        call_id = uuid.uuid4().hex[:12]
        futures = [
            self._pool.submit(self._run_batch, batch, sampling, f"{call_id}-{k}", aborted, failed)
            for k, batch in enumerate(batches)
        ]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                failed.set()
                for other in futures:
                    other.cancel()
                raise f.exception()
        return [s for f in futures for s in f.result()]

    def _run_batch(
        self,
        batch: list[tuple[PromptInput, int]],
        sampling: SamplingParams,
        batch_id: str,
        aborted: threading.Event,
        failed: threading.Event,
    ) -> list[Sample]:
        version = self._policy_version
        rids = [f"{batch_id}-{i}" for i in range(len(batch))]
        reply, url = None, None
        if not (aborted.is_set() or failed.is_set()):
            payload = build_generate_payload(batch, sampling, rids)
            reply, url = self._post_generate(payload, batch_id, aborted, failed)
        if reply is None:  # aborted (or a sibling batch failed) before this one got an answer
            return [self._sample(p, j, ParsedOutput((), (), "abort", {}), version) for p, j in batch]
        if not isinstance(reply, list) or len(reply) != len(batch):
            got = f"a list of {len(reply)}" if isinstance(reply, list) else type(reply).__name__
            raise EngineReplyError(
                f"{url}/generate batch {batch_id}: expected a list of {len(batch)} results, got {got}"
            )
        limit = sampling.max_new_tokens
        return [
            self._sample(
                p,
                j,
                parse_generate_output(
                    item,
                    request=f"{url}/generate rid={rid} (prompt_id={p.prompt_id!r}, sample_index={j})",
                    max_new_tokens=limit,
                ),
                version,
            )
            for (p, j), rid, item in zip(batch, rids, reply, strict=True)
        ]

    @staticmethod
    def _sample(prompt: PromptInput, j: int, parsed: ParsedOutput, version: int) -> Sample:
        return Sample(
            prompt_id=prompt.prompt_id,
            sample_index=j,
            prompt_token_ids=prompt.token_ids,
            response_token_ids=parsed.token_ids,
            rollout_log_probs=parsed.log_probs,
            finish_reason=parsed.finish_reason,
            policy_version=version,
            meta=dict(parsed.meta),
        )

    def _post_generate(
        self, payload: dict, batch_id: str, aborted: threading.Event, failed: threading.Event
    ) -> tuple[Any, str | None]:
        """POST /generate with retries; (None, None) when aborted first."""
        last_error, last_url, timed_out = "", None, False
        for attempt in range(self.max_retries + 1):
            if attempt:
                delay = min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)
                if aborted.wait(delay) or failed.is_set():
                    return None, None
            if aborted.is_set() or failed.is_set():
                return None, None
            url = self._acquire_url()
            last_url = url
            try:
                r = self._session().post(
                    url + "/generate", json=payload, timeout=(self.connect_timeout_s, self.request_timeout_s)
                )
            except requests.Timeout as e:
                last_error, timed_out = f"timed out after {self.request_timeout_s:g} s ({e})", True
                continue
            except requests.ConnectionError as e:
                last_error, timed_out = f"connection error: {e}", False
                continue
            finally:
                self._release_url(url)
            if r.status_code >= 500:
                last_error, timed_out = f"HTTP {r.status_code}: {r.text[:300]}", False
                continue
            if r.status_code != 200:
                if aborted.is_set():
                    return None, None
                raise EngineRequestError(
                    f"{url}/generate batch {batch_id}: HTTP {r.status_code}: {r.text[:500]}"
                )
            try:
                return r.json(), url
            except ValueError as e:
                raise EngineReplyError(f"{url}/generate batch {batch_id}: reply is not JSON ({e})") from e
        if aborted.is_set():
            return None, None
        cls = EngineTimeoutError if timed_out else EngineRequestError
        raise cls(
            f"{last_url}/generate batch {batch_id} failed after {self.max_retries + 1} attempts: {last_error}"
        )

    def _acquire_url(self) -> str:
        with self._slot_free:
            while True:
                n = len(self.urls)
                order = [self.urls[(self._next_url + k) % n] for k in range(n)]
                url = min(order, key=self._inflight.__getitem__)
                if self._inflight[url] < self.max_concurrency:
                    self._inflight[url] += 1
                    self._next_url = (self.urls.index(url) + 1) % n
                    return url
                self._slot_free.wait()

    def _release_url(self, url: str) -> None:
        with self._slot_free:
            self._inflight[url] -= 1
            self._slot_free.notify()

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = requests.Session()
            self._local.session = s
            with self._sessions_lock:
                self._sessions.append(s)
        return s

    # ----------------------------------------------------------------------------- control

    def abort(self) -> None:
        """Abort every generate call in flight: unsent batches return at once, sent ones are aborted
        by the servers (/abort_request abort_all) and come back with their partial output.

        A request that reaches a server after its /abort_request runs completes normally.
        """
        old, self._abort_event = self._abort_event, threading.Event()
        old.set()
        for url, err in self._post_all(
            "/abort_request", {"abort_all": True}, timeout_s=self.connect_timeout_s, check=False
        ):
            if err is not None:
                logger.warning("abort: %s/abort_request failed: %s", url, err)

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free weights and KV cache (tags: None = all; or ["weights"], ["kv_cache"]). Needs --enable-memory-saver."""
        self._post_all("/release_memory_occupation", {"tags": None if tags is None else list(tags)})

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        self._post_all("/resume_memory_occupation", {"tags": None if tags is None else list(tags)})

    def flush_cache(self) -> None:
        self._post_all("/flush_cache", None)

    def health(self, *, deep: bool = False) -> dict[str, Any]:
        """Per server: /health (or /health_generate when deep, which runs one generation) and /get_model_info."""
        servers = []
        for url in self.urls:
            entry: dict[str, Any] = {"url": url, "healthy": False}
            try:
                r = self._session().get(
                    url + ("/health_generate" if deep else "/health"), timeout=self.control_timeout_s
                )
                entry["healthy"] = r.status_code == 200
                if r.status_code != 200:
                    entry["error"] = f"HTTP {r.status_code}"
                else:
                    info = self._session().get(url + "/get_model_info", timeout=self.control_timeout_s)
                    entry["model_info"] = info.json() if info.status_code == 200 else None
            except (requests.RequestException, ValueError) as e:
                entry["error"] = f"{type(e).__name__}: {e}"
            servers.append(entry)
        return {
            "healthy": all(s["healthy"] for s in servers),
            "policy_version": self._policy_version,
            "servers": servers,
        }

    def _post_all(self, path: str, payload: Any, *, timeout_s: float | None = None, check: bool = True):
        """POST the same payload to every server (see `_post_bodies`)."""
        return self._post_bodies(path, [payload] * len(self.urls), timeout_s=timeout_s, check=check)

    def _post_bodies(
        self, path: str, bodies: list, *, timeout_s: float | None = None, check: bool = True
    ) -> list[tuple[str, str | None]]:
        """POST bodies[i] to server i concurrently; with `check`, raise one error listing every failure."""
        timeout = timeout_s or self.control_timeout_s
        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            errors = list(pool.map(lambda u, b: self._post_control(u, path, b, timeout), self.urls, bodies))
        failures = [f"{url}{path}: {err}" for url, err in zip(self.urls, errors) if err is not None]
        if check and failures:
            raise EngineRequestError("; ".join(failures))
        return list(zip(self.urls, errors))

    def _post_control(self, url: str, path: str, payload: Any, timeout_s: float) -> str | None:
        """One control request; None on success, else the error text. A JSON `success: false` is a failure."""
        try:
            r = requests.post(url + path, json=payload, timeout=(self.connect_timeout_s, timeout_s))
        except requests.RequestException as e:
            return f"{type(e).__name__}: {e}"
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {r.text[:500]}"
        try:
            body = r.json() if r.content else None
        except ValueError:
            body = None  # some endpoints answer 200 with an empty or non-JSON body
        if isinstance(body, dict) and body.get("success") is False:
            return f"success=false: {body.get('message', '')}"
        return None

    # ----------------------------------------------------------------------------- weights

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
        *,
        policy_version: int,
        bucket_mb: int = 512,
        model_path: str | None = None,
    ) -> None:
        """New weights from `model_path` (disk), else from `named_tensors` over the weight-update group
        when `init_weights_update_group` ran (disaggregated), else as serialized tensors (colocated).
        With neither, the caller already pushed the weights and only the version changes."""
        if not isinstance(policy_version, int) or policy_version < self._policy_version:
            raise ValueError(
                f"policy_version must be an int >= {self._policy_version} (current), got {policy_version!r}"
            )
        if model_path is not None:
            self.update_weights_from_disk(model_path, policy_version=policy_version)
        elif named_tensors is not None:
            if self._weight_group is not None:
                self.update_weights_from_distributed(
                    named_tensors, bucket_mb=bucket_mb, policy_version=policy_version
                )
            else:
                self.update_weights_from_tensors(
                    named_tensors, bucket_mb=bucket_mb, policy_version=policy_version
                )
        self._policy_version = policy_version

    def update_weights_from_disk(self, model_path: str, *, policy_version: int) -> None:
        self._post_all(
            "/update_weights_from_disk", {"model_path": model_path, "weight_version": str(policy_version)}
        )
        self._policy_version = policy_version

    def update_weights_from_tensors(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, bucket_mb: float, policy_version: int
    ) -> int:
        """Colocated sync (servers on the trainer's node open its tensors); returns the bucket count.
        To send per-rank shards gathered by the caller, use `post_serialized_bucket`."""
        n = sw.send_tensor_buckets(
            named_tensors,
            bucket_mb=bucket_mb,
            tp_size=self.tp_size,
            num_servers=len(self.urls),
            weight_version=str(policy_version),
            post=self._post_bodies,
        )
        self._policy_version = policy_version
        return n

    def post_serialized_bucket(
        self, serialized_per_rank: Sequence[str], *, flush_cache: bool, weight_version: str | None
    ) -> None:
        """POST one /update_weights_from_tensor bucket (one serialized entry per server TP rank, e.g.
        gathered from the trainer's ranks) to every server."""
        if len(serialized_per_rank) != self.tp_size:
            raise ValueError(
                f"serialized_per_rank has {len(serialized_per_rank)} entries, tp_size={self.tp_size}"
            )
        body = sw.tensor_update_payload(
            serialized_per_rank, flush_cache=flush_cache, weight_version=weight_version
        )
        self._post_all("/update_weights_from_tensor", body)

    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        group_name: str = "megatron_dapo_weights",
        backend: str = "nccl",
        timeout_s: float = 600.0,
    ) -> torch.distributed.ProcessGroup:
        """Join every server TP rank and this process (rank 0, hosting the rendezvous) in one group."""
        post = functools.partial(self._post_bodies, timeout_s=timeout_s)
        self._weight_group = sw.join_weight_group(
            master_address=master_address,
            master_port=master_port,
            tp_size=self.tp_size,
            num_servers=len(self.urls),
            group_name=group_name,
            backend=backend,
            timeout_s=timeout_s,
            post=post,
        )
        self._weight_group_name = group_name
        return self._weight_group

    def update_weights_from_distributed(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, bucket_mb: float, policy_version: int
    ) -> int:
        """Disaggregated sync over the weight-update group; returns the bucket count."""
        if self._weight_group is None:
            raise RolloutEngineError("update_weights_from_distributed needs init_weights_update_group first")
        n = sw.send_distributed_buckets(
            named_tensors,
            bucket_mb=bucket_mb,
            group=self._weight_group,
            group_name=self._weight_group_name,
            num_servers=len(self.urls),
            weight_version=str(policy_version),
            post=self._post_bodies,
        )
        self._policy_version = policy_version
        return n

    def destroy_weights_update_group(self) -> None:
        if self._weight_group is None:
            return
        self._post_all("/destroy_weights_update_group", {"group_name": self._weight_group_name}, check=False)
        torch.distributed.destroy_process_group(self._weight_group)
        self._weight_group = self._weight_group_name = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._abort_event.set()  # wakes batches waiting in a backoff
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._sessions_lock:
            for s in self._sessions:
                s.close()
            self._sessions.clear()
