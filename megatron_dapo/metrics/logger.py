"""Per-step metrics sink: a console progress line, TensorBoard, Weights & Biases, MLflow.

    with MetricsLogger("runs/exp/tb", backends=cfg.trainer.logger, total_steps=cfg.trainer.total_training_steps,
                       project="megatron_dapo", experiment="exp", wandb_dir="runs/exp", config=to_dict(cfg)) as logger:
        for step in range(start, total + 1):
            ...
            logger.log(metrics, step=step)

Backends (`trainer.logger`, verl's names): `console`, `tensorboard` (event files under log_dir),
`wandb` and `mlflow` (optional extras, imported only when chosen: `pip install 'megatron-dapo[wandb]'`,
`'megatron-dapo[mlflow]'`). Names are written exactly as given everywhere (`critic/score/mean` is that
TensorBoard tag, that W&B key and that MLflow metric), with one exception forced by MLflow, which accepts
only letters, digits and `_ - . space : /` in a name: `@` becomes `_at_` there (verl's mapping:
`val/x/acc/mean@4` is `val/x/acc/mean_at_4`) and any other refused character `_`; two names that would
collide are an error. Tensor values (0-dim or one element) are converted to floats here, once per step,
with one host transfer per device. Call it on one rank only (rank 0): every rank writing would duplicate
the events.

wandb and mlflow are configured the way their users expect, by their own environment variables:
`WANDB_MODE=offline` (or `WANDB_API_KEY` for the hosted service, `WANDB_ENTITY`, ...), files under
`wandb_dir/wandb/`; `MLFLOW_TRACKING_URI` (an MLflow server, or `sqlite:///...` with the full `mlflow`
package); W&B's service gets 300 s to start, not its default 30 s, unless `WANDB__SERVICE_WAIT` is set.
The run is named `experiment` in the project / experiment `project`; `config` (the resolved
config) becomes the W&B run config and the MLflow run's parameters (flattened to `section.key`).

Non-finite values (NaN, +-inf) are logged as they are, because hiding a NaN hides the bug; each
occurrence is counted in `nonfinite_counts` and the first one of each key logs a warning.

The console shows step, ETA, `critic/score/mean` and `perf/throughput` (when present): a tqdm
bar when the stream is a terminal, otherwise one compact line per step (cluster log files).
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import re
import sys
import time
from collections.abc import Iterable, Mapping
from typing import TextIO

import numpy as np
import torch
from torch import Tensor

__all__ = ["BACKENDS", "CONSOLE_KEYS", "MetricsLogger", "mlflow_name"]

_LOG = logging.getLogger(__name__)
WANDB_SERVICE_WAIT_S = 300.0  # W&B's own default, 30 s, fails a run whose node is busy at start

BACKENDS = ("console", "tensorboard", "wandb", "mlflow")
# Shown on the console next to step and ETA when present in the step's metrics.
CONSOLE_KEYS = ("critic/score/mean", "perf/throughput")
_EXTRA = {"wandb": "wandb", "mlflow": "mlflow"}     # backend -> the pyproject extra that installs it
_MLFLOW_REFUSED = re.compile(r"[^/\w.\- :]")      # mlflow.utils.validation: names match ^[/\w.\- :]*$


def mlflow_name(name: str) -> str:
    """The MLflow metric name of `name`: `@` -> `_at_`, any other refused character -> `_`."""
    return _MLFLOW_REFUSED.sub("_", name.replace("@", "_at_"))


def _import_backend(backend: str):
    try:
        if backend == "wandb":
            import wandb
            return wandb
        import mlflow.entities
        import mlflow.tracking
        return mlflow
    except ImportError as err:
        raise ImportError(f"trainer.logger: the {backend!r} backend needs the {backend} package, which is not "
                          f"installed (pip install 'megatron-dapo[{_EXTRA[backend]}]'): {err}") from None


class _WandbSink:
    def __init__(self, *, project: str, experiment: str | None, directory: str | None, config: dict | None):
        wandb = _import_backend("wandb")
        # W&B waits 30 s for its service process (wandb-core) to start, then raises; on a loaded node (a cold
        # page cache, a busy head node) that start can take longer. WANDB__SERVICE_WAIT, when set, still rules.
        settings = {} if "WANDB__SERVICE_WAIT" in os.environ else {"x_service_wait": WANDB_SERVICE_WAIT_S}
        self._run = wandb.init(project=project, name=experiment, dir=directory, config=config or {},
                               settings=wandb.Settings(**settings))

    def write(self, values: dict[str, float], step: int) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


class _MlflowSink:
    BATCH = 1000       # MLflow's limit on metrics per log_batch call (params: 100)

    def __init__(self, *, project: str, experiment: str | None, config: dict | None):
        mlflow = _import_backend("mlflow")
        self._entities = mlflow.entities
        try:
            self._client = mlflow.tracking.MlflowClient()
            found = self._client.get_experiment_by_name(project)
            experiment_id = found.experiment_id if found else self._client.create_experiment(project)
            self._run_id = self._client.create_run(experiment_id, run_name=experiment).info.run_id
        except mlflow.exceptions.MlflowException as err:
            raise RuntimeError(f"trainer.logger: MLflow could not start a run at tracking URI "
                               f"{mlflow.get_tracking_uri()!r} (set MLFLOW_TRACKING_URI): {err}") from None
        params = [self._entities.Param(k, str(v)[:500]) for k, v in _flatten(config or {}).items()]
        for i in range(0, len(params), 100):
            self._client.log_batch(self._run_id, params=params[i:i + 100])
        self._names: dict[str, str] = {}    # MLflow name -> the metric name it came from

    def write(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        metrics = []
        for key, value in values.items():
            name = mlflow_name(key)
            if self._names.setdefault(name, key) != key:
                raise ValueError(f"metrics {self._names[name]!r} and {key!r} both become MLflow metric {name!r}")
            metrics.append(self._entities.Metric(name, value, now, step))
        for i in range(0, len(metrics), self.BATCH):
            self._client.log_batch(self._run_id, metrics=metrics[i:i + self.BATCH])

    def close(self) -> None:
        self._client.set_terminated(self._run_id, "FINISHED")


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class MetricsLogger:
    """Writes each step's metrics to the chosen backends; close it (or use `with`) at the end."""

    def __init__(
        self,
        log_dir: str | None,
        *,
        backends: Iterable[str] = ("console", "tensorboard"),
        total_steps: int | None = None,
        stream: TextIO | None = None,
        project: str = "megatron_dapo",
        experiment: str | None = None,
        wandb_dir: str | None = None,
        config: dict | None = None,
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
        if "tensorboard" in self.backends and not log_dir:
            raise ValueError("log_dir: the tensorboard backend needs a directory, got None")
        for backend in ("wandb", "mlflow"):     # a missing package fails before any sink starts
            if backend in self.backends:
                _import_backend(backend)
        if "tensorboard" in self.backends:
            from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard is a heavy import

            self._writer = SummaryWriter(log_dir=str(log_dir))
        self._sinks = []
        if "wandb" in self.backends:
            self._sinks.append(_WandbSink(project=project, experiment=experiment, directory=wandb_dir,
                                          config=config))
        if "mlflow" in self.backends:
            self._sinks.append(_MlflowSink(project=project, experiment=experiment, config=config))
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
        for sink in self._sinks:
            sink.write(values, int(step))
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
        for sink in self._sinks:
            sink.close()
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
