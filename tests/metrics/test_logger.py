"""MetricsLogger: TensorBoard events read back with tensorboard's own reader, console output, errors."""

import io
import logging
import math
import re

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_dapo.metrics.logger import MetricsLogger


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
        ValueError, match=r"unknown \['wandb'\]; valid backends are \['console', 'tensorboard'\]"
    ):
        MetricsLogger(str(tmp_path), backends=("console", "wandb"))
    with pytest.raises(ValueError, match="tensorboard backend needs a directory"):
        MetricsLogger(None)
    with pytest.raises(ValueError, match="total_steps"):
        MetricsLogger(None, backends=("console",), total_steps=0)
