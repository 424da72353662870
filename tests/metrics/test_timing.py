"""Stage timers (with a fake clock) and the timing / throughput metrics."""

import pytest

from megatron_dapo.metrics.timing import (
    StageTimer,
    compute_throughout_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    timer,
)


class FakeClock:
    """Returns the scripted readings in order, so elapsed times are exact."""

    def __init__(self, *readings):
        self.readings = list(readings)

    def __call__(self):
        return self.readings.pop(0)


def test_gen_is_normalised_by_response_tokens_and_other_stages_by_all_tokens():
    m = compute_timing_metrics(
        timings_s={"gen": 2.0, "update_actor": 3.0, "step": 6.0},
        num_prompt_tokens=1000,
        num_response_tokens=3000,
    )
    assert m == pytest.approx(
        {
            "timing_s/gen": 2.0,
            "timing_s/update_actor": 3.0,
            "timing_s/step": 6.0,
            "timing_per_token_ms/gen": 2000.0 / 3000.0,
            "timing_per_token_ms/update_actor": 3000.0 / 4000.0,
            "timing_per_token_ms/step": 6000.0 / 4000.0,
        }
    )


def test_per_token_entry_is_dropped_when_its_token_count_is_zero():
    m = compute_timing_metrics(
        timings_s={"gen": 1.0, "ref": 0.5}, num_prompt_tokens=10, num_response_tokens=0
    )
    assert m == pytest.approx({"timing_s/gen": 1.0, "timing_s/ref": 0.5, "timing_per_token_ms/ref": 50.0})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(timings_s={"gen": -1.0}, num_prompt_tokens=1, num_response_tokens=1), r"timings_s\['gen'\]"),
        (
            dict(timings_s={"gen": float("nan")}, num_prompt_tokens=1, num_response_tokens=1),
            r"timings_s\['gen'\]",
        ),
        (dict(timings_s={}, num_prompt_tokens=-1, num_response_tokens=1), "num_prompt_tokens"),
        (dict(timings_s={}, num_prompt_tokens=1, num_response_tokens=2.5), "num_response_tokens"),
    ],
)
def test_timing_bad_inputs_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_timing_metrics(**kwargs)


def test_throughput_is_tokens_per_second_per_device():
    m = compute_throughout_metrics(total_num_tokens=12000, time_per_step_s=3.0, num_devices=4)
    assert m == {"perf/total_num_tokens": 12000.0, "perf/time_per_step": 3.0, "perf/throughput": 1000.0}


def test_throughput_alias_is_the_reference_function():
    assert compute_throughput_metrics is compute_throughout_metrics


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(total_num_tokens=10, time_per_step_s=0.0, num_devices=1), "time_per_step_s"),
        (dict(total_num_tokens=10, time_per_step_s=1.0, num_devices=0), "num_devices"),
        (dict(total_num_tokens=-5, time_per_step_s=1.0, num_devices=1), "total_num_tokens"),
        (dict(total_num_tokens=True, time_per_step_s=1.0, num_devices=1), "total_num_tokens"),
    ],
)
def test_throughput_bad_inputs_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_throughout_metrics(**kwargs)


def test_stage_timer_accumulates_repeated_stages_and_nests():
    t = StageTimer(clock=FakeClock(0.0, 1.0, 3.0, 10.0, 14.0, 20.0))
    with t("step"):  # 0.0 .. 20.0
        with t("gen"):  # 1.0 .. 3.0
            pass
        with t("gen"):  # 10.0 .. 14.0: dynamic sampling generates again in the same step
            pass
    assert t.timings_s == {"gen": 6.0, "step": 20.0}
    assert t.reset() == {"gen": 6.0, "step": 20.0}
    assert t.timings_s == {}


def test_timer_records_the_time_of_a_block_that_raises():
    timings = {}
    with pytest.raises(RuntimeError), timer("reward", timings, clock=FakeClock(5.0, 7.5)):
        raise RuntimeError("reward server down")
    assert timings == {"reward": 2.5}


def test_timer_synchronizes_before_each_clock_reading():
    events = []
    clock = FakeClock(0.0, 1.0)

    def read():
        events.append("clock")
        return clock()

    t = StageTimer(synchronize=lambda: events.append("sync"), clock=read)
    with t("update_actor"):
        events.append("work")
    assert events == ["sync", "clock", "work", "sync", "clock"]


def test_timer_default_clock_measures_real_time():
    timings = {}
    with timer("noop", timings):
        pass
    assert 0.0 <= timings["noop"] < 1.0


def test_timer_rejects_an_empty_name():
    with pytest.raises(ValueError, match="timer name"), timer("", {}):
        pass
