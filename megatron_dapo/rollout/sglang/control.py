"""The SGLang engine's control routes: its calls to the servers other than the request path's own (/generate
and the abort of its rids), most made to every server at once (a probe to one). `ServerControl` is a part of `SGLangEngine` (a mixin: it reads the engine's
servers, timeouts, HTTP session, pool and weight-update state, set up in its constructor); the engine's
construction and its request path (generate, batching, admission, retries, streaming, the abort of
timed-out and stopped rids, reply parsing) are in sglang/engine.py, the servers' states in sglang/health.py.

What lives here:

- Connect: every server's /server_info (0.5.8+, else /get_server_info: its `version`,
  `max_req_input_len` / `context_length`, `enable_deterministic_inference`; versions.server_facts refuses
  a release outside versions.SUPPORTED with UnsupportedSGLangVersion) and its model identity from
  /model_info (every server must serve one model); `server_arg` reads one launch setting.
- abort: POST /abort_request {"abort_all": true} to every server; in-flight requests finish with
  finish_reason "abort" and their partial output (the engine's request path returns its unsent batches).
- POST /pause_generation {"mode"} and /continue_generation {}; POST /release_memory_occupation and
  /resume_memory_occupation {"tags": null | [...]}; each through the pool (health.py), which owns the
  servers' states. POST /flush_cache.
- Health: GET /health, /health_generate, /model_info (0.5.8+): `probe` (the pool's check), `health`,
  `refresh` and `confirm_version` around a weight sync.
- Weight updates: see sglang/weights.py; from 0.5.21 the distributed and tensor updates run inside
  a /begin_weight_update ... /end_weight_update session (`weight_update_session`).

A control call goes to every live server at once (`_post_all`, `_post_bodies`: payloads.post_control).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests
import torch

from megatron_dapo.rollout.base import RolloutEngineError
from megatron_dapo.rollout.sglang import client
from megatron_dapo.rollout.sglang import weights as sw
from megatron_dapo.rollout.sglang.health import Probe
from megatron_dapo.rollout.sglang.payloads import (
    EngineReplyError,
    EngineRequestError,
    post_control,
    spec_fields,
)
from megatron_dapo.rollout.sglang.versions import SELECTORS, UnsupportedSGLangVersion, server_facts

logger = logging.getLogger(__name__)

PAUSE_MODES = ("in_place", "retract", "abort")
HEALTH_TIMEOUT_S = 30.0
"""Read timeout of one /health probe (SGLang answers 503 itself after 20 s without scheduler output)."""


class ServerControl:
    """SGLangEngine's control routes (module docstring); the engine's constructor sets what they read."""

    # ----------------------------------------------------------------------------- connect

    def _connect(self, *, require_deterministic: bool, require_memory_saver: bool) -> None:
        """Read every server's release and launch settings (versions.server_facts)."""
        facts = server_facts([(url, self._server_info(url)) for url in self.urls],
                             require_deterministic=require_deterministic, require_memory_saver=require_memory_saver,
                             require_routed_experts=self.routing is not None)
        self.sglang_version, self.features = facts.version, facts.features
        self.seeds_honoured, self._context_length = facts.seeds_honoured, facts.context_length
        self.capacity = dict(zip(self.urls, facts.capacities, strict=True))
        models = {url: self.probe(url, deep=False) for url in self.urls}
        failed = [f"{u}: {p.error}" for u, p in models.items() if not p.answers]
        if failed:
            raise EngineRequestError("; ".join(failed))
        if len({p.model for p in models.values()}) > 1:
            listed = "; ".join(f"{u}: model_type {p.model[0]!r}, architectures {list(p.model[1])}"
                               for u, p in models.items())
            raise RolloutEngineError(f"the SGLang servers serve different models ({listed}); use one model")
        self.model_identity = models[self.urls[0]].model
        """(model_type, architectures) every server reports in /model_info (None where a release omits them)."""
        self._spec = spec_fields(self.features)
        self._warned_unseeded = False
        if self._context_length is None:
            logger.info("SGLang servers report neither max_req_input_len nor context_length: prompts that do not "
                        "fit are not refused before sending")

    def connect_facts(self) -> dict[str, Any]:
        """What `_connect` read of the servers, for an engine over the same servers in another process
        (sglang/follower.py), which takes them (`_adopt`) instead of reading them again."""
        return {"version": self.sglang_version, "features": self.features, "seeds_honoured": self.seeds_honoured,
                "context_length": self._context_length, "capacity": dict(self.capacity),
                "model": self.model_identity}

    def _adopt(self, facts: dict[str, Any]) -> None:
        self.sglang_version, self.features = facts["version"], facts["features"]
        self.seeds_honoured, self._context_length = facts["seeds_honoured"], facts["context_length"]
        self.capacity, self.model_identity = dict(facts["capacity"]), facts["model"]
        self._spec = spec_fields(self.features)
        self._warned_unseeded = False

    def _server_info(self, url: str) -> dict:
        """/server_info (0.5.8+), else the deprecated /get_server_info (which releases before 0.5.8 had)."""
        last = ""
        for path in ("/server_info", "/get_server_info"):
            try:
                r = self._session().get(url + path, timeout=(self.connect_timeout_s, self.control_timeout_s))
            except requests.RequestException as e:
                raise EngineRequestError(f"{url}{path}: cannot connect to the SGLang server ({e})") from e
            if r.status_code == 404:
                last = f"{path}: HTTP 404"
                continue
            if r.status_code != 200:
                raise EngineRequestError(f"{url}{path}: HTTP {r.status_code}: {r.text[:300]}")
            try:
                info = r.json()
            except ValueError as e:
                raise EngineReplyError(f"{url}{path}: reply is not JSON ({e})") from e
            if not isinstance(info, dict):
                raise EngineReplyError(f"{url}{path}: expected a JSON object, got {type(info).__name__}")
            return info
        raise UnsupportedSGLangVersion(f"{url}: no /server_info nor /get_server_info ({last}); not an SGLang server?")

    def server_arg(self, name: str) -> dict[str, Any]:
        """Each server's launch setting `name` as its /server_info reports it (None where absent)."""
        return {url: self._server_info(url).get(name) for url in self.urls}

    def _session(self) -> requests.Session:
        return self._http

    # ----------------------------------------------------------------------------- control

    def abort(self) -> None:
        """Abort every generate call in flight: unsent batches return at once, sent ones are aborted
        by the servers (/abort_request abort_all) and come back with their partial output.

        A request that reaches a server after its /abort_request runs completes normally.
        """
        old, self._abort_event = self._abort_event, threading.Event()
        old.set()
        with self._sessions_lock:
            for stop in self._streams:
                stop.set()
        for url, err in self._post_all(
            "/abort_request", {"abort_all": True}, timeout_s=self.connect_timeout_s, check=False
        ):
            if err is not None:
                logger.warning("abort: %s/abort_request failed: %s", url, err)

    def pause_generation(self, mode: str = "in_place") -> None:
        """Stop every server's scheduler from decoding (POST /pause_generation, every supported release):
        "in_place" holds the running requests with their KV cache until `continue_generation`, "retract"
        puts them back in the waiting queue (their cache may be dropped and recomputed), "abort" ends
        them with their partial output. Paused servers take no new requests (they wait here) and are probed
        without a generation; a server that fails the call is marked down (health.py)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_generation mode must be one of {PAUSE_MODES}, got {mode!r}")
        self.pool.pause(mode)

    def continue_generation(self) -> None:
        """Resume decoding on every paused server after `pause_generation`."""
        self.pool.resume_generation()

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free weights and KV cache (tags: None = all; or ["weights"], ["kv_cache"]). Needs --enable-memory-saver.
        Each server once idle (no request, no generating probe in flight); from here on no request or
        generating probe reaches it until it is resumed (health.py)."""
        self.pool.release(tags)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Re-take what release_memory freed, each server only the tags it released (SGLang kills a server
        asked to resume a tag it holds)."""
        self.pool.resume(tags)

    def flush_cache(self) -> None:
        self._post_all("/flush_cache", None)

    def health(self, *, deep: bool = False) -> dict[str, Any]:
        """Per server: its state, whether it answers (with `deep`, /health_generate: a generation, only on
        servers that hold their memory and are not paused) and its model info."""
        servers = []
        for url in self.urls:
            entry: dict[str, Any] = {"url": url, "state": self.pool.state[url]}
            p = self.pool.check(url) if deep else self.probe(url, deep=False)
            entry["healthy"] = p.answers
            if p.answers:
                entry["model_info"] = p.info
            else:
                entry["error"] = p.error
            servers.append(entry)
        return {
            "healthy": all(s["healthy"] for s in servers),
            "policy_version": self._policy_version,
            "servers": servers,
        }

    def probe(self, url: str, *, deep: bool = True) -> Probe:
        """One health check (health.py): /health_generate when `deep` (a one-token generation when the server
        is idle, so a hung scheduler fails it: the pool asks for it only on servers that hold their memory
        and are not paused), then the weight version from /model_info (no forward). /health_generate, not
        /health: the servers this trainer launches answer /health without generating (server.SERVER_DEFAULTS)."""
        try:
            if deep:
                r = requests.get(url + "/health_generate", timeout=(self.connect_timeout_s, HEALTH_TIMEOUT_S))
                if r.status_code != 200:
                    return Probe(False, error=f"/health_generate: HTTP {r.status_code}")
            r = requests.get(url + self.features.model_info_path, timeout=(self.connect_timeout_s, HEALTH_TIMEOUT_S))
        except requests.ConnectionError as e:
            if client.is_client_resource_error(e):
                return Probe(False, error=f"client out of file descriptors: {e}")
            return Probe(False, error=f"{type(e).__name__}: {e}", refused=not isinstance(e, requests.Timeout))
        except requests.RequestException as e:
            return Probe(False, error=f"{type(e).__name__}: {e}")
        if r.status_code != 200:
            return Probe(False, error=f"{self.features.model_info_path}: HTTP {r.status_code}")
        info = None
        try:
            info = r.json()
            version = info.get("weight_version")
            model = (info.get("model_type"), tuple(info.get("architectures") or ()))
        except (ValueError, AttributeError, TypeError):
            version, model = None, (None, ())
        return Probe(True, weight_version=None if version is None else str(version), model=model,
                     info=info if isinstance(info, dict) else None)

    def refresh(self) -> list[str]:
        """Before a weight sync, every server checked at once: a live one by /model_info (a refused
        connection takes it down), one that is down or restarting by the pool's check (answering, it joins
        this sync: stale, or up with the current weights). Returns the servers the sync feeds (live ones);
        with none, waits for one to answer up to server_down_timeout_s, then AllServersDown."""
        def check(url: str) -> None:
            if self.pool.state[url] in ("down", "restarting"):
                p = self.pool.check(url)
                if p.answers:
                    self.pool.observe(url, p)
                return
            p = self.probe(url, deep=False)
            if p.refused:
                self.pool.mark_down(url, p.error)

        with ThreadPoolExecutor(max_workers=min(len(self.urls), 32)) as pool:
            list(pool.map(check, self.urls))
        return self.pool.wait_for_targets()

    def confirm_version(self, urls: Sequence[str], version: int) -> None:
        """After a weight sync to `urls`: each is up if it reports `version`, else down (health.py)."""
        for url in urls:
            self.pool.confirm(url, version)

    def _post_all(self, path: str, payload: Any, *, timeout_s: float | None = None, check: bool = True):
        """POST the same payload to every live server (see `_post_bodies`)."""
        urls = self.urls if self.pool is None else self.pool.live()
        return self._post_bodies(path, [payload] * len(urls), timeout_s=timeout_s, check=check, urls=urls)

    def _post_bodies(
        self, path: str, bodies: list, *, timeout_s: float | None = None, check: bool = True,
        urls: Sequence[str] | None = None,
    ) -> list[tuple[str, str | None]]:
        """POST bodies[i] to urls[i] (default: every server) concurrently; with `check`, raise one error
        listing every failure."""
        timeout = timeout_s or self.control_timeout_s
        urls = list(self.urls if urls is None else urls)
        if not urls:
            return []
        with ThreadPoolExecutor(max_workers=len(urls)) as pool:
            errors = list(pool.map(lambda u, b: self._post_control(u, path, b, timeout), urls, bodies))
        failures = [f"{url}{path}: {err}" for url, err in zip(urls, errors) if err is not None]
        if check and failures:
            raise EngineRequestError("; ".join(failures))
        return list(zip(urls, errors))

    def _post_control(self, url: str, path: str, payload: Any, timeout_s: float) -> str | None:
        """One control request; None on success, else the error text (payloads.post_control)."""
        return post_control(url, path, payload, timeout_s=timeout_s, connect_timeout_s=self.connect_timeout_s)

    # ----------------------------------------------------------------------------- weights

    @contextlib.contextmanager
    def weight_update_session(self, selector: str = "all") -> Iterator[None]:
        """Open a weight-update session on every server for the block (SGLang 0.5.21+ refuses
        distributed and tensor updates outside one); a no-op on earlier releases and inside an open
        session. `selector`: "all", "target" or "draft" (the speculative drafter's runner); the
        updates posted inside carry it."""
        if selector not in SELECTORS:
            raise ValueError(f"weight_update_session selector must be one of {SELECTORS}, got {selector!r}")
        if self._weight_session is not None:
            if selector != self._weight_session:
                raise RolloutEngineError(f"a weight-update session with selector {self._weight_session!r} is "
                                         f"already open; cannot nest one with selector {selector!r}")
            yield
            return
        if not self.features.weight_update_session:
            yield
            return
        opened = self._post_all("/begin_weight_update", {"selector": selector}, check=False)
        failed = [f"{u}/begin_weight_update: {e}" for u, e in opened if e is not None]
        if failed and len(failed) == len(opened):
            raise EngineRequestError("; ".join(failed))
        for url, err in opened:  # one server failing leaves the sync to the others (health.py)
            if err is not None:
                self.pool.mark_down(url, f"/begin_weight_update: {err}")
        self._weight_session = selector
        try:
            yield
        finally:
            self._weight_session = None
            for url, err in self._post_all("/end_weight_update", {}, check=False):
                if err is not None:
                    logger.error("%s/end_weight_update failed: %s", url, err)

    @contextlib.contextmanager
    def _updating(self) -> Iterator[None]:
        """The session an update runs in: this engine's open one, else a new one when it opens its own."""
        if self._weight_session is not None or not self._open_weight_sessions:
            yield
        else:
            with self.weight_update_session():
                yield

    def _post_update(self, path: str, bodies: list, **kw):
        """POST update bodies, with the open session's selector on releases that have the field."""
        if self.features.update_selector and self._weight_session is not None:
            bodies = [{**b, "selector": self._weight_session} for b in bodies]
        return self._post_bodies(path, bodies, **kw)

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
        with self._updating():
            n = sw.send_tensor_buckets(
                named_tensors,
                bucket_mb=bucket_mb,
                tp_size=self.tp_size,
                num_servers=len(self.urls),
                weight_version=str(policy_version),
                post=self._post_update,
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
        with self._updating():
            self._post_update("/update_weights_from_tensor", [body] * len(self.urls))

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
        with self._updating():
            n = sw.send_distributed_buckets(
                named_tensors,
                bucket_mb=bucket_mb,
                group=self._weight_group,
                group_name=self._weight_group_name,
                num_servers=len(self.urls),
                weight_version=str(policy_version),
                post=self._post_update,
            )
        self._policy_version = policy_version
        return n

    def destroy_weights_update_group(self) -> None:
        if self._weight_group is None:
            return
        self._post_all("/destroy_weights_update_group", {"group_name": self._weight_group_name}, check=False)
        torch.distributed.destroy_process_group(self._weight_group)
        self._weight_group = self._weight_group_name = None
