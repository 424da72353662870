"""Ragged rows: a generation batch's token fields as real tokens only, and only the rows a rank needs.

Between generation and the training batch (generate -> score -> dynamic sampling), a RolloutBatch's
`prompt_ids`, `responses` and `rollout_log_probs` are `RaggedRows` (its `response_mask` is None then):
row b is `values[offsets[b]:offsets[b] + lengths[b]]`, no padding, and a rank holds the entries of
the rows it scores only (rollout/rank0.py sends row r to rank r % world; rank 0, which received them
from the engine, holds every row). The lengths of every row are known everywhere, so the per-row
decisions (scores, groups, dynamic sampling) need nothing else. `share_kept_rows` then gives every
rank the rows of the training batch: its log-probs and response mask dense [B, T], as the actor's stages
consume them, its token ids still ragged (`TRAINING_DENSE`).

Host memory per rank therefore follows its share of the rows and their real tokens, not rows x
max_response_length (benchmarks/bench_host_memory.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

log = logging.getLogger(__name__)

RAGGED_FIELDS = {"prompt_ids": "prompt_length", "responses": "response_length",
                 "rollout_log_probs": "response_length"}
"""The token fields of a RolloutBatch that travel ragged, and the length field of each."""

TOKEN_DTYPE = torch.int32
"""Token ids held ragged (any vocabulary fits; the engines refuse a larger id at the reply): a third fewer
bytes than int64 with their float32 log-probs, in rank 0's batch and between ranks. `RaggedRows.dense`
gives int64, the dtype of every dense token tensor."""


class AbsentRowError(LookupError):
    """A row this rank does not hold was asked for."""


@dataclasses.dataclass(frozen=True)
class RaggedRows:
    """Rows of different lengths, some possibly absent on this rank."""

    values: Tensor  # [sum of the present rows' lengths], row after row (or anywhere: `starts`)
    lengths: Tensor  # [B] int64, every row's length (absent rows too)
    present: Tensor  # [B] bool
    width: int  # the dense width (max_response_length, or the widest prompt)
    fill: float  # dense padding (pad_id for tokens, 0 for log-probs)
    starts: Tensor | None = None
    """[B] int64, where each present row starts in `values` when the rows are not stored one after the other
    in row order (a batch written in its replies' arrival order: `RowArena`); `compact()` gives the plain
    layout, which whatever sends `values` to another rank or to disk uses."""

    def __post_init__(self):
        if self.values.dim() != 1:
            raise ValueError(f"RaggedRows: values of {self.values.dim()} dimensions")
        if self.starts is None:
            held = int(self.lengths[self.present].sum())
            if self.values.numel() != held:
                raise ValueError(f"RaggedRows: {self.values.numel()} values for present rows of {held} entries")
            return
        if self.starts.shape != self.lengths.shape:
            raise ValueError(f"RaggedRows: {len(self.starts)} row starts for {len(self.lengths)} rows")
        ends = (self.starts + self.lengths)[self.present]
        if bool((self.starts[self.present] < 0).any()) or (len(ends) and int(ends.max()) > self.values.numel()):
            raise ValueError(f"RaggedRows: row starts outside the {self.values.numel()} values")

    def compact(self) -> RaggedRows:
        """The same rows stored one after the other in row order (itself when they already are)."""
        if self.starts is None:
            return self
        return self.index_select(torch.arange(len(self)))

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.lengths), self.width

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def complete(self) -> bool:
        return bool(self.present.all())

    @functools.cached_property
    def _starts(self) -> Tensor:
        if self.starts is not None:
            return self.starts
        held = torch.where(self.present, self.lengths, 0)
        return torch.cumsum(held, 0) - held

    def _offsets(self) -> Tensor:
        """Where each row starts in `values` (computed once: `row` is called for every row of a batch)."""
        return self._starts

    def row(self, b: int) -> Tensor:
        if not bool(self.present[b]):
            raise AbsentRowError(f"row {b} is not held on this rank")
        start = int(self._offsets()[b])
        return self.values[start:start + int(self.lengths[b])]

    def index_select(self, rows: Tensor) -> RaggedRows:
        rows = torch.as_tensor(rows, dtype=torch.long)
        keep = self.present[rows]
        starts_t, lengths_t = self._offsets()[rows][keep], self.lengths[rows][keep]
        if len(starts_t) and bool((starts_t[1:] == starts_t[:-1] + lengths_t[:-1]).all()):
            # Rows stored one after the other (a batch trimmed to its first rows): a view, no copy.
            first = int(starts_t[0])
            values = self.values[first:first + int(lengths_t.sum())]
            return RaggedRows(values, self.lengths[rows].clone(), keep, self.width, self.fill)
        starts, lengths = starts_t.tolist(), lengths_t.tolist()
        pieces = [self.values[s:s + n] for s, n in zip(starts, lengths, strict=True)]
        values = torch.cat(pieces) if pieces else self.values[:0]
        return RaggedRows(values, self.lengths[rows].clone(), keep, self.width, self.fill)

    def take(self, rows: Tensor, pos: Tensor) -> Tensor:
        """Entry `pos` of row `rows`, for flat index tensors of one shape (what `dense()[rows, pos]` gives
        within each row), without the dense copy; `pos` past a row's end reads its last entry and an empty
        row gives `fill` (the caller masks positions past the row, as the micro-batch builder does)."""
        if not bool(self.present[rows].all()):
            raise AbsentRowError("take: a row asked for is not held on this rank")
        n = self.lengths[rows]
        if not self.values.numel():
            return torch.full(rows.shape, self.fill, dtype=self.values.dtype)
        at = self._offsets()[rows] + torch.minimum(pos.clamp(min=0), (n - 1).clamp(min=0))
        got = self.values[at.clamp(max=self.values.numel() - 1)]
        return torch.where(n > 0, got, torch.full_like(got, self.fill))

    def dense(self) -> Tensor:
        """[B, width], padded with `fill`, int64 for integer values (token ids); every row must be present."""
        if not self.complete:
            raise AbsentRowError(f"{int((~self.present).sum())} of {len(self)} rows are not held on this rank")
        dtype = self.values.dtype if self.values.is_floating_point() else torch.int64
        out = torch.full(self.shape, self.fill, dtype=dtype)
        # One slice copy per row: 2.4x faster than a boolean-mask scatter over [B, width] (measured at
        # 2,048 x 20,480, 6k mean), and it touches the real tokens only.
        for b, (start, n) in enumerate(zip(self._offsets().tolist(), self.lengths.tolist(), strict=True)):
            out[b, :n] = self.values[start:start + n]
        return out

    @staticmethod
    def from_dense(t: Tensor, lengths: Tensor, fill: float) -> RaggedRows:
        """The real entries of a dense [B, width] tensor (integer ones as TOKEN_DTYPE)."""
        mask = torch.arange(t.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
        values = t[mask] if t.is_floating_point() else t[mask].to(TOKEN_DTYPE)
        return RaggedRows(values.contiguous(), lengths.clone(), torch.ones(len(lengths), dtype=torch.bool),
                          t.shape[1], fill)

    @staticmethod
    def cat(parts: Sequence[RaggedRows]) -> RaggedRows:
        parts = [p.compact() for p in parts]
        return RaggedRows(torch.cat([p.values for p in parts]), torch.cat([p.lengths for p in parts]),
                          torch.cat([p.present for p in parts]), max(p.width for p in parts), parts[0].fill)


class RowArena:
    """Where a generation batch's rows are written as their replies arrive, so that once the last reply is in
    the batch needs no concatenation (`rollout.base.ragged_batch(arena=...)`): one reservation of rows x width
    entries for the token ids and one for the log-probs, rows in arrival order, each row's place kept
    (`RaggedRows.starts`). The reservation is address space only: a page becomes memory when a token is
    written to it, so resident memory follows the real tokens (bench_rank0.py measures it). A row that does
    not fit (a retried request's rows written twice) stays where it was, and the batch is then concatenated
    as without an arena."""

    def __init__(self, rows: int, width: int):
        self.capacity = rows * width
        try:
            self.ids = torch.empty(self.capacity, dtype=TOKEN_DTYPE)
            self.log_probs = torch.empty(self.capacity, dtype=torch.float32)
        except RuntimeError as e:  # a host that refuses the address space (vm.overcommit_memory=2): no arena
            log.warning("no row arena for %d rows x %d (%s): the batch is concatenated after the last reply",
                        rows, width, e)
            self.capacity = 0
            self.ids, self.log_probs = torch.empty(0, dtype=TOKEN_DTYPE), torch.empty(0, dtype=torch.float32)
        self._used, self._lock = 0, threading.Lock()

    def place(self, tokens: Tensor, log_probs: Tensor) -> tuple[Tensor, Tensor]:
        """(tokens, log_probs) copied into the arena, as views of it (thread-safe: reply threads call it)."""
        n = tokens.numel()
        with self._lock:
            start = self._used
            if start + n > self.capacity:
                return tokens, log_probs
            self._used = start + n
        ids, lps = self.ids[start:start + n], self.log_probs[start:start + n]
        ids.copy_(tokens)
        lps.copy_(log_probs)
        return ids, lps

    def rows(self, tokens: Sequence[Tensor], log_probs: Sequence[Tensor], lengths: Tensor, *, width: int,
             fill: float) -> tuple[RaggedRows, RaggedRows] | None:
        """The ragged (ids, log-probs) of rows whose tensors are all this arena's views (`place`), without
        a copy; None when one is not."""
        ids_ptr, lps_ptr = self.ids.untyped_storage().data_ptr(), self.log_probs.untyped_storage().data_ptr()
        starts = []
        for t, lp in zip(tokens, log_probs, strict=True):
            if (t.untyped_storage().data_ptr() != ids_ptr or lp.untyped_storage().data_ptr() != lps_ptr
                    or t.storage_offset() != lp.storage_offset()):
                return None
            starts.append(t.storage_offset())
        starts_t, present = torch.tensor(starts, dtype=torch.int64), torch.ones(len(starts), dtype=torch.bool)
        used = self._used
        return (RaggedRows(self.ids[:used], lengths, present, width, fill, starts_t),
                RaggedRows(self.log_probs[:used], lengths.clone(), present.clone(), width, 0.0, starts_t.clone()))


def is_ragged(batch) -> bool:
    return isinstance(batch.responses, RaggedRows)


def to_ragged(batch, *, pad_id: int):
    """The ragged form of a dense RolloutBatch (every row present); a ragged one as it is."""
    if is_ragged(batch):
        return batch
    fills = {"prompt_ids": pad_id, "responses": pad_id, "rollout_log_probs": 0.0}
    fields = {name: RaggedRows.from_dense(getattr(batch, name), getattr(batch, length), fills[name])
              for name, length in RAGGED_FIELDS.items()}
    return dataclasses.replace(batch, response_mask=None, **fields)


def to_dense(batch, fields: Sequence[str] = tuple(RAGGED_FIELDS)):
    """The RolloutBatch of a ragged one whose rows are all present with `fields` dense (default: every
    token field) and its response mask; a dense one as it is."""
    if not is_ragged(batch) and batch.response_mask is not None:
        return batch
    dense = {name: getattr(batch, name).dense() for name in fields if isinstance(getattr(batch, name), RaggedRows)}
    return dataclasses.replace(batch, response_mask=length_mask(batch.response_length, batch.responses.shape[1]),
                               **dense)


def length_mask(lengths: Tensor, width: int) -> Tensor:
    """[B, width] float32, 1 on each row's first lengths[b] entries: zeros then one fill per row, 1.6x faster
    than comparing against an arange and converting the [B, width] bools (1,024 x 20,480 measured)."""
    mask = torch.zeros(len(lengths), width, dtype=torch.float32)
    for b, n in enumerate(lengths.tolist()):
        mask[b, :n] = 1.0
    return mask


TRAINING_DENSE = ("rollout_log_probs",)
"""The token fields the training batch holds dense [B, T]: the engine's log-probs meet the actor's [B, T]
log-probs in the loss and the metrics. Its token ids stay ragged rows: only the micro-batch builder reads
them (workers/microbatch.py, in place), and a dense copy would cost every rank rows x max_response_length x
8 bytes, written and first touched after the last reply while every GPU waits."""


def to_training(batch):
    """The training batch of a ragged RolloutBatch whose rows are all present (`TRAINING_DENSE`)."""
    return to_dense(batch, TRAINING_DENSE)


def without_tokens(batch):
    """A ragged `batch` holding no row's token entries (every ragged field's rows absent, lengths kept; no
    routing): what a record of per-row values keeps of the rows it was computed from."""
    if not is_ragged(batch):
        raise TypeError("without_tokens: the batch is dense")
    absent = torch.zeros(len(batch), dtype=torch.bool)
    fields = {}
    for name in RAGGED_FIELDS:
        rows: RaggedRows = getattr(batch, name)
        # new_empty, not values[:0]: a view would keep the tokens' storage alive
        fields[name] = RaggedRows(rows.values.new_empty(0), rows.lengths, absent, rows.width, rows.fill)
    return dataclasses.replace(batch, routed_experts=None, **fields)


def share_kept_rows(batch, *, group=None):
    """Every rank's training batch (`to_training`) of `batch` with all its rows: rank 0 of `group`, which
    holds every row, broadcasts the entries of the rows another rank lacks (one flat tensor per ragged
    field). A collective over `group` when the batch is ragged (every rank calls it with the same rows)."""
    if not is_ragged(batch):
        return batch
    world = dist.get_world_size(group) if group is not None else 1
    if world > 1:
        src = dist.get_global_rank(group, 0)
        missing = torch.tensor([int(isinstance(getattr(batch, f), RaggedRows) and not getattr(batch, f).complete)
                                for f in RAGGED_FIELDS], dtype=torch.int64)
        dist.all_reduce(missing, group=group)
        fields = {}
        for name, need in zip(RAGGED_FIELDS, missing.tolist(), strict=True):
            rows: RaggedRows = getattr(batch, name)
            if not need:
                continue
            if dist.get_rank(group) == 0:
                rows = rows.compact()  # the receivers read the values row after row
            n = int(rows.lengths.sum())
            # Token ids travel as TOKEN_DTYPE (a no-op on rank 0 for rows it holds so) and stay so on arrival
            # (the micro-batch builder reads them as int64).
            wire = rows.values.dtype if rows.values.is_floating_point() else TOKEN_DTYPE
            values = rows.values.to(wire) if dist.get_rank(group) == 0 else torch.empty(n, dtype=wire)
            if dist.get_rank(group) == 0 and not rows.complete:
                raise AbsentRowError(f"rank 0 lacks rows of {name}: it holds every row it generated")
            dist.broadcast(values, src=src, group=group)
            fields[name] = RaggedRows(values, rows.lengths, torch.ones_like(rows.present), rows.width, rows.fill)
        batch = dataclasses.replace(batch, **fields)
    return to_training(batch)
