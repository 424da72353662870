"""Versioned weight sync from the actor to rollout engines, in size-bounded buckets.

    syncer = WeightSyncer(policy_version=0)
    stats = syncer.sync(actor.policy.chunks, [engine], policy_version=step, bucket_mb=cfg.rollout.weight_sync_bucket_mb)

What a sync does:
1. Checks, before any tensor moves: the version is an int strictly above the last synced one (two
   weight sets never share a label) and not below any engine's current version; bucket_mb > 0.
2. Walks the unwrapped GPTModel's parameters, then its buffers (`named_weights`), by the names
   LocalEngine.update_weights takes, and groups them into buckets of at most `bucket_mb` MiB
   (a larger tensor travels alone; rollout/sglang/weights.bucket_named_tensors).
3. Sends every bucket to every engine. All buckets but the last go out under the engine's
   current version and the last one under the new version, so an engine reports the new version
   only once all of its weights have landed. An EnginePool moves each bucket to CPU and puts it in
   Ray's object store once for all its engines (engines in other processes get CPU tensors).
4. Reads every engine's `policy_version` back: it must be the new version.

Tensors are this rank's shards (tensor parallelism): an engine must have the actor's TP layout
(LocalEngine on the same ranks does; it rejects a shape mismatch by name). Pipeline stages are not
synced from here: pass one model chunk (the local engine has no pipeline parallelism either).
SGLang engines take HF names; convert the names before syncing to them (models/hf).

Shape legend: tensors keep their own shapes; bucket sizes count numel * element_size bytes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from megatron_dapo.models.forward import unwrap_model
from megatron_dapo.rollout.base import RolloutEngine, RolloutEngineError
from megatron_dapo.rollout.sglang.weights import buckets_with_last, tensor_nbytes

__all__ = ["named_weights", "SyncStats", "WeightSyncer", "sync_weights"]


def named_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the unwrapped model's parameters, then its buffers, detached, on their
    device. `model` is a GPTModel, a wrapped one (DDP / Float16Module), or a list of ONE chunk."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError(f"weight sync takes one model chunk, got {len(model)} (pipeline / virtual pipeline "
                             "stages are not synced from here; the local engine does not support them)")
        model = model[0]
    inner = unwrap_model(model)
    if not isinstance(inner, torch.nn.Module):
        raise TypeError(f"weight sync needs a torch module, got {type(inner).__name__}")
    for name, p in inner.named_parameters():
        yield name, p.detach()
    for name, b in inner.named_buffers():
        yield name, b.detach()


@dataclass(frozen=True)
class SyncStats:
    """What one sync moved (for the timing / throughput metrics)."""

    policy_version: int
    num_buckets: int
    num_tensors: int
    num_bytes: int
    """Bytes per engine (the sum over the model's tensors)."""
    seconds: float


class WeightSyncer:
    """Remembers the last synced version and refuses anything that is not strictly newer."""

    def __init__(self, *, policy_version: int = 0):
        _check_version(policy_version, "policy_version", minimum=0)
        self.policy_version = policy_version

    def sync(self, model, engines: Sequence[RolloutEngine], *, policy_version: int, bucket_mb: float) -> SyncStats:
        """Push `model`'s weights to every engine under `policy_version` (module docstring)."""
        _check_version(policy_version, "policy_version", minimum=self.policy_version + 1,
                       why=f" (the last synced version is {self.policy_version}; versions must increase)")
        stats = sync_weights(model, engines, policy_version=policy_version, bucket_mb=bucket_mb)
        self.policy_version = policy_version
        return stats


def sync_weights(model, engines: Sequence[RolloutEngine], *, policy_version: int, bucket_mb: float) -> SyncStats:
    """One sync without version memory (WeightSyncer adds the strictly-increasing check)."""
    engines = list(engines)
    if not engines:
        raise ValueError("sync_weights: engines is empty")
    for i, e in enumerate(engines):
        if not isinstance(e, RolloutEngine):
            raise TypeError(f"sync_weights: engines[{i}] is a {type(e).__name__}, not a RolloutEngine")
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
        raise ValueError(f"sync_weights: bucket_mb must be a number > 0, got {bucket_mb!r}")
    _check_version(policy_version, "policy_version", minimum=0)
    previous = [e.policy_version for e in engines]
    for i, v in enumerate(previous):
        if v > policy_version:
            raise ValueError(f"sync_weights: engines[{i}] is at policy_version {v}, ahead of the sync's "
                             f"policy_version={policy_version}")
    start = time.perf_counter()
    num_buckets = num_tensors = num_bytes = 0
    for bucket, last in buckets_with_last(named_weights(model), bucket_mb=bucket_mb):
        for e, prev in zip(engines, previous, strict=True):
            e.update_weights(bucket, policy_version=policy_version if last else prev, bucket_mb=bucket_mb)
        num_buckets += 1
        num_tensors += len(bucket)
        num_bytes += sum(tensor_nbytes(t) for _, t in bucket)
    if num_buckets == 0:
        raise ValueError("sync_weights: the model has no parameters or buffers")
    for i, e in enumerate(engines):
        if e.policy_version != policy_version:
            raise RolloutEngineError(f"sync_weights: engines[{i}] reports policy_version {e.policy_version} "
                                     f"after syncing version {policy_version}")
    return SyncStats(policy_version=policy_version, num_buckets=num_buckets, num_tensors=num_tensors,
                     num_bytes=num_bytes, seconds=time.perf_counter() - start)


def _check_version(value, name: str, *, minimum: int, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{why}, got {value!r}")
