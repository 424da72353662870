"""The record the actor's update consumes (STYLE.md rule 10): defined by the workers, built by the trainer.

Shape legend:
    B  rows = responses (prompt-major: the n responses of a prompt are contiguous)
    P  longest prompt in the batch (right-padded)
    T  response width (max_response_length, right-padded)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PolicyBatch:
    """What the actor update consumes. All [B, T] tensors are zero on padding. The token ids may be ragged
    rows (rollout/ragged.py `RaggedRows`: `shape`, `take`, `index_select`), as the trainer's training batch
    holds them: the micro-batch builder reads them in place (workers/microbatch.py)."""

    prompt_ids: Tensor  # [B, P] int64, or ragged rows (below)
    prompt_length: Tensor  # [B] int64
    responses: Tensor  # [B, T] int64, or ragged rows (below)
    response_length: Tensor  # [B] int64
    response_mask: Tensor  # [B, T] float32, after overlong filtering and rejection sampling
    old_log_probs: Tensor | None  # [B, T] float32; None: taken from the update's own forward (on-policy)
    advantages: Tensor  # [B, T] float32
    rollout_log_probs: Tensor  # [B, T] float32 (first-step invariant, bypass-mode metrics)
    index: list[str]  # [B] prompt uid per row
    ref_log_probs: Tensor | None = None  # [B, T] float32 when a KL loss is used
    rollout_is_weights: Tensor | None = None  # [B, T] float32 when rollout IS is on

    def __len__(self) -> int:
        return self.responses.shape[0]

    def select(self, rows: Tensor | Sequence[int]) -> PolicyBatch:
        return select_record(self, rows)


def select_record(record, rows):
    """The rows `rows` of a frozen dataclass record: tensors index dim 0 (ragged rows their rows), lists
    and per-row dicts pick entries, nested records recurse."""
    rows_t = torch.as_tensor(list(rows) if not isinstance(rows, Tensor) else rows, dtype=torch.long)
    out = {}
    for f in dataclasses.fields(record):
        v = getattr(record, f.name)
        if isinstance(v, Tensor):
            out[f.name] = v.index_select(0, rows_t)
        elif hasattr(v, "index_select"):  # rollout.ragged.RaggedRows
            out[f.name] = v.index_select(rows_t)
        elif isinstance(v, list):
            out[f.name] = [v[i] for i in rows_t.tolist()]
        elif isinstance(v, dict):
            out[f.name] = {k: [vals[i] for i in rows_t.tolist()] for k, vals in v.items()}
        elif v is None:
            out[f.name] = None
        elif dataclasses.is_dataclass(v):
            out[f.name] = select_record(v, rows_t)
        else:
            raise TypeError(f"cannot select rows of field {f.name!r} ({type(v).__name__})")
    return type(record)(**out)
