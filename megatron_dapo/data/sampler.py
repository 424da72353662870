"""Resumable batch sampler: epoch after epoch of shuffled index batches, restartable mid-epoch.

The order of epoch ``e`` is a permutation drawn from a numpy Generator seeded with
``(seed, e)``, so it depends on nothing but those two numbers: a sampler rebuilt from
``state_dict()`` continues with exactly the batches an uninterrupted one would have produced.

``push_front(items)`` gives drawn items back (streaming dynamic sampling returns the prompts of the
groups it cut): the next batches start with them, then continue the epoch order where it stood. The
pushed-back items are part of ``state_dict()``, so a resumed run neither loses nor repeats them.
"""

from __future__ import annotations

import numpy as np

_STATE_KEYS = ("epoch", "index_in_epoch", "seed", "num_items", "batch_size", "shuffle", "drop_last")
# Fields that define the order: a checkpoint taken with other values cannot be resumed here.
_CONFIG_KEYS = ("seed", "num_items", "batch_size", "shuffle", "drop_last")


class ResumableSampler:
    """Yields lists of item indices, ``batch_size`` at a time, forever (an infinite iterator).

    With ``drop_last`` the ``num_items % batch_size`` items left at the end of an epoch are not
    used in that epoch; without it the epoch ends with one smaller batch. ``epoch`` and
    ``position`` describe the next batch: after the last batch of an epoch they already read
    ``(epoch + 1, 0)``.
    """

    def __init__(
        self, num_items: int, batch_size: int, *, seed: int, shuffle: bool = True, drop_last: bool = True
    ):
        for name, value in (("num_items", num_items), ("batch_size", batch_size), ("seed", seed)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if num_items <= 0:
            raise ValueError(f"num_items must be > 0, got {num_items}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        if drop_last and batch_size > num_items:
            raise ValueError(
                f"batch_size={batch_size} > num_items={num_items} with drop_last=True would yield no batch"
            )
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.num_items = num_items
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self._epoch = 0
        self._index_in_epoch = 0
        self._order_epoch: int | None = None
        self._order: list[int] = []
        self._front: list[int] = []  # given back by push_front, yielded before the epoch order

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (0-based)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Items of the current epoch's order already yielded."""
        return self._index_in_epoch

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.num_items, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            if self.shuffle:
                rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
                self._order = rng.permutation(self.num_items).tolist()
            else:
                self._order = list(range(self.num_items))
            self._order_epoch = epoch
        return self._order

    def _epoch_end(self) -> int:
        """Items of an epoch that are yielded (the rest is dropped with drop_last)."""
        if self.drop_last:
            return self.num_items - self.num_items % self.batch_size
        return self.num_items

    @property
    def front(self) -> list[int]:
        """Items given back by push_front that the next batches yield first."""
        return list(self._front)

    def push_front(self, items: list[int]) -> None:
        """Give drawn items back: the next batch starts with them (in this order, before any given back
        earlier)."""
        for i in items:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_items:
                raise ValueError(f"push_front: item {i!r} is not an index in [0, {self.num_items})")
        self._front = list(items) + self._front

    def next_batch(self) -> list[int]:
        """``batch_size`` items: the pushed-back ones first, then the epoch order. With ``drop_last`` a batch
        that pushed-back items left unaligned continues into the next epoch (every batch is full);
        without it the epoch still ends with one smaller batch."""
        batch, self._front = self._front[: self.batch_size], self._front[self.batch_size:]
        while len(batch) < self.batch_size:
            order = self._epoch_order(self._epoch)
            start = self._index_in_epoch
            stop = min(start + self.batch_size - len(batch), self._epoch_end())
            batch += order[start:stop]
            if stop >= self._epoch_end():
                self._epoch, self._index_in_epoch = self._epoch + 1, 0
                if not self.drop_last:
                    break
            else:
                self._index_in_epoch = stop
        return batch

    def __iter__(self) -> ResumableSampler:
        return self

    def __next__(self) -> list[int]:
        return self.next_batch()

    def state_dict(self) -> dict:
        return {
            "epoch": self._epoch,
            "index_in_epoch": self._index_in_epoch,
            "seed": self.seed,
            "num_items": self.num_items,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "front": list(self._front),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; it must come from a sampler with the same order-defining fields."""
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"sampler state is missing {missing}")
        for key in _CONFIG_KEYS:
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this sampler has {key}={getattr(self, key)!r}; "
                    "the saved order cannot be resumed"
                )
        epoch, index = state["epoch"], state["index_in_epoch"]
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"sampler state has epoch={epoch!r}, expected an int >= 0")
        # Without pushed-back items the position is a multiple of batch_size; push_front shifts it.
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self._epoch_end():
            raise ValueError(f"sampler state has index_in_epoch={index!r}, expected an int in [0, {self._epoch_end()})")
        front = list(state.get("front", []))  # absent in checkpoints written before push_front existed
        bad = [i for i in front if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_items]
        if bad:
            raise ValueError(f"sampler state has front item {bad[0]!r}, expected indices in [0, {self.num_items})")
        self._epoch, self._index_in_epoch, self._front = epoch, index, front
