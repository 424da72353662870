"""DAPO dynamic sampling across generation batches (DESIGN.md step 4).

Each generation batch is scored, then only the groups whose `filter_groups.metric` is not constant
over their non-aborted responses are kept (`algos.dynamic_sampling.select_informative_groups`). Kept groups accumulate over further
generation batches until `train_batch_size` prompts are available; the batch is then trimmed to
`train_batch_size * n` rows. Past `max_num_gen_batches` (<= 0: no limit) the recipe raises; with
`on_exhausted="train_on_available"` the step trains on the groups kept so far (rounded down to whole
mini-batches).

The buffer of kept groups is part of the trainer state: `state_dict()` holds it, so a run that
stops between two generation batches of a step resumes without generating them again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_dapo.algos.dynamic_sampling import select_informative_groups
from megatron_dapo.rollout.base import RolloutBatch
from megatron_dapo.trainer.batch import ScoredBatch, concat_scored, select_rows


class DynamicSamplingExhausted(RuntimeError):
    """More than max_num_gen_batches generation batches did not yield train_batch_size groups."""


class GroupBuffer:
    """Accumulates informative groups for one training step."""

    def __init__(self, *, enable: bool, metric: str, max_num_gen_batches: int, on_exhausted: str,
                 train_batch_size: int, n: int, ppo_mini_batch_size: int, pad_id: int):
        self.enable, self.metric = enable, metric
        self.max_num_gen_batches, self.on_exhausted = max_num_gen_batches, on_exhausted
        self.train_batch_size, self.n = train_batch_size, n
        self.ppo_mini_batch_size, self.pad_id = ppo_mini_batch_size, pad_id
        self._kept: list[ScoredBatch] = []
        self.num_gen_batches = 0
        self.num_prompts = 0
        self.dropped_groups = 0

    def add(self, batch: ScoredBatch) -> None:
        """Keep the informative groups of one scored generation batch."""
        self.num_gen_batches += 1
        if not self.enable:
            self._kept.append(batch)
            self.num_prompts += len(batch) // self.n
            return
        index = batch.rollout.index
        # Aborted responses carry no signal (their score is not an answer): the metric of a group is
        # decided by its finished responses only, and a group with none is dropped.
        live = [i for i, a in enumerate(batch.rollout.aborted.tolist()) if not a]
        values = batch.metric_values(self.metric)
        kept = set(select_informative_groups([index[i] for i in live], [values[i] for i in live]))
        rows = [i for i, uid in enumerate(index) if uid in kept]
        self.dropped_groups += len(set(index)) - len(kept)
        if rows:
            self._kept.append(select_rows(batch, rows))
            self.num_prompts += len(kept)

    def ready(self) -> bool:
        """True when the step can train: enough groups, or filtering off."""
        return not self.enable or self.num_prompts >= self.train_batch_size

    def check_budget(self) -> bool:
        """After an unfilled batch: True to generate more; False to train on what is there.

        Raises DynamicSamplingExhausted past max_num_gen_batches when on_exhausted == "raise".
        """
        if self.max_num_gen_batches <= 0 or self.num_gen_batches < self.max_num_gen_batches:
            return True
        if self.on_exhausted == "raise":
            raise DynamicSamplingExhausted(
                f"dynamic sampling kept {self.num_prompts} of the {self.train_batch_size} prompts needed after "
                f"{self.num_gen_batches} generation batches (algorithm.filter_groups.max_num_gen_batches="
                f"{self.max_num_gen_batches}); too many groups have a constant "
                f"'{self.metric}'. Check the data and reward, raise max_num_gen_batches, or set "
                f"algorithm.filter_groups.on_exhausted=train_on_available")
        return False

    def take(self) -> tuple[ScoredBatch | None, dict[str, float]]:
        """The training batch (trimmed to whole groups) and the step's dynamic-sampling metrics; resets."""
        metrics = {"train/num_gen_batches": float(self.num_gen_batches),
                   "train/num_kept_prompts": float(self.num_prompts),
                   "train/num_dropped_groups": float(self.dropped_groups)}
        target = self.train_batch_size if self.ready() else (
            self.num_prompts // self.ppo_mini_batch_size * self.ppo_mini_batch_size)
        batch = None
        if self._kept and target > 0:
            merged = concat_scored(self._kept, pad_id=self.pad_id)
            rows = min(len(merged), target * self.n) if self.enable else len(merged)
            batch = merged if rows == len(merged) else select_rows(merged, range(rows))
        metrics["train/num_train_prompts"] = float(len(batch) // self.n if batch is not None else 0)
        self.reset()
        return batch, metrics

    def reset(self) -> None:
        self._kept, self.num_gen_batches, self.num_prompts, self.dropped_groups = [], 0, 0, 0

    # -- checkpointing: only tensors, lists, dicts and numbers (loadable with weights_only=True) --
    def state_dict(self) -> dict[str, Any]:
        return {"num_gen_batches": self.num_gen_batches, "num_prompts": self.num_prompts,
                "dropped_groups": self.dropped_groups, "kept": [_scored_to_dict(b) for b in self._kept]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_gen_batches = int(state["num_gen_batches"])
        self.num_prompts = int(state["num_prompts"])
        self.dropped_groups = int(state["dropped_groups"])
        self._kept = [_scored_from_dict(d) for d in state["kept"]]


def _scored_to_dict(b: ScoredBatch) -> dict[str, Any]:
    d = {f.name: getattr(b, f.name) for f in dataclasses.fields(b) if f.name != "rollout"}
    d["rollout"] = {f.name: getattr(b.rollout, f.name) for f in dataclasses.fields(b.rollout)}
    return d


def _scored_from_dict(d: dict[str, Any]) -> ScoredBatch:
    rollout = RolloutBatch(**d["rollout"])
    rest = {k: v for k, v in d.items() if k != "rollout"}
    for k in ("scores", "rewards"):
        rest[k] = torch.as_tensor(rest[k])
    return ScoredBatch(rollout=rollout, **rest)
