"""Drive one external engine (SGLang servers) from a data-parallel SPMD trainer.

Every trainer rank calls `generate_batch`; only global rank 0 talks to the servers, and the result
reaches the other ranks as tensors over `pgs.ctrl`, a gloo group with a week-long timeout (no NCCL
watchdog fires while rank 0 waits minutes or hours on the servers). An error on rank 0 (a request that
failed after its retries, a bad reply) is broadcast too: every rank raises the same `DriverError`,
none is left waiting.

Wire format of one generation batch (B rows, world ranks in the group), from rank 0:
    broadcast to every rank:
    header          [5] int64   status (0 ok, 1 error), B, 0, meta bytes, error bytes
    response_length [B] int64
    policy_version  [B] int64
    finish          [B] int64   index into rollout.base.FINISH_REASONS
    meta            [.] uint8   JSON of the per-row engine meta (empty dicts for most engines)
    error           [.] uint8   "<type>: <message>" when status is 1
    sent to rank k only (point to point), for its rows r = k, k + world, ... (the rows it scores):
    tokens          [N_k] int32   their responses, concatenated (ragged: no padding; int32 on the wire holds
                                  any vocabulary and moves a third fewer bytes than int64 + float32)
    log_probs       [N_k] float32
Every rank returns the batch with ragged token fields (rollout/ragged.py): rank 0 every row, rank k
its own rows, so its host memory follows rows / world and their real tokens. A streaming call sends no
tokens at all: rank 0 scores every group as it completes (trainer/stages.py, `score_streamed`), so the
other ranks hold no row until `share_kept_rows` gives them the kept ones. Prompts are not sent:
every rank holds the same prompts (the sampler is deterministic), so each rank rebuilds prompt ids,
prompt lengths, sample indices and group ids itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo.rollout.base import (
    FINISH_REASONS,
    BatchGroupsDone,
    PromptInput,
    RolloutBatch,
    RolloutEngine,
    RolloutEngineError,
    Sample,
    SamplingParams,
    check_generate_inputs,
    prompt_rows,
)
from megatron_dapo.rollout.ragged import TOKEN_DTYPE, RaggedRows, to_ragged


class DriverError(RolloutEngineError):
    """The engine call on the driving rank (global rank 0) failed; every rank raises it with rank 0's message."""


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else torch.zeros(0, dtype=torch.uint8)


def _text(t: torch.Tensor) -> str:
    return bytes(t.tolist()).decode() if t.numel() else ""


def encode_batch(batch: RolloutBatch) -> dict[str, torch.Tensor]:
    """The per-row wire tensors every rank receives (rank 0's side)."""
    return {"response_length": batch.response_length.to(torch.int64),
            "policy_version": batch.policy_version.to(torch.int64),
            "finish": torch.tensor([FINISH_REASONS.index(f) for f in batch.finish_reason], dtype=torch.int64),
            "meta": _bytes_tensor(json.dumps(batch.meta) if any(batch.meta) else "")}


def rows_of(rank: int, world: int, num_rows: int) -> torch.Tensor:
    """The rows rank `rank` holds and scores: rank, rank + world, ..."""
    return torch.arange(rank, num_rows, world, dtype=torch.long)


def shard_tokens(batch: RolloutBatch, rank: int, world: int) -> dict[str, torch.Tensor]:
    """The token entries of rank `rank`'s rows (a ragged batch holding every row, rank 0's side)."""
    rows = rows_of(rank, world, len(batch))
    return {"tokens": batch.responses.index_select(rows).values.to(TOKEN_DTYPE).contiguous(),
            "log_probs": batch.rollout_log_probs.index_select(rows).values.to(torch.float32).contiguous()}


def decode_batch(wire: dict[str, torch.Tensor], prompts: Sequence[PromptInput], n: int, *, pad_id: int,
                 max_response_length: int, rank: int = 0, world: int = 1, present: bool = True) -> RolloutBatch:
    """The ragged RolloutBatch of rank `rank` from the wire tensors (its own rows' tokens, or none with
    present False) and this rank's copy of the prompts."""
    lengths = wire["response_length"]
    B = lengths.numel()
    if B != len(prompts) * n:
        raise DriverError(f"rank 0 sent {B} rows for {len(prompts)} prompts x n={n}")
    prompt_ids = prompt_rows(prompts, n, pad_id)
    prompt_length = prompt_ids.lengths.clone()
    held = torch.zeros(B, dtype=torch.bool)
    if present:
        held[rows_of(rank, world, B)] = True
    finish = [FINISH_REASONS[int(i)] for i in wire["finish"]]
    meta_text = _text(wire["meta"])
    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_length=prompt_length,
        responses=RaggedRows(wire["tokens"], lengths.clone(), held, max_response_length, pad_id),
        response_mask=None,
        rollout_log_probs=RaggedRows(wire["log_probs"], lengths.clone(), held.clone(), max_response_length, 0.0),
        response_length=lengths.clone(), sample_index=torch.arange(B, dtype=torch.int64) % n,
        policy_version=wire["policy_version"].clone(), aborted=torch.tensor([f == "abort" for f in finish]),
        finish_reason=finish, index=[p.prompt_id for p in prompts for _ in range(n)],
        meta=json.loads(meta_text) if meta_text else [{} for _ in range(B)])


_ORDER = ("response_length", "policy_version", "finish", "meta")


def broadcast_batch(batch: RolloutBatch | None, error: str | None, *, group, rank: int, prompts, n: int,
                    pad_id: int, max_response_length: int, shard: bool = True) -> RolloutBatch:
    """Rank 0 passes its batch (or the error text), every other rank None; all return their ragged batch
    (module docstring) or raise the same DriverError. shard False: no tokens leave rank 0 (the other ranks'
    batches hold no row)."""
    src = dist.get_global_rank(group, 0)
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if rank == src:
        batch = to_ragged(batch, pad_id=pad_id) if error is None else None
        wire = encode_batch(batch) if error is None else {}
        err = _bytes_tensor(error or "")
        header = torch.tensor([int(error is not None), len(batch) if error is None else 0, 0,
                               int(wire["meta"].numel()) if error is None else 0, err.numel()], dtype=torch.int64)
    else:
        header = torch.zeros(5, dtype=torch.int64)
    dist.broadcast(header, src=src, group=group)
    status, B, _, meta_n, err_n = (int(x) for x in header)
    if status:
        if rank != src:
            err = torch.zeros(err_n, dtype=torch.uint8)
        if err_n:
            dist.broadcast(err, src=src, group=group)
        raise DriverError(f"rollout on rank 0 failed: {_text(err)}")
    if rank != src:
        shapes = {"response_length": (B, torch.int64), "policy_version": (B, torch.int64),
                  "finish": (B, torch.int64), "meta": (meta_n, torch.uint8)}
        wire = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in shapes.items()}
    for key in _ORDER:
        if wire[key].numel():
            dist.broadcast(wire[key], src=src, group=group)
    if rank == src:  # every rank's rows at once: the sends to different ranks overlap
        sends = [dist.isend(t, dst=dist.get_global_rank(group, k), group=group)
                 for k in range(1, world) if shard for t in shard_tokens(batch, k, world).values() if t.numel()]
        for work in sends:
            work.wait()
        return batch
    if not shard:
        wire["tokens"], wire["log_probs"] = torch.zeros(0, dtype=TOKEN_DTYPE), torch.zeros(0, dtype=torch.float32)
        return decode_batch(wire, prompts, n, pad_id=pad_id, max_response_length=max_response_length, rank=me,
                            world=world, present=False)
    n_mine = int(wire["response_length"][rows_of(me, world, B)].sum())
    wire["tokens"] = torch.empty(n_mine, dtype=TOKEN_DTYPE)
    wire["log_probs"] = torch.empty(n_mine, dtype=torch.float32)
    for key in ("tokens", "log_probs"):
        if n_mine:
            dist.recv(wire[key], src=src, group=group)
    return decode_batch(wire, prompts, n, pad_id=pad_id, max_response_length=max_response_length, rank=me,
                        world=world)


class RankZeroEngine(RolloutEngine):
    def __init__(self, engine: RolloutEngine | None, *, rank: int, world_size: int, group=None,
                 servers: Sequence = ()):
        """engine: the engine rank 0 drives (None elsewhere). group: the gloo control group the results
        travel on (`pgs.ctrl`; None only for a world of one). servers: processes this job launched
        (stopped by close())."""
        if rank == 0 and engine is None:
            raise ValueError("rank 0 needs the engine it drives")
        if world_size > 1 and group is None:
            raise ValueError("RankZeroEngine needs the control group (pgs.ctrl) when world_size > 1")
        self.engine, self.rank, self.world_size, self.group = engine, rank, world_size, group
        self.servers = list(servers)
        self._version = engine.policy_version if engine is not None else 0
        self._released: set[str] = set()

    def _bcast(self, obj):
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def _on_rank0(self, fn):
        """fn() on rank 0; its result (small, picklable) or its error reaches every rank."""
        result, error = None, None
        if self.rank == 0:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                error = f"{type(e).__name__}: {e}"
                if self.world_size == 1:
                    raise
        result, error = self._bcast((result, error))
        if error is not None:
            raise DriverError(f"rollout on rank 0 failed: {error}")
        return result

    def generate_batch(self, prompts: Sequence[PromptInput], sampling: SamplingParams, *, pad_id: int,
                       max_response_length: int) -> RolloutBatch:
        return self._batch_from_rank0(
            lambda: self.engine.generate_batch(prompts, sampling, pad_id=pad_id, max_response_length=max_response_length),
            prompts, sampling, pad_id=pad_id, max_response_length=max_response_length)

    def generate_batch_streaming(self, prompts: Sequence[PromptInput], sampling: SamplingParams, *, pad_id: int,
                                 max_response_length: int, on_groups_done: BatchGroupsDone) -> RolloutBatch:
        """The driven engine's streaming call; `on_groups_done` runs on rank 0 only (the stop is decided
        once, and the groups are scored there), the other ranks receive the batch it produced without its
        tokens (module docstring)."""
        return self._batch_from_rank0(
            lambda: self.engine.generate_batch_streaming(prompts, sampling, pad_id=pad_id,
                                                         max_response_length=max_response_length,
                                                         on_groups_done=on_groups_done),
            prompts, sampling, pad_id=pad_id, max_response_length=max_response_length, shard=False)

    @property
    def supports_streaming(self) -> bool:  # known on rank 0 only; the config check is per rollout.engine
        return self.engine is not None and self.engine.supports_streaming

    def _batch_from_rank0(self, call, prompts, sampling: SamplingParams, *, pad_id: int,
                          max_response_length: int, shard: bool = True) -> RolloutBatch:
        check_generate_inputs(prompts, sampling)
        batch, error = None, None
        if self.rank == 0:
            try:
                batch = call()
            except Exception as e:  # noqa: BLE001 - every rank raises the same DriverError
                if self.world_size == 1:
                    raise
                error = f"{type(e).__name__}: {e}"
                try:
                    broadcast_batch(None, error, group=self.group, rank=0, prompts=prompts, n=sampling.n,
                                    pad_id=pad_id, max_response_length=max_response_length)
                except DriverError as d:
                    raise d from e
        if self.world_size == 1:
            return batch
        return broadcast_batch(batch, None, group=self.group, rank=self.rank, prompts=prompts, n=sampling.n,
                               pad_id=pad_id, max_response_length=max_response_length, shard=shard)

    def generate(self, prompts: Sequence[PromptInput], sampling: SamplingParams) -> list[Sample]:
        """Python samples on every rank (small calls only: the trainer uses generate_batch)."""
        check_generate_inputs(prompts, sampling)
        return self._on_rank0(lambda: self.engine.generate(prompts, sampling))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None, *,
                       policy_version: int, **kwargs: Any) -> None:
        """Rank 0 forwards to its engine (named_tensors must then hold rank 0's tensors only: use the
        trainer's weight sync for a model spread over ranks); every rank records the version."""
        if self.rank != 0 and named_tensors is not None:
            for _ in named_tensors:  # a generator that gathers is a collective: every rank walks it
                pass
        self._on_rank0(lambda: self.engine.update_weights(named_tensors, policy_version=policy_version, **kwargs))
        self._version = policy_version

    def abort(self) -> None:
        if self.rank == 0:
            self.engine.abort()

    MEMORY_TAGS = ("weights", "kv_cache")

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free the servers' weights and / or KV cache (colocated training); every rank records it."""
        tags = tuple(tags or self.MEMORY_TAGS)
        todo = [t for t in tags if t not in self._released]
        if todo:
            self._on_rank0(lambda: self.engine.release_memory(todo))
            self._released.update(todo)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Re-take what release_memory freed (tags not released are skipped: resuming twice is an error
        on SGLang)."""
        tags = tuple(tags or self.MEMORY_TAGS)
        todo = [t for t in tags if t in self._released]
        if todo:
            self._on_rank0(lambda: self.engine.resume_memory(todo))
            self._released.difference_update(todo)

    @property
    def released(self) -> frozenset[str]:
        return frozenset(self._released)

    def health(self) -> dict[str, Any]:
        return self._on_rank0(lambda: self.engine.health())

    @property
    def policy_version(self) -> int:
        return self._version

    def close(self) -> None:
        if self.rank == 0:
            self.engine.close()
        if self.servers:
            from megatron_dapo.rollout.sglang.server import stop_servers

            stop_servers(self.servers)


__all__ = ["DriverError", "RankZeroEngine", "broadcast_batch", "decode_batch", "encode_batch", "rows_of"]
