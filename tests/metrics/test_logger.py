"""MetricsLogger: TensorBoard events read back with tensorboard's own reader, a W&B offline run and an
MLflow file store read back value by value, the same names in every backend, console output, errors."""

import io
import json
import logging
import math
import re
import struct
import sys
import time

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_dapo.metrics.logger import WANDB_SERVICE_WAIT_S, MetricsLogger, mlflow_name


def _read_scalars(log_dir):
    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0 = keep every event
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def test_tensorboard_events_hold_every_tag_step_and_value(tmp_path):
    steps = {
        1: {"critic/score/mean": 0.5, "perf/throughput": 1000, "actor/pg_loss": torch.tensor(-0.25)},
        2: {
            "critic/score/mean": torch.tensor([0.75]),
            "perf/throughput": np.float32(1250.0),
            "actor/pg_loss": 0.125,
        },
        3: {"critic/score/mean": np.array(1.0), "actor/pg_loss": torch.tensor(0.0, dtype=torch.float64)},
    }
    with MetricsLogger(str(tmp_path), backends=("tensorboard",)) as logger:
        for step, metrics in steps.items():
            written = logger.log(metrics, step=step)
            assert all(isinstance(v, float) for v in written.values())
    scalars = _read_scalars(tmp_path)
    assert scalars == {
        "critic/score/mean": [(1, 0.5), (2, 0.75), (3, 1.0)],
        "perf/throughput": [(1, 1000.0), (2, 1250.0)],
        "actor/pg_loss": [(1, -0.25), (2, 0.125), (3, 0.0)],
    }


def test_events_are_flushed_after_each_step_before_close(tmp_path):
    logger = MetricsLogger(str(tmp_path), backends=("tensorboard",))
    logger.log({"critic/rewards/mean": 0.25}, step=7)
    assert _read_scalars(tmp_path) == {"critic/rewards/mean": [(7, 0.25)]}
    logger.close()


def test_nonfinite_values_are_logged_counted_and_warned_once_per_key(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="megatron_dapo.metrics.logger")
    with MetricsLogger(str(tmp_path), backends=("tensorboard",)) as logger:
        logger.log({"a": float("nan"), "b": 1.0}, step=1)
        logger.log({"a": torch.tensor(float("nan")), "b": float("inf")}, step=2)
        logger.log({"a": float("-inf"), "b": 2.0}, step=3)
        assert logger.nonfinite_counts == {"a": 3, "b": 1}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert "'a' is nan at step 1" in warnings[0]
    assert "'b' is inf at step 2" in warnings[1]
    a = _read_scalars(tmp_path)["a"]
    assert [s for s, _ in a] == [1, 2, 3]
    assert math.isnan(a[0][1]) and math.isnan(a[1][1]) and a[2][1] == -math.inf


def test_console_prints_one_compact_line_per_step_when_not_a_tty():
    out = io.StringIO()
    with MetricsLogger(None, backends=("console",), total_steps=5, stream=out) as logger:
        logger.log({"critic/score/mean": 0.5, "perf/throughput": 1234.5, "actor/pg_loss": 0.1}, step=1)
        logger.log({"critic/score/mean": 0.625, "perf/throughput": 123456.7}, step=2)
    lines = out.getvalue().splitlines()
    assert lines[0] == "step 1/5 | eta ? | critic/score/mean=0.5 | perf/throughput=1234"
    assert re.fullmatch(
        r"step 2/5 \| eta \d+:\d\d:\d\d \| critic/score/mean=0.625 \| perf/throughput=123457", lines[1]
    )
    assert len(lines) == 2


def test_console_without_total_steps_has_no_eta():
    out = io.StringIO()
    with MetricsLogger(None, backends=("console",), stream=out) as logger:
        logger.log({"x": 1.0}, step=1)
        logger.log({"x": 1.0}, step=2)
    assert out.getvalue().splitlines() == ["step 1 | eta ?", "step 2 | eta ?"]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_console_draws_a_progress_bar_on_a_terminal():
    out = _Terminal()
    with MetricsLogger(None, backends=("console",), total_steps=4, stream=out) as logger:
        logger.log({"critic/score/mean": 0.5}, step=1)
        logger.log({"critic/score/mean": 0.75, "perf/throughput": 99.0}, step=3)
    text = out.getvalue()
    assert "\r" in text  # redrawn in place, not one line per step
    assert "3/4" in text
    assert "critic/score/mean=0.75 perf/throughput=99" in text


def test_close_is_idempotent_and_log_after_close_fails(tmp_path):
    logger = MetricsLogger(str(tmp_path))
    logger.close()
    logger.close()
    with pytest.raises(RuntimeError, match="after close"):
        logger.log({"x": 1.0}, step=1)


@pytest.mark.parametrize(
    "metrics, step, exc, match",
    [
        ({"x": torch.ones(2)}, 1, ValueError, r"metric 'x': expected a scalar tensor, got shape \[2\]"),
        ({"x": "high"}, 1, TypeError, "metric 'x': expected a number or a scalar tensor, got str"),
        ({"x": None}, 1, TypeError, "metric 'x'"),
        ({3: 1.0}, 1, TypeError, "metric name 3"),
        ({"x": 1.0}, -1, ValueError, "step: expected an int >= 0"),
        ({"x": 1.0}, 1.5, ValueError, "step: expected an int >= 0"),
    ],
)
def test_bad_metrics_or_step_name_the_problem(metrics, step, exc, match):
    with (
        MetricsLogger(None, backends=("console",), stream=io.StringIO()) as logger,
        pytest.raises(exc, match=match),
    ):
        logger.log(metrics, step=step)


def test_bad_construction_is_rejected(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"unknown \['swanlab'\]; valid backends are \['console', 'tensorboard', 'wandb', 'mlflow'\]",
    ):
        MetricsLogger(str(tmp_path), backends=("console", "swanlab"))
    with pytest.raises(ValueError, match="tensorboard backend needs a directory"):
        MetricsLogger(None)
    with pytest.raises(ValueError, match="total_steps"):
        MetricsLogger(None, backends=("console",), total_steps=0)


# --- wandb and mlflow -----------------------------------------------------------------------------

STEPS = {
    1: {"critic/score/mean": 0.5, "perf/throughput": 1000, "val/arithmetic/acc/mean@4": torch.tensor(0.25)},
    2: {"critic/score/mean": torch.tensor([0.75]), "perf/throughput": np.float32(1250.0),
        "val/arithmetic/acc/mean@4": 0.375},
    3: {"critic/score/mean": 1.0, "perf/throughput": float("nan")},
}
CONFIG = {"actor": {"lr": 1e-6, "clip_ratio_high": 0.28}, "trainer": {"logger": ["wandb", "mlflow"]}}
WANDB = "wandb is not installed (pip install 'megatron-dapo[wandb]'; the dev extra has it)"
MLFLOW = "mlflow is not installed (pip install 'megatron-dapo[mlflow]'; the dev extra has it)"


def _expected():
    """{name: [(step, value)]} of STEPS as floats."""
    out = {}
    for step, metrics in STEPS.items():
        for key, value in metrics.items():
            out.setdefault(key, []).append((step, float(value.reshape(()) if hasattr(value, "reshape") else value)))
    return out


def _same(a, b):
    """Equal (step, value) lists, NaN equal to NaN."""
    return len(a) == len(b) and all(sa == sb and (va == vb or (math.isnan(va) and math.isnan(vb)))
                                    for (sa, va), (sb, vb) in zip(a, b))


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason=WANDB)
    for var, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
                       "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_CACHE_DIR": str(tmp_path / "wc"),
                       "WANDB_DATA_DIR": str(tmp_path / "wd"), "WANDB_DISABLE_GIT": "true"}.items():
        monkeypatch.setenv(var, value)
    import wandb

    wandb.teardown()  # W&B reads its environment once per process, at setup: each test gets its own
    yield tmp_path / "run"
    wandb.teardown()


@pytest.fixture
def mlflow_file_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason=MLFLOW)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")     # MLflow 3 keeps the file store behind this flag
    return tmp_path / "mlruns"


def _wandb_records(run_dir):
    """Every record of the offline run's .wandb file: W&B's 7-byte header, then LevelDB log blocks of
    32 KiB whose records (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) hold protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:                     # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:                                   # zero padding up to the block end
            pos += block - pos % block
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _wandb_history(run_dir):
    out = {}
    for record in _wandb_records(run_dir):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}
            for key, value in items.items():
                if not key.startswith("_"):
                    out.setdefault(key, []).append((items["_step"], float(value)))
    return out


def _wandb_history_once_written(run_dir, keys, timeout_s: float = 60.0):
    """The offline run's history once it holds every key of `keys`, or as it is after `timeout_s` (W&B's
    service writes the run file; on a machine running two test workers it has once been read before the
    history reached it). The service's own log is printed for a history still short, to say why."""
    deadline = time.monotonic() + timeout_s
    while True:
        history = _wandb_history(run_dir)
        if history.keys() >= keys or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if not history.keys() >= keys:
        for log in run_dir.glob("wandb/offline-run-*/logs/debug-internal.log"):
            print(f"{log}:\n{log.read_text(errors='replace')[-6000:]}")
    return history


def test_wandb_offline_run_holds_every_step_value_and_the_config(wandb_offline):
    with MetricsLogger(None, backends=("wandb",), project="proj", experiment="exp", wandb_dir=str(wandb_offline),
                       config=CONFIG) as logger:
        (sink,) = logger._sinks
        # W&B's 30 s for its service to start failed this test once on a loaded machine: the sink gives 300 s
        assert sink._run.settings.x_service_wait == WANDB_SERVICE_WAIT_S == 300
        for step, metrics in STEPS.items():
            logger.log(metrics, step=step)
    history = _wandb_history_once_written(wandb_offline, _expected().keys())
    assert history.keys() == _expected().keys()
    assert all(_same(history[k], v) for k, v in _expected().items()), history
    (run,) = [r.run for r in _wandb_records(wandb_offline) if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("proj", "exp")
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["actor"] == CONFIG["actor"] and config["trainer"] == CONFIG["trainer"]


def test_wandb_service_wait_set_by_the_user_rules(wandb_offline, monkeypatch):
    monkeypatch.setenv("WANDB__SERVICE_WAIT", "45")
    with MetricsLogger(None, backends=("wandb",), project="proj", wandb_dir=str(wandb_offline)) as logger:
        (sink,) = logger._sinks
        assert sink._run.settings.x_service_wait == 45


def _mlflow_history(names):
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    metrics = {name: [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, name),
                                                         key=lambda m: m.step)] for name in names}
    return run, metrics


def test_mlflow_run_holds_every_step_value_and_the_config_as_params(mlflow_file_store):
    with MetricsLogger(None, backends=("mlflow",), project="proj", experiment="exp", config=CONFIG) as logger:
        for step, metrics in STEPS.items():
            logger.log(metrics, step=step)
    expected = {mlflow_name(k): v for k, v in _expected().items()}
    assert "val/arithmetic/acc/mean_at_4" in expected      # the one name MLflow cannot hold as it is
    run, history = _mlflow_history(expected)
    assert all(_same(history[k], v) for k, v in expected.items()), history
    assert set(run.data.metrics) == set(expected)
    assert run.info.run_name == "exp" and run.info.status == "FINISHED"
    assert run.data.params == {"actor.lr": "1e-06", "actor.clip_ratio_high": "0.28",
                               "trainer.logger": "['wandb', 'mlflow']"}


def test_every_backend_gets_the_same_names_and_values(tmp_path, wandb_offline, mlflow_file_store):
    with MetricsLogger(str(tmp_path / "tb"), backends=("tensorboard", "wandb", "mlflow"), project="proj",
                       experiment="exp", wandb_dir=str(wandb_offline)) as logger:
        for step, metrics in STEPS.items():
            logger.log(metrics, step=step)
    tensorboard = _read_scalars(tmp_path / "tb")
    wandb = _wandb_history_once_written(wandb_offline, _expected().keys())  # read once the service wrote it
    _, mlflow = _mlflow_history([mlflow_name(k) for k in tensorboard])
    assert tensorboard.keys() == wandb.keys() == _expected().keys()
    for key, values in tensorboard.items():
        # TensorBoard stores float32; W&B and MLflow keep the float64 written.
        assert all(_same([(s, float(np.float32(v))) for s, v in other[name]], values)
                   for other, name in ((wandb, key), (mlflow, mlflow_name(key))))


def test_mlflow_names_that_would_collide_are_an_error(mlflow_file_store):
    with MetricsLogger(None, backends=("mlflow",), project="proj") as logger:
        with pytest.raises(ValueError, match=r"metrics 'acc@1' and 'acc_at_1' both become MLflow metric 'acc_at_1'"):
            logger.log({"acc@1": 1.0, "acc_at_1": 0.5}, step=1)


@pytest.mark.parametrize("backend", ["wandb", "mlflow"])
def test_a_missing_optional_package_names_the_extra(backend, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, backend, None)      # import fails as if it were not installed
    monkeypatch.setitem(sys.modules, f"{backend}.tracking", None)
    with pytest.raises(ImportError, match=rf"the '{backend}' backend needs the {backend} package.*"
                                          rf"pip install 'megatron-dapo\[{backend}\]'"):
        MetricsLogger(str(tmp_path), backends=("tensorboard", backend))
    assert not list(tmp_path.iterdir())                 # failed before any sink wrote a file
