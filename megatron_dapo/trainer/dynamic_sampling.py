"""DAPO dynamic sampling across generation batches (DESIGN.md step 4).

Each generation batch is scored, then only the groups whose `filter_groups.metric` is not constant
over their non-aborted responses are kept (`algos.dynamic_sampling.select_informative_groups`). Kept groups accumulate over further
generation batches until `train_batch_size` prompts are available; the batch is then trimmed to
`train_batch_size * n` rows. Past `max_num_gen_batches` (<= 0: no limit) the recipe raises; with
`on_exhausted="train_on_available"` the step trains on the groups kept so far (rounded down to whole
mini-batches).

The buffer of kept groups is part of the trainer state: `state_dict()` holds it, so a run that
stops between two generation batches of a step resumes without generating them again.

Streaming (`filter_groups.streaming`): `StopWhenFull` is the engine's `on_groups_done` callback. It
scores each group when its last sample ends and tells the engine to stop once the groups the step
still needs are complete and informative; `finished_groups` then separates the complete groups from
the cut ones (any aborted sample), whose prompts the trainer gives back to the sampler. The reward
stage reuses the callback's scores (`stages.score_streamed`: each complete group is scored once, on
the rank that ran the callback, and the values reach every rank). Which groups the step trains on is
decided as without streaming, by `add` on every rank: the callback only decides when generation stops.

Per step the buffer also counts what generation cost: every response token generated (cut, dropped
and aborted ones included) against the response tokens trained on, the groups cut, and the mean
response length of the trained rows against that of every finished row (cutting the tail of a
batch favours short answers: docs/dapo-step.md, "Streaming dynamic sampling").
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from megatron_dapo.algos.dynamic_sampling import select_informative_groups
from megatron_dapo.rollout.base import RolloutBatch
from megatron_dapo.rollout.ragged import RAGGED_FIELDS, RaggedRows, to_ragged, without_tokens
from megatron_dapo.trainer.batch import ScoredBatch, concat_rollouts, concat_scored, select_rows


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
        self._reset_costs()

    def _reset_costs(self) -> None:
        self.generated_tokens = 0  # every response token of the step's generation batches
        self.cut_groups = 0
        self.finished_rows = 0  # non-aborted rows scored, and their summed response length
        self.finished_tokens = 0

    @property
    def needed(self) -> int:
        """Groups still missing for the step (what a streaming generation batch waits for)."""
        return max(self.train_batch_size - self.num_prompts, 0)

    def add(self, batch: ScoredBatch | None, *, generated_tokens: int | None = None, cut_groups: int = 0) -> None:
        """Keep the informative groups of one scored generation batch.

        batch: the scored rows (None when streaming cut every group). generated_tokens: the response
        tokens the engine produced for the whole generation batch (default: those of `batch`);
        cut_groups: groups of it that streaming cut (their rows are not in `batch`)."""
        self.num_gen_batches += 1
        self.cut_groups += cut_groups
        if batch is None:
            self.generated_tokens += generated_tokens or 0
            return
        # Kept groups wait ragged (real tokens only; rows of other ranks absent): rollout/ragged.py.
        batch = dataclasses.replace(batch, rollout=to_ragged(batch.rollout, pad_id=self.pad_id))
        lengths, live_t = batch.rollout.response_length, ~batch.rollout.aborted
        self.generated_tokens += int(lengths.sum()) if generated_tokens is None else generated_tokens
        self.finished_rows += int(live_t.sum())
        self.finished_tokens += int(lengths[live_t].sum())
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
        """The training batch (trimmed to whole groups, ragged: `ragged.share_kept_rows` completes it on
        every rank) and the step's dynamic-sampling metrics; resets."""
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
        metrics["train/num_cut_groups"] = float(self.cut_groups)
        if self.finished_rows:
            metrics["train/finished_response_length_mean"] = self.finished_tokens / self.finished_rows
        if batch is not None:
            live = ~batch.rollout.aborted
            trained = int(batch.rollout.response_length[live].sum())
            if int(live.sum()):
                metrics["train/kept_response_length_mean"] = trained / int(live.sum())
            if trained:
                metrics["train/gen_tokens_per_trained_token"] = self.generated_tokens / trained
        self.reset()
        return batch, metrics

    def reset(self) -> None:
        self._kept, self.num_gen_batches, self.num_prompts, self.dropped_groups = [], 0, 0, 0
        self._reset_costs()

    # -- checkpointing: only tensors, lists, dicts and numbers (loadable with weights_only=True) --
    # The state is the counters plus one part per generation batch that kept groups, so the trainer
    # writes each part once (trainer/checkpoint.py, save_inflight) and not the whole buffer per batch.
    @property
    def num_parts(self) -> int:
        return len(self._kept)

    def counters(self) -> dict[str, Any]:
        return {"num_gen_batches": self.num_gen_batches, "num_prompts": self.num_prompts,
                "dropped_groups": self.dropped_groups,
                "costs": [self.generated_tokens, self.cut_groups, self.finished_rows, self.finished_tokens]}

    def parts(self, first: int = 0) -> list[dict[str, Any]]:
        """The kept groups of each generation batch from `first` on, ragged (real tokens only)."""
        return [_scored_to_dict(b) for b in self._kept[first:]]

    def state_dict(self) -> dict[str, Any]:
        return {**self.counters(), "kept": self.parts()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_gen_batches = int(state["num_gen_batches"])
        self.num_prompts = int(state["num_prompts"])
        self.dropped_groups = int(state["dropped_groups"])
        self._kept = [_scored_from_dict(d) for d in state["kept"]]
        self.generated_tokens, self.cut_groups, self.finished_rows, self.finished_tokens = (
            int(x) for x in state["costs"])


class StopWhenFull:
    """The streaming callback (`RolloutEngine.generate_batch_streaming`): scores complete groups as they come
    and, with a `need`, says stop once `need` informative groups are complete. score_groups(batch) ->
    ScoredBatch scores a ragged batch of complete groups (on the calling rank only).

    need None (`StopWhenFull.scoring_only`): never stops; every group is scored as soon as it completes, so
    the sync trainer's scoring runs beside generation instead of after it (rank 0 is otherwise idle while
    the servers generate). A reward error there is not raised into the engine: the group stays unscored and
    `stages.score_streamed` scores it again after generation, where the error reaches every rank.

    With a need, groups wait unscored while even all of them together could not meet it: the answer is the
    same, with fewer reward calls (the first ones of a generation batch cannot stop it).

    drops_constant: dynamic sampling will drop the groups whose metric is constant (filter_groups.enable).
    Their R3 routing is then released as they are scored (`BatchGroupsDone`: the engine keeps no copy), so
    rank 0 holds the routing of the informative groups only, not of the whole generation batch. keep and
    positions (with drops_constant): the step takes the first `keep` informative groups of this generation
    batch in `positions` order (group id -> its place in the batch: GroupBuffer.take's order); a later one
    is surplus, and its routing is released as soon as `keep` informative groups before it are scored, so
    the scored groups holding routing are at most the first `keep` informative ones in batch order: rank 0
    holds at most the routing one step trains, however many groups the batch has and whatever order they
    complete in (the planner's bound, plan.host)."""

    def __init__(self, *, need: int | None, metric: str, score_groups: Callable[[RolloutBatch], ScoredBatch],
                 drops_constant: bool = False, keep: int | None = None, positions: dict[str, int] | None = None):
        if keep is not None and positions is None:
            raise ValueError("StopWhenFull: keep needs the groups' positions")
        self.need, self.metric, self.score_groups = need, metric, score_groups
        self.drops_constant, self.keep, self.positions = drops_constant, keep, positions
        self._informative_at: list[int] = []  # positions of the informative groups scored so far, sorted
        self._held: dict[int, list[tuple[list, int]]] = {}  # position -> its rows' places in the routing lists
        self.informative = 0
        self.pending: list[RolloutBatch] = []
        self.scored: dict[str, tuple[ScoredBatch, int]] = {}
        """{group id: (the ScoredBatch that holds it, its first row)}: what the reward stage reuses
        (stages.score_streamed), so a complete group is scored once."""

    @classmethod
    def scoring_only(cls, *, metric: str, score_groups: Callable[[RolloutBatch], ScoredBatch],
                     drops_constant: bool = False, keep: int | None = None,
                     positions: dict[str, int] | None = None) -> StopWhenFull:
        return cls(need=None, metric=metric, score_groups=score_groups, drops_constant=drops_constant, keep=keep,
                    positions=positions)

    def __call__(self, done: RolloutBatch) -> bool:
        if self.need is None:
            self._score(done, [done])
            return False
        self.pending.append(done)
        if self.informative + sum(len(set(b.index)) for b in self.pending) < self.need:
            return False
        pending, self.pending = self.pending, []
        self._score(concat_rollouts(pending, pad_id=0), pending)  # ragged rows: no padding is made
        return self.informative >= self.need

    def _score(self, batch: RolloutBatch, parts: list[RolloutBatch]) -> None:
        """Score `batch` (the concatenation of the callback's `parts`, or the one part)."""
        try:
            scored = self.score_groups(batch)
        except Exception:  # noqa: BLE001 - scoring-only: scored again after generation, raising on every rank
            if self.need is not None:
                raise
            return
        # Kept until the reward stage reads its values: not the tokens, which the generation batch holds too.
        scored = dataclasses.replace(scored, rollout=without_tokens(scored.rollout))
        first_row: dict[str, int] = {}
        for row, gid in enumerate(batch.index):
            first_row.setdefault(gid, row)
        for gid, first in first_row.items():
            self.scored[gid] = (scored, first)
        informative = set(select_informative_groups(scored.rollout.index, scored.metric_values(self.metric)))
        if self.need is not None:
            self.informative += len(informative)
        if self.drops_constant:  # groups `add` will drop (complete groups: no aborted row to leave out)
            for part in parts:
                if part.routed_experts is not None:
                    for i, gid in enumerate(part.index):
                        if gid not in informative:
                            part.routed_experts[i] = None
                        elif self.keep is not None:
                            self._held.setdefault(self.positions[gid], []).append((part.routed_experts, i))
            if self.keep is not None:
                self._release_surplus([self.positions[gid] for gid in informative])

    def _release_surplus(self, scored: list[int]) -> None:
        """Release the routing of every informative group with `keep` informative groups before it (positions
        only move back as groups are added, so a surplus group stays surplus)."""
        for pos in scored:
            bisect.insort(self._informative_at, pos)
        for pos in self._informative_at[self.keep:]:
            for routing, i in self._held.pop(pos, ()):
                routing[i] = None


def finished_groups(rollout: RolloutBatch, n: int) -> tuple[list[int], list[int]]:
    """(complete, cut): the positions of the groups (prompt-major, n rows each) whose rows all finished, and
    of those with an aborted row."""
    aborted = rollout.aborted.view(-1, n).any(dim=1).tolist()
    return [g for g, a in enumerate(aborted) if not a], [g for g, a in enumerate(aborted) if a]


def _scored_to_dict(b: ScoredBatch) -> dict[str, Any]:
    """A ScoredBatch (ragged, every row present: rank 0's) as tensors, lists and dicts."""
    d = {f.name: getattr(b, f.name) for f in dataclasses.fields(b) if f.name != "rollout"}
    rb = b.rollout
    # R3's routing is not saved: hundreds of bytes per token would dwarf the rest of the part. The rows of a
    # step resumed mid-collection route freely (router_replay/rows_with_routing says how many).
    d["rollout"] = {f.name: getattr(rb, f.name) for f in dataclasses.fields(rb)
                    if f.name not in ("response_mask", "routed_experts")}
    for name in RAGGED_FIELDS:
        rows: RaggedRows = d["rollout"][name].compact()  # values row after row, as the loader reads them
        if not rows.complete:
            raise ValueError(f"cannot save {name}: rows of other ranks are absent (rank 0 saves the buffer)")
        d["rollout"][name] = {"values": rows.values, "lengths": rows.lengths, "width": rows.width, "fill": rows.fill}
    return d


def _scored_from_dict(d: dict[str, Any]) -> ScoredBatch:
    fields = dict(d["rollout"])
    for name in RAGGED_FIELDS:
        r = fields[name]
        fields[name] = RaggedRows(r["values"], r["lengths"], torch.ones(len(r["lengths"]), dtype=torch.bool),
                                  int(r["width"]), r["fill"])
    rollout = RolloutBatch(**fields, response_mask=None)
    rest = {k: v for k, v in d.items() if k != "rollout"}
    for k in ("scores", "rewards"):
        rest[k] = torch.as_tensor(rest[k])
    return ScoredBatch(rollout=rollout, **rest)
