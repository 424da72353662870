"""A pool of rollout engines on Ray: least-outstanding dispatch, restarts, exactly-once answers.

`EnginePool` is itself a `RolloutEngine` (rollout/base.py), so the trainer drives N engines the way
it drives one. Each engine lives in its own Ray actor (`EngineActor`), built inside the actor by a
picklable factory (`LocalEngineFactory` for the local Megatron engine, or any callable that returns
a RolloutEngine, e.g. one that starts an SGLang server).

How a generate call runs:
1. Validation, before any work: `check_generate_inputs`, then every prompt against the engines'
   limits (vocabulary, prompt + max_new_tokens <= max_sequence_length), which the actors report
   when they start. A bad prompt raises a ValueError naming it; nothing is dispatched.
2. The prompts are cut into requests of `prompts_per_request` prompts (request r answers rows
   r*k*n .. (r+1)*k*n - 1 of the contract's prompt-major order).
3. Dispatch: while requests are queued, each goes to the live engine with the fewest outstanding
   requests (`pick_engine`; ties to the lowest index), at most `max_inflight_per_engine` per
   engine, so a faster engine takes more of the work. `ray.wait` returns one reply at a time.
4. A reply is checked (`check_generate_output` on its request) and stored under its request id;
   a request id is answered once: its ObjectRef leaves the in-flight table before it is read, and
   the refs of a dead engine are dropped before they could ever be read.
5. An engine whose actor died (RayActorError) is restarted in the same place, up to
   `max_restarts` times; the new actor replays the latest weights (every weight bucket still
   current, in order) and the policy version before it takes requests. Its unfinished requests go
   back to the front of the queue for the live engines. Samples are seeded per sample
   (`derive_sample_seed`), so which engine answers does not change a sample.
6. An engine that raised (RayTaskError: a bad request, a bug) fails the whole call: the engines
   are aborted and the error is re-raised as RolloutEngineError naming the engine and request.

Weights: `update_weights(named_tensors, policy_version=v)` moves the tensors to CPU, `ray.put`s
them once and sends the one ObjectRef to every engine. The pool keeps the refs of every bucket
that still holds a current tensor (a later bucket with the same names supersedes it), i.e. one
CPU copy of the model in Ray's object store, which a restarted engine replays.

Placement: on GPU one placement-group bundle per engine ({"GPU": num_gpus_per_engine, "CPU":
num_cpus_per_engine}, PACK); a restarted engine takes the bundle of the one it replaces. On CPU
the actors only ask for `num_cpus_per_engine` (fractional is fine).

Ray itself: the pool calls `ray.init` only when Ray is not initialised yet; without an address it
starts a local instance that advertises 127.0.0.1, with no dashboard and usage stats off. Ray
2.60's own gRPC servers (GCS, raylet, workers) still listen on every interface whatever the node
address (measured); Ray's token authentication, on by default in 2.60, is what guards them.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from megatron_dapo.rollout.base import (
    PromptInput,
    RolloutEngine,
    RolloutEngineError,
    Sample,
    SamplingParams,
    check_generate_inputs,
    check_generate_output,
)

__all__ = ["EnginePool", "EngineActor", "LocalEngineFactory", "PoolStats", "pick_engine"]

log = logging.getLogger(__name__)

EngineFactory = Callable[[], RolloutEngine]


# ------------------------------------------------------------------------------- pure pieces


def pick_engine(outstanding: Sequence[int], available: Sequence[bool], *, max_inflight: int) -> int | None:
    """The available engine with the fewest outstanding requests (lowest index on ties), or None
    when every available engine already holds `max_inflight` requests (or none is available)."""
    best = None
    for i, (n, ok) in enumerate(zip(outstanding, available, strict=True)):
        if ok and n < max_inflight and (best is None or n < outstanding[best]):
            best = i
    return best


@dataclass(frozen=True)
class PoolStats:
    """Counters since the pool started (a snapshot)."""

    requests_sent: int
    """Dispatches, resubmissions included."""
    requests_answered: tuple[int, ...]
    """Replies accepted per engine slot."""
    resubmitted: int
    """Requests sent again because their engine died."""
    restarts: tuple[int, ...]
    """Restarts per engine slot."""
    dead: tuple[bool, ...]
    """Slots whose engine died after max_restarts and is gone for good."""


# --------------------------------------------------------------------------------- the actor


class EngineActor:
    """One engine inside a Ray actor (the pool wraps it with `ray.remote`).

    The actor is threaded (max_concurrency > 1) so that abort() and health() reach an engine that
    is generating; engines serialise their own generate calls (LocalEngine holds a lock).
    """

    def __init__(self, factory: EngineFactory):
        engine = factory()
        if not isinstance(engine, RolloutEngine):
            raise TypeError(f"engine factory {factory!r} returned {type(engine).__name__}, not a RolloutEngine")
        self.engine = engine

    def limits(self) -> dict[str, Any]:
        """What the pool checks prompts against before dispatch (None: the engine does not say)."""
        return {"max_sequence_length": getattr(self.engine, "max_sequence_length", None),
                "vocab_size": getattr(self.engine, "vocab_size", None), "pid": os.getpid(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def generate(self, request_id: str, prompts: list[PromptInput], sampling: SamplingParams):
        return request_id, self.engine.generate(prompts, sampling)

    def update_weights(self, named_tensors, policy_version: int, kwargs: dict[str, Any]) -> int:
        self.engine.update_weights(named_tensors, policy_version=policy_version, **kwargs)
        return self.engine.policy_version

    def replay(self, bucket_refs: list, policy_version: int, release_memory: bool) -> dict[str, Any]:
        """Bring a fresh engine to the pool's state: every current bucket in order, then the version."""
        for ref in bucket_refs:
            self.engine.update_weights(ray.get(ref), policy_version=self.engine.policy_version)
        self.engine.update_weights(None, policy_version=policy_version)
        if release_memory:
            self.engine.release_memory()
        return self.limits()

    def abort(self) -> None:
        self.engine.abort()

    def health(self) -> dict[str, Any]:
        return self.engine.health()

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    def close(self) -> None:
        self.engine.close()


_RemoteEngineActor = ray.remote(EngineActor)


@dataclass(frozen=True)
class LocalEngineFactory:
    """Builds a LocalEngine on its own freshly built Megatron model, inside the engine's process.

    arch: the model (models.arch.ModelArch, e.g. models.config_arch.model_arch(cfg, vocab_size=V)).
    seed: initial weights (engines with the same seed start identical; update_weights replaces
    them anyway). The process gets a world of one (parallel.init_parallel()).
    """

    arch: Any
    seed: int
    eos_token_id: int | None
    pad_token_id: int
    params_dtype: str = "fp32"
    max_batch_size: int = 64

    def __call__(self) -> RolloutEngine:
        from megatron_dapo.models.builder import build_gpt_model
        from megatron_dapo.parallel import init_parallel
        from megatron_dapo.rollout.local_engine import LocalEngine

        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
        if self.params_dtype not in dtypes:
            raise ValueError(f"LocalEngineFactory.params_dtype must be one of {sorted(dtypes)}, "
                             f"got {self.params_dtype!r}")
        pgs = init_parallel()
        model = build_gpt_model(self.arch, pgs=pgs, seed=self.seed, params_dtype=dtypes[self.params_dtype])
        return LocalEngine(model, pgs=pgs, eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
                           max_batch_size=self.max_batch_size)


# ---------------------------------------------------------------------------------- the pool


@dataclass
class _Slot:
    """One engine position in the pool; its actor is replaced on restart."""

    handle: Any
    restarts: int = 0
    warming: Any = None
    """ObjectRef of the replay of a restarted actor; the slot takes requests once it resolves."""
    dead: bool = False


class EnginePool(RolloutEngine):
    """N engines in Ray actors behind the RolloutEngine contract (module docstring).

    engine_factories: one picklable factory per engine, or a single factory with `num_engines`.
    use_gpu: one placement-group bundle per engine with `num_gpus_per_engine` GPUs.
    max_restarts: restarts per engine slot before it is given up (the pool goes on without it).
    prompts_per_request / max_inflight_per_engine: request size and per-engine queue depth.
    ray_address: passed to ray.init when Ray is not initialised (None: a local instance).
    """

    def __init__(self, engine_factories: Sequence[EngineFactory] | EngineFactory, *, num_engines: int | None = None,
                 use_gpu: bool = False, num_gpus_per_engine: float = 1, num_cpus_per_engine: float = 1,
                 max_restarts: int = 3, prompts_per_request: int = 1, max_inflight_per_engine: int = 4,
                 policy_version: int = 0, ray_address: str | None = None, start_timeout_s: float = 600.0):
        self._factories = _factory_list(engine_factories, num_engines)
        _check_int(max_restarts, "max_restarts", 0)
        _check_int(prompts_per_request, "prompts_per_request", 1)
        _check_int(max_inflight_per_engine, "max_inflight_per_engine", 1)
        _check_int(policy_version, "policy_version", 0)
        for name, value in (("num_gpus_per_engine", num_gpus_per_engine), ("num_cpus_per_engine", num_cpus_per_engine)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"EnginePool {name} must be a number >= 0, got {value!r}")
        if use_gpu and not num_gpus_per_engine > 0:
            raise ValueError(f"EnginePool use_gpu=True needs num_gpus_per_engine > 0, got {num_gpus_per_engine!r}")
        self.max_restarts, self.prompts_per_request = max_restarts, prompts_per_request
        self.max_inflight_per_engine = max_inflight_per_engine
        self._policy_version = policy_version
        self._start_timeout_s = start_timeout_s
        _ensure_ray(ray_address)
        self._placement_group = None
        bundle = {"CPU": num_cpus_per_engine}
        if use_gpu:
            bundle["GPU"] = num_gpus_per_engine
            self._placement_group = _reserve_bundles(bundle, len(self._factories), start_timeout_s)
        self._bundle = bundle
        self._weights: list[tuple[Any, set[str]]] = []  # (ObjectRef of a bucket, its still-current names)
        self._memory_released = False
        self._lock = threading.Lock()  # one generate / control fan-out at a time
        self._abort_event = threading.Event()
        self._closed = False
        self._sent = self._resubmitted = 0
        self._answered = [0] * len(self._factories)
        self._outstanding = [0] * len(self._factories)  # requests in flight per engine (during generate)
        self._slots = [_Slot(self._spawn(i)) for i in range(len(self._factories))]
        try:
            infos = ray.get([s.handle.limits.remote() for s in self._slots], timeout=start_timeout_s)
        except Exception as e:
            self.close()
            raise RolloutEngineError(f"EnginePool: an engine failed to start: {_cause(e)}") from e
        self._limits = infos  # per engine: limits(), refreshed when a restarted engine is ready

    # ----------------------------------------------------------------------------- contract

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def num_engines(self) -> int:
        return len(self._slots)

    def actor(self, index: int):
        """The Ray actor handle of engine `index` (for operations and fault-injection tests)."""
        return self._slots[index].handle

    @property
    def stats(self) -> PoolStats:
        return PoolStats(requests_sent=self._sent, requests_answered=tuple(self._answered),
                         resubmitted=self._resubmitted,
                         restarts=tuple(s.restarts for s in self._slots), dead=tuple(s.dead for s in self._slots))

    def outstanding(self) -> list[int]:
        """Requests in flight per engine (for monitoring; changes while generate runs)."""
        return list(self._outstanding)

    def wait_ready(self) -> None:
        """Block until every restarting engine has replayed the weights (or is gone for good)."""
        with self._lock:
            self._settle_warming()

    def generate(self, prompts: Sequence[PromptInput], sampling: SamplingParams) -> list[Sample]:
        check_generate_inputs(prompts, sampling)
        if self._closed:
            raise RolloutEngineError("EnginePool is closed")
        if self._memory_released:
            raise RolloutEngineError("EnginePool.generate after release_memory(); call resume_memory() first")
        prompts = list(prompts)
        self._check_prompts(prompts, sampling)
        if not prompts:
            return []
        k = self.prompts_per_request
        requests = [prompts[i:i + k] for i in range(0, len(prompts), k)]
        with self._lock:
            answers = self._run(requests, sampling, self._abort_event)
        out = [s for r in range(len(requests)) for s in answers[r]]
        check_generate_output(prompts, sampling, out)
        return out

    def _check_prompts(self, prompts: list[PromptInput], sampling: SamplingParams) -> None:
        max_len = min((x["max_sequence_length"] for x in self._limits if x["max_sequence_length"] is not None),
                      default=None)
        vocab = min((x["vocab_size"] for x in self._limits if x["vocab_size"] is not None), default=None)
        for p in prompts:
            if vocab is not None and max(p.token_ids) >= vocab:
                raise ValueError(f"prompt {p.prompt_id!r}: token id {max(p.token_ids)} is outside the engines' "
                                 f"vocabulary [0, {vocab})")
            total = len(p.token_ids) + sampling.max_new_tokens
            if max_len is not None and total > max_len:
                raise ValueError(f"prompt {p.prompt_id!r}: {len(p.token_ids)} prompt tokens + max_new_tokens="
                                 f"{sampling.max_new_tokens} = {total} > the engines' max_sequence_length={max_len}")

    def _run(self, requests: list[list[PromptInput]], sampling: SamplingParams, aborted: threading.Event) -> dict:
        """The dispatch loop (module docstring, steps 3-6); returns {request index: samples}."""
        call = uuid.uuid4().hex[:8]
        queue = deque(range(len(requests)))
        answers: dict[int, list[Sample]] = {}
        inflight: dict[Any, tuple[int, int]] = {}  # ObjectRef -> (request index, engine index)
        self._outstanding = [0] * len(self._slots)
        try:
            while len(answers) < len(requests):
                if aborted.is_set():  # nothing new goes out; what is queued comes back as "abort"
                    for r in queue:
                        answers[r] = self._abort_samples(requests[r], sampling)
                    queue.clear()
                self._dispatch(queue, requests, sampling, inflight, call)
                warming = {s.warming: i for i, s in enumerate(self._slots) if s.warming is not None}
                if not inflight and not warming:  # requests left, and no engine to run them
                    raise RolloutEngineError(self._no_engines_message())
                ready, _ = ray.wait(list(inflight) + list(warming), num_returns=1)
                ref = ready[0]
                if ref in warming:
                    self._finish_warming(warming[ref])
                    continue
                r, e = inflight.pop(ref)
                self._outstanding[e] -= 1
                try:
                    rid, samples = ray.get(ref)
                except RayActorError as err:
                    self._engine_died(e, err, queue, inflight, aborted, requests, sampling, answers, first=r)
                    continue
                except RayTaskError as err:
                    self._abort_engines()
                    raise RolloutEngineError(f"engine {e} failed request {r} (prompts "
                                             f"{[p.prompt_id for p in requests[r]]}): {_cause(err)}") from err
                if rid != f"{call}:{r}":
                    raise RolloutEngineError(f"engine {e} answered request {rid!r} for {call}:{r}")
                if r in answers:  # cannot happen: a request is in flight at most once
                    raise RolloutEngineError(f"request {r} answered twice (engine {e})")
                check_generate_output(requests[r], sampling, samples)
                answers[r] = samples
                self._answered[e] += 1
        finally:
            self._outstanding = [0] * len(self._slots)
        return answers

    def _dispatch(self, queue: deque, requests: list[list[PromptInput]], sampling: SamplingParams,
                  inflight: dict, call: str) -> None:
        available = [not s.dead and s.warming is None for s in self._slots]
        while queue:
            e = pick_engine(self._outstanding, available, max_inflight=self.max_inflight_per_engine)
            if e is None:
                return
            r = queue.popleft()
            ref = self._slots[e].handle.generate.remote(f"{call}:{r}", requests[r], sampling)
            inflight[ref] = (r, e)
            self._outstanding[e] += 1
            self._sent += 1

    def _engine_died(self, e: int, err: Exception, queue: deque, inflight: dict, aborted: threading.Event,
                     requests: list[list[PromptInput]], sampling: SamplingParams, answers: dict, *, first: int) -> None:
        """Drop every ref of engine e (a late reply can never be read), requeue its requests at the
        front in their original order (or answer them "abort" after an abort), restart the engine."""
        lost = [first]
        for ref, (r, owner) in list(inflight.items()):
            if owner == e:
                del inflight[ref]
                lost.append(r)
        self._outstanding[e] = 0
        log.warning("EnginePool: engine %d died (%s) holding %d request(s)", e, type(err).__name__, len(lost))
        for r in sorted(lost, reverse=True):
            if aborted.is_set():
                answers[r] = self._abort_samples(requests[r], sampling)
            else:
                queue.appendleft(r)
                self._resubmitted += 1
        self._restart(e, err)

    def _restart(self, e: int, err: Exception) -> None:
        slot = self._slots[e]
        slot.warming = None
        _kill(slot.handle)
        if slot.restarts >= self.max_restarts:
            slot.dead = True
            log.error("EnginePool: engine %d is gone after %d restart(s): %s", e, slot.restarts, err)
            return
        slot.restarts += 1
        slot.handle = self._spawn(e)
        slot.warming = slot.handle.replay.remote([ref for ref, _ in self._weights], self._policy_version,
                                                 self._memory_released)

    def _finish_warming(self, e: int) -> None:
        slot = self._slots[e]
        ref, slot.warming = slot.warming, None
        try:
            self._limits[e] = ray.get(ref)
        except (RayActorError, RayTaskError) as err:  # died again, or the factory / replay raised
            self._restart(e, err)

    def _settle_warming(self) -> None:
        """Block until every restarting engine is ready (or gone): control calls keep their order."""
        while any(s.warming is not None for s in self._slots):
            e = next(i for i, s in enumerate(self._slots) if s.warming is not None)
            ray.wait([self._slots[e].warming], num_returns=1)
            self._finish_warming(e)

    def _no_engines_message(self) -> str:
        return (f"EnginePool: no engine left ({len(self._slots)} engines, each restarted up to "
                f"max_restarts={self.max_restarts} times); restarts per engine: {[s.restarts for s in self._slots]}")

    def _abort_samples(self, prompts: list[PromptInput], sampling: SamplingParams) -> list[Sample]:
        return [Sample(prompt_id=p.prompt_id, sample_index=j, prompt_token_ids=p.token_ids, response_token_ids=(),
                       rollout_log_probs=(), finish_reason="abort", policy_version=self._policy_version)
                for p in prompts for j in range(sampling.n)]

    def _spawn(self, index: int):
        options: dict[str, Any] = {"num_cpus": self._bundle["CPU"], "max_restarts": 0,
                                   "max_concurrency": self.max_inflight_per_engine + 2}
        if self._placement_group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["num_gpus"] = self._bundle["GPU"]
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self._placement_group, placement_group_bundle_index=index)
        return _RemoteEngineActor.options(**options).remote(self._factories[index])

    # ------------------------------------------------------------------------------ control

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None, *,
                       policy_version: int, **kwargs: Any) -> None:
        """Broadcast one bucket (or only the version, for None) to every engine; see the docstring."""
        if isinstance(policy_version, bool) or not isinstance(policy_version, int) \
                or policy_version < self._policy_version:
            raise ValueError(f"policy_version must be an int >= {self._policy_version} (current), "
                             f"got {policy_version!r}")
        with self._lock:
            self._settle_warming()
            ref, names = None, set()
            if named_tensors is not None:
                bucket = _cpu_bucket(named_tensors)
                ref, names = ray.put(bucket), {n for n, _ in bucket}
            replies = [(e, s.handle.update_weights.remote(ref, policy_version, kwargs))
                       for e, s in enumerate(self._slots) if not s.dead]
            errors = []
            for e, reply in replies:
                try:
                    ray.get(reply)
                except RayActorError:  # restarted below with the new bucket in its replay
                    errors.append((e, None))
                except RayTaskError as err:
                    errors.append((e, err))
            rejected = [(e, err) for e, err in errors if err is not None]
            if rejected:
                e, err = rejected[0]
                raise RolloutEngineError(f"engine {e} rejected update_weights(policy_version={policy_version}): "
                                         f"{_cause(err)}") from err
            if ref is not None:
                for _, live in self._weights:
                    live -= names
                self._weights = [(r, live) for r, live in self._weights if live] + [(ref, names)]
            self._policy_version = policy_version
            for e, _ in errors:
                self._restart(e, RolloutEngineError("died during update_weights"))

    def abort(self) -> None:
        """Generate calls in flight stop dispatching; engines abort their requests ("abort" samples)."""
        old, self._abort_event = self._abort_event, threading.Event()
        old.set()
        self._abort_engines()

    def _abort_engines(self) -> None:
        self._fan_out("abort", check=False)

    def release_memory(self) -> None:
        with self._lock:
            self._settle_warming()
            self._fan_out("release_memory")
            self._memory_released = True

    def resume_memory(self) -> None:
        with self._lock:
            self._settle_warming()
            self._fan_out("resume_memory")
            self._memory_released = False

    def health(self) -> dict[str, Any]:
        engines = []
        for e, s in enumerate(self._slots):
            entry: dict[str, Any] = {"index": e, "restarts": s.restarts, "dead": s.dead,
                                     "warming": s.warming is not None, "pid": self._limits[e]["pid"],
                                     "gpu_ids": self._limits[e]["gpu_ids"], "healthy": False}
            if not s.dead and s.warming is None:
                try:
                    entry.update(ray.get(s.handle.health.remote(), timeout=60))
                except Exception as err:  # a dead or hung actor is reported, not raised
                    entry["error"] = f"{type(err).__name__}: {err}"
            engines.append(entry)
        return {"healthy": all(x["healthy"] for x in engines), "policy_version": self._policy_version,
                "engines": engines}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        slots = getattr(self, "_slots", [])
        self._fan_out("close", check=False)
        for s in slots:
            _kill(s.handle)
        if self._placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement_group)

    def _fan_out(self, method: str, *, check: bool = True) -> None:
        slots = [(e, s) for e, s in enumerate(getattr(self, "_slots", [])) if not s.dead]
        replies = [(e, getattr(s.handle, method).remote()) for e, s in slots]
        for e, reply in replies:
            try:
                ray.get(reply, timeout=60)
            except Exception as err:
                if check and not isinstance(err, RayActorError):
                    raise RolloutEngineError(f"engine {e}.{method}() failed: {_cause(err)}") from err


# ---------------------------------------------------------------------------------- helpers


def _factory_list(factories, num_engines: int | None) -> list[EngineFactory]:
    if callable(factories):
        if num_engines is None:
            raise ValueError("EnginePool: one factory needs num_engines (how many engines to build)")
        _check_int(num_engines, "num_engines", 1)
        return [factories] * num_engines
    factories = list(factories)
    if num_engines is not None and num_engines != len(factories):
        raise ValueError(f"EnginePool: num_engines={num_engines} but {len(factories)} factories were given")
    if not factories:
        raise ValueError("EnginePool: engine_factories is empty")
    for i, f in enumerate(factories):
        if not callable(f):
            raise TypeError(f"EnginePool: engine_factories[{i}] is a {type(f).__name__}, not a callable")
    return factories


def _ensure_ray(address: str | None) -> None:
    if ray.is_initialized():
        return
    if address is None or address == "local":
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no reports from a local instance
        ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1")
    else:
        ray.init(address=address, include_dashboard=False)


def _reserve_bundles(bundle: dict[str, float], count: int, timeout_s: float):
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([dict(bundle) for _ in range(count)], strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise RolloutEngineError(f"EnginePool: could not place {count} engines of {bundle} within {timeout_s} s; "
                                 f"the cluster has {ray.cluster_resources()}")
    return pg


def _cpu_bucket(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Validate a bucket and copy it to CPU (engines live in other processes, maybe other nodes)."""
    bucket, seen = [], set()
    for i, item in enumerate(named_tensors):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"update_weights: named_tensors[{i}] must be a (name, tensor) pair, "
                            f"got {type(item).__name__}")
        name, t = item
        if not torch.is_tensor(t):
            raise TypeError(f"update_weights: {name!r} is a {type(t).__name__}, expected a torch.Tensor")
        if name in seen:
            raise ValueError(f"update_weights: {name!r} appears twice in one bucket")
        seen.add(name)
        bucket.append((name, t.detach().to("cpu")))
    return bucket


def _cause(err: Exception) -> str:
    """The engine's own exception as "Type: message" (a RayTaskError's text is the whole remote traceback)."""
    cause = getattr(err, "cause", None) or err
    return f"{type(cause).__name__}: {cause}"


def _kill(handle) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # already gone
        pass


def _check_int(value: Any, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"EnginePool {name} must be an int >= {minimum}, got {value!r}")

