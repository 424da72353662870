"""Per-step metrics sink: TensorBoard event files and a console progress line.

    with MetricsLogger("runs/exp/tb", total_steps=cfg.trainer.total_training_steps) as logger:
        for step in range(start, total + 1):
            ...
            logger.log(metrics, step=step)

Names are written exactly as given (`critic/score/mean` becomes that TensorBoard tag). Tensor
values (0-dim or one element) are converted to floats here, once per step, with one host
transfer per device. Call it on one rank only (rank 0): every rank writing would duplicate
the events.

Non-finite values (NaN, +-inf) are logged as they are, because hiding a NaN hides the bug; each
occurrence is counted in `nonfinite_counts` and the first one of each key logs a warning.

The console shows step, ETA, `critic/score/mean` and `perf/throughput` (when present): a tqdm
bar when the stream is a terminal, otherwise one compact line per step (cluster log files).
"""

from __future__ import annotations

import logging
import math
import numbers
import sys
import time
from collections.abc import Iterable, Mapping
from typing import TextIO

import numpy as np
import torch
from torch import Tensor

__all__ = ["CONSOLE_KEYS", "MetricsLogger"]

_LOG = logging.getLogger(__name__)

BACKENDS = ("console", "tensorboard")
# Shown on the console next to step and ETA when present in the step's metrics.
CONSOLE_KEYS = ("critic/score/mean", "perf/throughput")


class MetricsLogger:
    """Writes each step's metrics to the chosen backends; close it (or use `with`) at the end."""

    def __init__(
        self,
        log_dir: str | None,
        *,
        backends: Iterable[str] = BACKENDS,
        total_steps: int | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.backends = tuple(backends)
        unknown = [b for b in self.backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"backends: unknown {unknown}; valid backends are {list(BACKENDS)}")
        if total_steps is not None and (not _is_int(total_steps) or total_steps < 1):
            raise ValueError(f"total_steps: expected an int >= 1 or None, got {total_steps!r}")
        self.total_steps = total_steps
        self._stream = stream if stream is not None else sys.stdout
        self._writer = None
        if "tensorboard" in self.backends:
            if not log_dir:
                raise ValueError("log_dir: the tensorboard backend needs a directory, got None")
            from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard is a heavy import

            self._writer = SummaryWriter(log_dir=str(log_dir))
        self.log_dir = log_dir
        self._bar = None  # tqdm bar, created at the first step when the stream is a terminal
        self._first: tuple[int, float] | None = None  # (step, time) of the first log, for the ETA
        self._nonfinite: dict[str, int] = {}
        self._closed = False

    @property
    def nonfinite_counts(self) -> dict[str, int]:
        """How many non-finite values each key has logged so far."""
        return dict(self._nonfinite)

    def log(self, metrics: Mapping[str, float | int | Tensor], step: int) -> dict[str, float]:
        """Write one step; returns the metrics as floats (what was written)."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log called after close()")
        if not _is_int(step) or step < 0:
            raise ValueError(f"step: expected an int >= 0, got {step!r}")
        values = _to_floats(metrics)
        for key, value in values.items():
            if not math.isfinite(value):
                self._nonfinite[key] = self._nonfinite.get(key, 0) + 1
                if self._nonfinite[key] == 1:
                    _LOG.warning(
                        "metric %r is %s at step %d (logged as is; warned once per key)", key, value, step
                    )
        if self._writer is not None:
            for key, value in values.items():
                self._writer.add_scalar(key, value, global_step=int(step))
            self._writer.flush()
        if "console" in self.backends:
            self._console(values, int(step))
        return values

    def close(self) -> None:
        """Flush and close the backends; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._writer.close()
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _console(self, values: dict[str, float], step: int) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first = (step, now)
        shown = {k: values[k] for k in CONSOLE_KEYS if k in values}
        if _is_tty(self._stream):
            if self._bar is None:
                from tqdm import tqdm

                self._bar = tqdm(
                    total=self.total_steps,
                    initial=step,
                    unit="step",
                    desc="train",
                    file=self._stream,
                    dynamic_ncols=True,
                )
            else:
                self._bar.update(step - self._bar.n)
            self._bar.set_postfix_str(" ".join(f"{k}={_fmt(v)}" for k, v in shown.items()))
            return
        total = f"/{self.total_steps}" if self.total_steps is not None else ""
        parts = [f"step {step}{total}", f"eta {self._eta(step, now)}"]
        parts += [f"{k}={_fmt(v)}" for k, v in shown.items()]
        print(" | ".join(parts), file=self._stream, flush=True)

    def _eta(self, step: int, now: float) -> str:
        """Remaining time from the mean step time since the first logged step; '?' when unknown."""
        first_step, first_time = self._first
        if self.total_steps is None or step <= first_step:
            return "?"
        seconds = (now - first_time) / (step - first_step) * max(self.total_steps - step, 0)
        minutes, secs = divmod(int(round(seconds)), 60)
        hours, minutes = divmod(minutes, 60)
        return f"{hours}:{minutes:02d}:{secs:02d}"


def _to_floats(metrics: Mapping[str, object]) -> dict[str, float]:
    """Python floats for every value; one-element tensors go to the host in one transfer per device."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics: expected a dict of name -> number, got {type(metrics).__name__}")
    out: dict[str, float] = {}
    tensors: dict[torch.device, list[tuple[str, Tensor]]] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"metric name {key!r}: expected a non-empty str")
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ValueError(f"metric {key!r}: expected a scalar tensor, got shape {list(value.shape)}")
            if value.is_complex():
                raise TypeError(f"metric {key!r}: complex values cannot be logged")
            tensors.setdefault(value.device, []).append((key, value))
            out[key] = math.nan  # placeholder keeps the caller's key order
        elif isinstance(value, np.ndarray) and value.size == 1 and value.dtype.kind in "biuf":
            out[key] = float(value.reshape(()))
        elif isinstance(value, numbers.Real):
            out[key] = float(value)
        else:
            raise TypeError(
                f"metric {key!r}: expected a number or a scalar tensor, got {type(value).__name__}"
            )
    for group in tensors.values():
        host = torch.stack([t.detach().reshape(()).double() for _, t in group]).tolist()
        for (key, _), value in zip(group, host, strict=True):
            out[key] = value
    return out


def _fmt(value: float) -> str:
    # 4 significant digits, but large figures (throughput in tokens/s) as whole numbers, not 1.235e+04.
    return f"{value:.0f}" if math.isfinite(value) and abs(value) >= 1e4 else f"{value:.4g}"


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
