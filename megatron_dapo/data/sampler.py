"""Resumable batch sampler: epoch after epoch of shuffled index batches, restartable mid-epoch.

The order of epoch ``e`` is a permutation drawn from a numpy Generator seeded with
``(seed, e)``, so it depends on nothing but those two numbers: a sampler rebuilt from
``state_dict()`` continues with exactly the batches an uninterrupted one would have produced.
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

    def next_batch(self) -> list[int]:
        order = self._epoch_order(self._epoch)
        start = self._index_in_epoch
        stop = min(start + self.batch_size, self._epoch_end())
        batch = order[start:stop]
        if stop >= self._epoch_end():
            self._epoch, self._index_in_epoch = self._epoch + 1, 0
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
        if (
            isinstance(index, bool)
            or not isinstance(index, int)
            or not 0 <= index < self._epoch_end()
            or index % self.batch_size != 0
        ):
            raise ValueError(
                f"sampler state has index_in_epoch={index!r}, expected a multiple of batch_size="
                f"{self.batch_size} in [0, {self._epoch_end()})"
            )
        self._epoch, self._index_in_epoch = epoch, index
