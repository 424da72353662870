"""SGLang rollout engine: an HTTP client of one or more SGLang servers (`RolloutEngine`). Here: its
construction and its request path (generation, batching, admission, retries, streaming, the abort of
timed-out and stopped rids, the hand-off of replies to sglang.payloads). The control routes it inherits
(connect and server info, abort of everything, pause / continue, memory release / resume, flush, health,
weight updates: `ServerControl`) are in sglang/control.py; the servers' states in sglang/health.py.

Supported releases: versions.SUPPORTED (0.5.8 to 0.5.23). At construction the engine reads
every server's /server_info (control.py: its `version`, `max_req_input_len` / `context_length`, `enable_deterministic_inference`)
and refuses a release outside the range with UnsupportedSGLangVersion; what differs per release
(routes, counter names, weight-update sessions) comes from `versions.features_for`.

Protocol (the request and reply layout: sglang.payloads):

- POST /generate with a batch of up to `max_batch_size` items. n > 1 is expanded here into n batch
  items (SGLang's own `n` reorders batch outputs); with a seed, item j of prompt p gets
  `sampling_seed = derive_sample_seed(seed, p, j)`, sent only when the servers run with
  --enable-deterministic-inference (SGLang ignores it otherwise; the engine then logs once that
  rollouts are not seeded, and `require_deterministic=True` makes that an error at connect).
- A prompt whose tokens + max_new_tokens exceed the servers' context length (their
  --context-length, which the launcher sets) is a ValueError before anything is sent; SGLang
  itself would refuse only an input of the full context and cut max_new_tokens silently.
- rollout_log_probs are what SGLang returns: by default log_softmax(logits / temperature) of the
  sampled token, before top-k / top-p filtering (SGLANG_RETURN_ORIGINAL_LOGPROB switches to the
  pre-temperature distribution: leave it unset so they match the actor's log-probs at temperature).
- POST /abort_request {"rid": rid} aborts every request whose rid starts with `rid` (the
  scheduler matches prefixes), so rids are prefix-free (`request_ids`). {"abort_all": true}
  (`abort`) is a control route (control.py).
- Streaming (`generate_streaming`): one request per group, each group reported as its request returns;
  after the stop the requests still running are aborted by rid.
- Routed experts (opt-in, `return_routed_experts`: R3): every request carries `return_routed_experts: true`
  and each Sample the decoded `meta_info.routed_experts` (sglang/routing.py).
- Pause / continue, memory release / resume, health, weight updates: control.py.

Concurrency: each request carries up to `max_batch_size` items and goes to the server with the fewest
sequences in flight that admits it now: at most `max_concurrency` requests, and no more sequences
than the server decodes at once (its running capacity from /server_info: versions.running_capacity).
Work beyond that waits here, not in SGLang's queue, so `request_timeout_s` bounds a request's own
generation time however long the batch (blocking `requests` calls over one shared connection pool, on
at most max_concurrency x servers threads, fewer when the open-file limit is lower: sglang/client.py).
A request whose server refuses or drops the connection takes that server out of the rotation
(`self.pool`, sglang/health.py: polled, restarted when the trainer launched it, back with the current
weights) and is re-sent at once to another server without using a retry; with no server up for
`server_down_timeout_s`, AllServersDown. Timeouts and HTTP 5xx are retried `max_retries` times with
exponential backoff (possibly on another server); HTTP 4xx is not retried. Before a timed-out request is retried its
rids are aborted on the server that timed out (it would otherwise keep generating them), and the
retry carries fresh rids (SGLang refuses a rid that is still in flight).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

import orjson
import requests
import torch

from megatron_dapo.rollout.base import (
    BatchGroupsDone,
    BatchRow,
    GroupsDone,
    PromptInput,
    RolloutBatch,
    RolloutEngine,
    RolloutEngineError,
    RoutingOwners,
    Sample,
    SamplingParams,
    check_generate_inputs,
    placed_row,
    rows_to_ragged,
)
from megatron_dapo.rollout.ragged import TOKEN_DTYPE, RowArena
from megatron_dapo.rollout.sglang import client
from megatron_dapo.rollout.sglang.control import ServerControl
from megatron_dapo.rollout.sglang.health import AllServersDown, ServerPool  # noqa: F401  (AllServersDown: API)
from megatron_dapo.rollout.sglang.payloads import (  # noqa: F401  (re-exported: the engine's API)
    EngineReplyError,
    EngineRequestError,
    EngineTimeoutError,
    ParsedOutput,
    build_generate_payload,
    parse_generate_output,
    parse_spec_meta,
)
from megatron_dapo.rollout.sglang.routing import RoutingLayout, cut_routed_experts

logger = logging.getLogger(__name__)

ABORT_REPEAT_S = 0.5
"""How often a streaming stop re-sends /abort_request for a request still running."""
ABORT_THREADS = 16
"""/abort_request posts in flight at once when a streaming stop aborts the running requests."""


def request_ids(batch_id: str, attempt: int, count: int) -> list[str]:
    """The rids of one attempt at one batch: `<batch>.<attempt>.<item>`, the item zero-padded to one width.
    No rid is a prefix of another (batch ids differ before a '.', items have equal width): SGLang's
    scheduler aborts every request whose rid *starts with* the aborted one."""
    width = len(str(max(count - 1, 0)))
    return [f"{batch_id}.{attempt}.{i:0{width}d}" for i in range(count)]

class SGLangEngine(ServerControl, RolloutEngine):
    """Rollout over SGLang servers at `urls` (see the module docstring for the protocol; the control routes:
    ServerControl, control.py)."""

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
        require_deterministic: bool = False,
        open_weight_sessions: bool = True,
        require_memory_saver: bool = False,
        health_check_interval_s: float = 5.0,
        server_down_timeout_s: float = 600.0,
        restart: Callable[[str], None] | None = None,
        stop_server: Callable[[str], None] | None = None,
        return_routed_experts: RoutingLayout | None = None,
        facts: dict | None = None,
        leader: Callable[..., None] | None = None,
    ):
        """require_deterministic: refuse servers that ignore sampling seeds (launched without
        --enable-deterministic-inference). require_memory_saver: refuse servers launched without
        --enable-memory-saver (colocated on the trainer's GPUs). open_weight_sessions: update_weights_*
        open a weight-update session themselves when the release needs one and none is open; False
        when another engine (one coordinator for several senders) opens it around the whole sync.
        health_check_interval_s / server_down_timeout_s / restart: the ServerPool's poll interval, how long
        generation waits with no server up before AllServersDown, and how a server the trainer launched is
        restarted (sglang/health.py; None: servers given by URL are only polled), and how a relaunch still
        loading is stopped when the actor's training begins (stop_server; None: left to load). return_routed_experts:
        the model's router layout to ask every request for its MoE routing (R3, actor.router_replay) and
        keep it as Sample.routed_experts [L, P + R - 1, K] (sglang/routing.py); the servers must run a release
        with it, launched with --enable-return-routed-experts, or the engine refuses at connect. None: off.
        facts / leader: an engine that follows another one's servers from another process (sglang/follower.py):
        what that one read at connect (`connect_facts`), and where a server this one loses and the requests
        it re-sends are reported (ServerPool `report`; its pool is not polled: it takes the leader's states,
        `follow`)."""
        if return_routed_experts is not None and not isinstance(return_routed_experts, RoutingLayout):
            raise ValueError(f"SGLangEngine return_routed_experts must be a RoutingLayout or None, "
                             f"got {return_routed_experts!r}")
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
        self._inflight = dict.fromkeys(self.urls, 0)  # requests on each server
        self._inflight_items = dict.fromkeys(self.urls, 0)  # and the sequences they carry
        self.capacity: dict[str, int | None] = dict.fromkeys(self.urls)
        self._slot_free = threading.Condition()
        self._next_url = 0  # round-robin tie break between equally loaded servers
        self._abort_event = threading.Event()  # replaced by abort(); generate calls keep theirs
        self._streams: set[threading.Event] = set()  # the stop events of streaming calls in progress
        # Bounded whatever the batch size (sglang/client.py): requests in flight at once within the open-file
        # limit, one shared connection pool.
        soft, _ = client.raise_open_file_limit()
        self.request_slots = client.request_slots(max_concurrency, len(self.urls), soft)
        self._pool = ThreadPoolExecutor(max_workers=self.request_slots, thread_name_prefix="sglang")
        self._abort_pool = ThreadPoolExecutor(max_workers=ABORT_THREADS, thread_name_prefix="sglang-abort")
        self._http = client.shared_session(len(self.urls), client.per_host(max_concurrency, len(self.urls),
                                                                          self.request_slots))
        self._reply_slots = client.ReplySlots()  # replies read and being made rows at once
        self._sessions_lock = threading.Lock()
        self._weight_group = None
        self._weight_group_name: str | None = None
        self._weight_session: str | None = None  # the open session's selector
        self._open_weight_sessions = bool(open_weight_sessions)
        self.routing = return_routed_experts
        self._closed = False
        self.pool: ServerPool | None = None
        try:
            if facts is None:
                self._connect(require_deterministic=require_deterministic, require_memory_saver=require_memory_saver)
            else:
                self._adopt(facts)
        except BaseException:
            self.close()
            raise
        self.pool = ServerPool(self.urls, self._slot_free, probe=self.probe, expected_version=lambda: self._policy_version,
                               interval_s=health_check_interval_s, down_timeout_s=server_down_timeout_s, restart=restart,
                               model=self.model_identity, busy=lambda url: self._inflight[url] > 0, stop=stop_server,
                               post=lambda url, path, body: self._post_control(url, path, body, self.control_timeout_s),
                               report=leader)
        if facts is None:
            self.pool.start()

    def follow(self, states: dict, policy_version: int) -> None:
        """A follower (`facts` given): take the leader engine's server states and weight version."""
        self._policy_version = policy_version
        self.pool.follow(states)

    # ----------------------------------------------------------------------------- generation

    @property
    def max_sequence_length(self) -> int | None:
        """The longest prompt + max_new_tokens every server generates without cutting (read from
        /server_info at connect: versions.request_token_limit, the smallest over the servers)."""
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
                                 f"{sampling.max_new_tokens} = {total} > {limit}, the longest request the SGLang "
                                 "servers generate in full (their context length or KV pool, less 2 tokens; "
                                 "SGLang would cut max_new_tokens silently)")

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def _check_call(self, prompts: Sequence[PromptInput], sampling: SamplingParams) -> None:
        if self._closed:
            raise RolloutEngineError("SGLangEngine is closed")
        check_generate_inputs(prompts, sampling)
        self._check_context(prompts, sampling)
        if sampling.seed is not None and not self.seeds_honoured and not self._warned_unseeded:
            self._warned_unseeded = True
            logger.warning("SGLang servers run without --enable-deterministic-inference: sampling seeds are not "
                           "sent (SGLang would ignore them) and rollouts are not reproducible; "
                           "rollout.deterministic_inference=true launches the servers with it")

    def generate(self, prompts: Sequence[PromptInput], sampling: SamplingParams) -> list[Sample]:
        return self._generate(prompts, sampling, self._sample)

    def generate_batch(self, prompts: Sequence[PromptInput], sampling: SamplingParams, *, pad_id: int,
                       max_response_length: int) -> RolloutBatch:
        """`generate` as a ragged RolloutBatch: each reply becomes tensors of its real tokens in the worker
        thread that received it, while later replies are still generated; once the last one is in, the
        batch is the rows as written into an arena on arrival (rollout.ragged.RowArena: no Python Samples, no
        padding to max_response_length, no concatenation after the last reply)."""
        arena = RowArena(len(prompts) * sampling.n, max_response_length)
        rows = self._generate(prompts, sampling, lambda *a: placed_row(self._row(*a), arena))
        return rows_to_ragged(prompts, sampling.n, rows, pad_id=pad_id, max_response_length=max_response_length,
                              arena=arena)

    def _generate(self, prompts: Sequence[PromptInput], sampling: SamplingParams, make: Callable) -> list:
        """The rows of one call, prompt-major, each made by make(prompt, j, parsed, version) in the thread
        that received its reply."""
        self._check_call(prompts, sampling)
        items = [(p, j) for p in prompts for j in range(sampling.n)]
        size = min([self.max_batch_size, *(c for c in self.capacity.values() if c is not None)])
        batches = [items[i : i + size] for i in range(0, len(items), size)]
        aborted = self._abort_event
        failed = threading.Event()  # set when one batch fails: the others stop before sending
        call_id = uuid.uuid4().hex[:12]
        futures = self._submit_all([(self._run_batch, batch, sampling, f"{call_id}-{k}", aborted, failed, None, make)
                                    for k, batch in enumerate(batches)], failed)
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                failed.set()
                for other in futures:
                    other.cancel()
                raise f.exception()
        return [s for f in futures for s in f.result()]

    def _submit_all(self, calls: list[tuple], failed: threading.Event) -> list:
        """Queue every call on the worker pool (request_slots threads: the rest of the batch waits here). A
        thread that cannot start (the user's process or thread limit) is the client's error, named so."""
        futures = []
        try:
            for fn, *args in calls:
                futures.append(self._pool.submit(fn, *args))
        except RuntimeError as e:
            failed.set()
            for f in futures:
                f.cancel()
            if "can't start new thread" not in str(e):
                raise
            raise RolloutEngineError(f"the SGLang client could not start a worker thread ({e}): the process or "
                                     f"thread limit (ulimit -u) is below the {self.request_slots} request slots "
                                     "(rollout.max_concurrency x servers, within the open-file limit)") from e
        return futures

    supports_streaming = True

    def generate_streaming(self, prompts: Sequence[PromptInput], sampling: SamplingParams, *,
                           on_groups_done: GroupsDone) -> list[Sample]:
        """`generate` that reports groups as they complete and stops when told (rollout.base, Streaming).

        Each group (the n samples of one prompt) is one /generate request, whatever max_batch_size, so a
        reply is a whole group: groups are reported as their requests return, several at once when they
        return together. Once `on_groups_done` returns True (or raises), the requests still running are
        aborted by rid (/abort_request per rid, repeated every ABORT_REPEAT_S for a request the server had
        not registered yet: SGLang ignores the abort of a rid it does not know) and come back with their
        partial output, finish_reason "abort"; those not yet sent come back aborted with no tokens.
        Groups that complete after the stop are returned complete."""
        groups = self._stream(prompts, sampling, self._sample, lambda done: on_groups_done([g for _, g in done]))
        return [s for g in groups for s in g]

    def generate_batch_streaming(self, prompts: Sequence[PromptInput], sampling: SamplingParams, *, pad_id: int,
                                 max_response_length: int, on_groups_done: BatchGroupsDone) -> RolloutBatch:
        """`generate_streaming` as a ragged batch: each reply becomes tensors in the thread that received it
        (as `generate_batch`), the callback gets the completed groups as a ragged batch, and no Python
        sample is built."""
        def batch_of(pairs: list[tuple[PromptInput, list[BatchRow]]], arena: RowArena | None = None) -> RolloutBatch:
            return rows_to_ragged([p for p, _ in pairs], sampling.n, [r for _, g in pairs for r in g], pad_id=pad_id,
                                  max_response_length=max_response_length, arena=arena)

        owners = RoutingOwners()  # R3: a reported row's routing lives in the reported batch alone

        def report(done: list[tuple[PromptInput, list[BatchRow]]]) -> bool:
            batch = batch_of(done)
            owners.take([g for _, g in done], batch)
            return on_groups_done(batch)

        arena = RowArena(len(prompts) * sampling.n, max_response_length)
        groups = self._stream(prompts, sampling, lambda *a: placed_row(self._row(*a), arena), report)
        return owners.returned(groups, batch_of(list(zip(prompts, groups, strict=True)), arena))

    def _stream(self, prompts: Sequence[PromptInput], sampling: SamplingParams, make: Callable,
                report: Callable[[list[tuple[PromptInput, list]]], bool]) -> list[list]:
        """The streaming call (generate_streaming's docstring): each group's rows made by `make` in the
        thread that received its reply; report([(prompt, rows), ...]) -> stop for the groups that complete."""
        self._check_call(prompts, sampling)
        call_id = uuid.uuid4().hex[:12]
        stop, failed = threading.Event(), threading.Event()
        running: dict[str, tuple[str, list[str]]] = {}  # batch id -> (url, rids) of requests on a server
        with self._sessions_lock:
            self._streams.add(stop)
        try:
            submitted = self._submit_all([(self._run_batch, [(p, j) for j in range(sampling.n)], sampling,
                                           f"{call_id}-{k}", stop, failed, running, make)
                                          for k, p in enumerate(prompts)], failed)
        except BaseException:
            with self._sessions_lock:
                self._streams.discard(stop)
            raise
        futures = {f: k for k, f in enumerate(submitted)}
        groups: list[list | None] = [None] * len(prompts)
        pending, stopped, aborted_at = set(futures), False, {}
        try:
            while pending:
                done, pending = wait(pending, timeout=ABORT_REPEAT_S if stopped else None,
                                     return_when=FIRST_COMPLETED)
                complete = []
                for f in sorted(done, key=futures.__getitem__):
                    if f.exception() is not None:
                        failed.set()
                        raise f.exception()
                    k = futures[f]
                    groups[k] = f.result()
                    if not stopped and all(r.finish_reason != "abort" for r in groups[k]):
                        complete.append((prompts[k], groups[k]))
                if complete and not stopped:
                    try:
                        stopped = bool(report(complete))
                    except BaseException:
                        stopped = True
                        raise
                    finally:
                        if stopped:
                            stop.set()
                if stopped:
                    self._abort_running(running, aborted_at)
        finally:
            if pending:  # an error: nothing more is read, the rest is aborted
                stop.set()
                self._abort_running(running, aborted_at)
            with self._sessions_lock:
                self._streams.discard(stop)
        return groups  # type: ignore[return-value]  # every group was filled

    def _abort_running(self, running: dict[str, tuple[str, list[str]]], sent_at: dict[str, float]) -> None:
        """/abort_request for each rid of the requests running on a server; a rid already aborted is sent
        again only after ABORT_REPEAT_S (the first may have reached the server before the request)."""
        now = time.monotonic()
        todo = [(url, rid) for url, rids in list(running.values()) for rid in rids
                if now - sent_at.get(rid, -ABORT_REPEAT_S) >= ABORT_REPEAT_S]
        for _, rid in todo:
            sent_at[rid] = now

        def post(url: str, rid: str) -> None:
            err = self._post_control(url, "/abort_request", {"rid": rid}, self.connect_timeout_s)
            if err is not None:
                logger.warning("abort of %s at %s failed: %s", rid, url, err)

        wait([self._abort_pool.submit(post, url, rid) for url, rid in todo])  # in parallel: the rest runs meanwhile

    def _run_batch(
        self,
        batch: list[tuple[PromptInput, int]],
        sampling: SamplingParams,
        batch_id: str,
        aborted: threading.Event,
        failed: threading.Event,
        running: dict | None = None,
        make: Callable | None = None,
    ) -> list:
        """The batch's rows, each make(prompt, j, parsed, version) (default: a Sample)."""
        make = make or self._sample
        version = self._policy_version
        rids = request_ids(batch_id, 0, len(batch))
        reply, url, cut = None, None, None
        try:
            if not (aborted.is_set() or failed.is_set()):
                payload = build_generate_payload(batch, sampling, rids, seeds=self.seeds_honoured,
                                                 routed_experts=self.routing is not None)
                reply, url, rids, cut = self._post_generate(payload, batch_id, aborted, failed, running)
            if reply is None:  # aborted (or a sibling batch failed) before this one got an answer
                nothing = ParsedOutput(torch.zeros(0, dtype=TOKEN_DTYPE), torch.zeros(0, dtype=torch.float64),
                                       "abort", {})
                return [make(p, j, nothing, version) for p, j in batch]
            if not isinstance(reply, list) or len(reply) != len(batch):
                got = f"a list of {len(reply)}" if isinstance(reply, list) else type(reply).__name__
                raise EngineReplyError(
                    f"{url}/generate batch {batch_id}: expected a list of {len(batch)} results, got {got}"
                )
            limit = sampling.max_new_tokens
            return [
                make(p, j, parse_generate_output(
                    item, request=f"{url}/generate rid={rid} (prompt_id={p.prompt_id!r}, sample_index={j})",
                    max_new_tokens=limit, spec=self._spec, routing=self.routing, prompt_len=len(p.token_ids),
                    cut=cut), version)
                for (p, j), rid, item in zip(batch, rids, reply, strict=True)
            ]
        finally:
            self._reply_slots.give()  # taken when the reply's headers came in (client.ReplySlots)

    def _versions(self, parsed: ParsedOutput, version: int) -> tuple[int, int | None]:
        """(policy_version, first_policy_version) of a reply. `version`: this client's weight version when the
        request was queued. A release without weight-version spans reports only the version at the end; a
        request queued before a push that ended after it then counts from the version it was queued at (the
        oldest that may have made its first tokens)."""
        first = parsed.first_weight_version
        if (first is None and not self.features.weight_version_spans and parsed.weight_version is not None
                and version < parsed.weight_version):
            first = version
        return (version if parsed.weight_version is None else parsed.weight_version), first

    def _sample(self, prompt: PromptInput, j: int, parsed: ParsedOutput, version: int) -> Sample:
        policy_version, first = self._versions(parsed, version)
        return Sample(
            prompt_id=prompt.prompt_id,
            sample_index=j,
            prompt_token_ids=prompt.token_ids,
            response_token_ids=tuple(parsed.token_ids.tolist()),
            rollout_log_probs=tuple(parsed.log_probs.tolist()),
            finish_reason=parsed.finish_reason,
            policy_version=policy_version,
            meta=dict(parsed.meta),
            routed_experts=parsed.routed_experts,
            first_policy_version=first,
        )

    def _row(self, prompt: PromptInput, j: int, parsed: ParsedOutput, version: int) -> BatchRow:
        """A reply as one row of a ragged batch (generate_batch): its tensors, log-probs in float32."""
        policy_version, _ = self._versions(parsed, version)  # a RolloutBatch row keeps the newest, as samples_to_batch
        return BatchRow(parsed.token_ids, parsed.log_probs.to(torch.float32), parsed.finish_reason, policy_version,
                        dict(parsed.meta), parsed.routed_experts)

    def _post_generate(
        self, payload: dict, batch_id: str, aborted: threading.Event, failed: threading.Event,
        running: dict | None = None,
    ) -> tuple[Any, str | None, list[str], list | None]:
        """POST /generate with retries: (reply, url, the rids of the answered attempt, the routing strings
        cut from the reply's bytes before the JSON parse when the engine asks for routing, sglang.routing);
        (None, None, rids, None) when aborted first. A timed-out attempt's rids are aborted on its server before the retry,
        which carries fresh rids. running: where the request is registered as (url, rids) while it is
        on a server (a streaming call aborts those by rid)."""
        rids = list(payload["rid"])
        last_error, last_url, timed_out = "", None, False
        attempt, tries, lost = 0, 0, None  # lost: the server that held this request when it was lost
        while attempt <= self.max_retries:
            self._reply_slots.give()  # an earlier attempt's reply, not taken
            if tries:
                if lost is None:
                    delay = min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)
                    if aborted.wait(delay) or failed.is_set():
                        return None, None, rids, None
                rids = request_ids(batch_id, tries, len(rids))
                payload = {**payload, "rid": rids}
            tries += 1
            if aborted.is_set() or failed.is_set():
                return None, None, rids, None
            url = self._acquire_url(len(rids))
            last_url = url
            if lost is not None:
                self.pool.note_reissue(lost, url, len(rids))
                lost = None
            if running is not None:
                running[batch_id] = (url, rids)
            # Aborted while waiting for a server (or, streaming, before the registration a stop reads).
            if aborted.is_set() or failed.is_set():
                if running is not None:
                    running.pop(batch_id, None)
                self._release_url(url, len(rids))
                return None, None, rids, None
            try:
                status, body = client.post_read(self._http, url + "/generate", payload,
                                                timeout=(self.connect_timeout_s, self.request_timeout_s),
                                                on_headers=self._reply_slots.take)
            except requests.Timeout as e:
                last_error, timed_out = f"timed out after {self.request_timeout_s:g} s ({e})", True
                self._abort_rids(url, rids)
                attempt += 1
                continue
            except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:
                if client.is_client_resource_error(e):  # this process is out of sockets: the server is fine
                    last_error, timed_out = (f"the client ran out of file descriptors or socket memory ({e}); "
                                             f"raise the open-file limit (ulimit -n)"), False
                    attempt += 1
                    continue
                # The server is gone (refused, or the connection dropped mid-request): it leaves the rotation
                # and the request goes at once to another server, without using up a retry (a server that
                # keeps coming back and failing does, after one re-issue per server).
                last_error, timed_out = f"connection error: {e}", False
                if self.pool is not None and tries <= len(self.urls):
                    self.pool.mark_down(url, f"/generate: {type(e).__name__}: {e}")
                    lost = url
                else:
                    attempt += 1
                continue
            finally:
                self._release_url(url, len(rids))
                if running is not None:
                    running.pop(batch_id, None)
            if status >= 500:
                last_error, timed_out = f"HTTP {status}: {client.body_text(body, 300)}", False
                attempt += 1
                continue
            if status != 200:
                if aborted.is_set():
                    return None, None, rids, None
                raise EngineRequestError(
                    f"{url}/generate batch {batch_id}: HTTP {status}: {client.body_text(body, 500)}"
                )
            cut = None
            if self.routing is not None:  # 2 KB of base64 a token: decoded from the bytes, not parsed (sglang.routing)
                body, cut = cut_routed_experts(body)
            try:  # orjson: 2.5x faster than json on a reply of 16 x 6k tokens (0.24 against 0.61 us a token)
                return orjson.loads(client.json_bytes(body)), url, rids, cut
            except ValueError as e:
                raise EngineReplyError(f"{url}/generate batch {batch_id}: reply is not JSON ({e})") from e
        if aborted.is_set():
            return None, None, rids, None
        cls = EngineTimeoutError if timed_out else EngineRequestError
        raise cls(
            f"{last_url}/generate batch {batch_id} failed after {self.max_retries + 1} attempts: {last_error}"
        )

    def _abort_rids(self, url: str, rids: Sequence[str]) -> None:
        """Abort each rid of a timed-out request (SGLang aborts by exact rid), so the server stops
        generating what nobody will read; a failure is logged (the server may be gone)."""
        for rid in rids:
            err = self._post_control(url, "/abort_request", {"rid": rid}, self.connect_timeout_s)
            if err is not None:
                logger.warning("abort of timed-out request %s at %s failed: %s", rid, url, err)
                return

    def _admits(self, url: str, items: int) -> bool:
        """Whether `url` takes a request of `items` sequences now: it is up (health.py: not paused, nothing
        released, current weights), has fewer than max_concurrency requests, and the sequences fit what it
        decodes at once (its capacity; a request larger than that alone)."""
        cap, busy = self.capacity.get(url), self._inflight_items[url]
        return (self.pool is None or self.pool.is_up(url)) and self._inflight[url] < self.max_concurrency and (
            cap is None or busy == 0 or busy + items <= cap)

    def _acquire_url(self, items: int = 1) -> str:
        """The least loaded server (in sequences) that admits the request now; waits for one. A request
        is sent only when its server decodes it at once, so its time (request_timeout_s) is spent
        generating, not queued behind the rest of the batch. With no server up for
        server_down_timeout_s, AllServersDown."""
        with self._slot_free:
            while True:
                n = len(self.urls)
                order = [self.urls[(self._next_url + k) % n] for k in range(n)]
                ready = [u for u in order if self._admits(u, items)]
                if ready:
                    url = min(ready, key=lambda u: (self._inflight_items[u], self._inflight[u]))
                    self._inflight[url] += 1
                    self._inflight_items[url] += items
                    self._next_url = (self.urls.index(url) + 1) % n
                    return url
                if self.pool is not None and self.pool.only_released():
                    raise RolloutEngineError("generation while the servers' memory is released: call "
                                             "resume_memory first (SGLang would run it over freed memory)")
                if self.pool is not None and not self.pool.up():
                    self.pool.check_any_up()
                    self._slot_free.wait(min(self.pool.interval_s, self.pool.remaining_s()) + 0.01)
                else:
                    self._slot_free.wait()

    def _release_url(self, url: str, items: int = 1) -> None:
        with self._slot_free:
            self._inflight[url] -= 1
            self._inflight_items[url] -= items
            self._slot_free.notify_all()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.pool is not None:
            self.pool.stop()
        self._abort_event.set()  # wakes batches waiting in a backoff
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._abort_pool.shutdown(wait=True, cancel_futures=True)
        self._http.close()
