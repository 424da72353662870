"""Typed batch records at the trainer's stage boundaries (STYLE.md rule 10).

Shape legend:
    B  rows = responses (prompt-major: the n responses of a prompt are contiguous)
    P  longest prompt in the batch (right-padded)
    T  max_response_length (right-padded)

    gen    -> RolloutBatch (rollout/base.py)
    reward -> ScoredBatch  = RolloutBatch + texts + scores/rewards + reward extra info
    dynamic sampling keeps whole groups of ScoredBatch rows (select_rows / concat_scored)
    old_log_prob, ref, adv -> PolicyBatch (workers/batch.py: the actor defines what it consumes)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megatron_dapo.rollout.base import RolloutBatch
from megatron_dapo.rollout.ragged import RaggedRows
from megatron_dapo.workers.batch import select_record


@dataclass(frozen=True)
class ScoredBatch:
    """Rollouts with their rewards."""

    rollout: RolloutBatch
    raw_prompt: list[str]  # [B] prompt text (for dumps)
    response_text: list[str]  # [B] decoded responses
    ground_truth: list[str]  # [B]
    scores: Tensor  # [B] float32, the reward function's score
    rewards: Tensor  # [B] float32, score + overlong penalty (the sequence-level reward)
    extra: dict[str, list]  # per-row reward info: score, acc, pred, overlong_reward, overlong

    def __len__(self) -> int:
        return len(self.rollout)

    def metric_values(self, metric: str) -> list:
        """Per-row values of a dynamic-sampling metric (algorithm.filter_groups.metric)."""
        if metric in ("seq_reward", "seq_final_reward"):
            # Without KL in the reward (checked at start) the final reward is the shaped reward.
            return self.rewards.tolist()
        if metric not in self.extra:
            raise KeyError(f"filter_groups.metric {metric!r} is not in the reward extra info "
                           f"(available: {sorted(self.extra)})")
        return list(self.extra[metric])


def select_rows(batch: ScoredBatch, rows: Sequence[int]) -> ScoredBatch:
    return select_record(batch, rows)


def _pad_cat(tensors: list[Tensor], pad_value) -> Tensor:
    """Concatenate along dim 0, right-padding dim 1 to the widest (prompts differ in length)."""
    if tensors[0].dim() == 1:
        return torch.cat(tensors)
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=pad_value) for t in tensors])


PER_ROW_OPTIONAL = frozenset({"routed_experts"})
"""Per-row list fields that may be None in some records (None = no entry for any of its rows): R3's
routing lives on rank 0, while every rank restores the in-flight buffer's rows with it."""


def _concat(records: list, pad_id: int):
    first = records[0]
    out: dict[str, Any] = {}
    for f in dataclasses.fields(first):
        vals = [getattr(r, f.name) for r in records]
        if f.name in PER_ROW_OPTIONAL and any(v is not None for v in vals):
            vals = [v if v is not None else [None] * len(r) for r, v in zip(records, vals, strict=True)]
        v0 = vals[0]
        if isinstance(v0, Tensor):
            out[f.name] = _pad_cat(vals, pad_id if f.name == "prompt_ids" else 0)
        elif isinstance(v0, RaggedRows):
            out[f.name] = RaggedRows.cat(vals)
        elif v0 is None:
            if any(v is not None for v in vals):
                raise ValueError(f"cannot concatenate {f.name}: set in some records only")
            out[f.name] = None
        elif isinstance(v0, list):
            out[f.name] = [x for v in vals for x in v]
        elif isinstance(v0, dict):
            keys = set(v0)
            for v in vals:
                if set(v) != keys:
                    raise ValueError(f"cannot concatenate {f.name}: keys {sorted(v)} != {sorted(keys)}")
            out[f.name] = {k: [x for v in vals for x in v[k]] for k in v0}
        elif dataclasses.is_dataclass(v0):
            out[f.name] = _concat(vals, pad_id)
        else:
            raise TypeError(f"cannot concatenate field {f.name!r} ({type(v0).__name__})")
    return type(first)(**out)


def concat_scored(batches: list[ScoredBatch], *, pad_id: int) -> ScoredBatch:
    if not batches:
        raise ValueError("concat_scored: no batches")
    return batches[0] if len(batches) == 1 else _concat(batches, pad_id)


def concat_rollouts(batches: list, *, pad_id: int):
    """One RolloutBatch of several (ragged or dense), rows in order."""
    if not batches:
        raise ValueError("concat_rollouts: no batches")
    return batches[0] if len(batches) == 1 else _concat(batches, pad_id)


def token_level(values: Tensor, response_length: Tensor, width: int) -> Tensor:
    """[B] sequence values placed on each row's last response token -> [B, T] (0 elsewhere)."""
    out = torch.zeros(values.shape[0], width, dtype=torch.float32)
    rows = torch.nonzero(response_length > 0).squeeze(1)
    out[rows, response_length[rows] - 1] = values[rows].float()
    return out
