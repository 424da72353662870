"""Drive one external engine (SGLang servers) from a data-parallel SPMD trainer.

Every trainer rank calls `generate`; only global rank 0 talks to the servers and the samples are
broadcast to the other ranks, so the servers see each request once. Weight updates are a collective
on the trainer side (the HF tensors are gathered over TP/PP/EP); the gathered tensors exist on their
writer ranks, and rank 0 pushes what it holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo.rollout.base import (
    PromptInput,
    RolloutEngine,
    Sample,
    SamplingParams,
    check_generate_inputs,
)


class RankZeroEngine(RolloutEngine):
    def __init__(self, engine: RolloutEngine | None, *, rank: int, world_size: int, servers: Sequence = ()):
        """servers: processes this job launched (stopped by close())."""
        if rank == 0 and engine is None:
            raise ValueError("rank 0 needs the engine it drives")
        self.engine, self.rank, self.world_size, self.servers = engine, rank, world_size, list(servers)
        self._version = engine.policy_version if engine is not None else 0

    def _bcast(self, obj):
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def generate(self, prompts: Sequence[PromptInput], sampling: SamplingParams) -> list[Sample]:
        check_generate_inputs(prompts, sampling)
        samples = self.engine.generate(prompts, sampling) if self.rank == 0 else None
        return self._bcast(samples)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None, *,
                       policy_version: int, **kwargs: Any) -> None:
        if self.rank == 0:
            self.engine.update_weights(named_tensors, policy_version=policy_version, **kwargs)
        elif named_tensors is not None:
            for _ in named_tensors:  # the gather is a collective: every rank walks it
                pass
        self._version = policy_version

    def abort(self) -> None:
        if self.rank == 0:
            self.engine.abort()

    def release_memory(self) -> None:
        if self.rank == 0:
            self.engine.release_memory()

    def resume_memory(self) -> None:
        if self.rank == 0:
            self.engine.resume_memory()

    def health(self) -> dict[str, Any]:
        return self._bcast(self.engine.health() if self.rank == 0 else None)

    @property
    def policy_version(self) -> int:
        return self._version

    def close(self) -> None:
        if self.rank == 0:
            self.engine.close()
        for server in self.servers:
            server.stop()
