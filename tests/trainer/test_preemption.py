"""PreemptionWatch (trainer/preemption.py) in this process: what a signal records, Ctrl-C twice, the
handlers restored. The runs that a signal stops and resume: tests/trainer/test_fault_injection.py (one
process, the sync and the queue trainer) and tests/trainer/test_parallel_fit.py (two ranks)."""

from __future__ import annotations

import os
import signal

import pytest

from megatron_dapo.trainer.preemption import PreemptionWatch


def test_a_signal_is_recorded_not_acted_on_and_a_second_ctrl_c_stops_at_once():
    before = signal.getsignal(signal.SIGINT)
    watch = PreemptionWatch(("SIGINT", "SIGTERM"))
    try:
        assert watch.requested() is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert watch.received == "SIGTERM" and watch.requested() == "SIGTERM"
        os.kill(os.getpid(), signal.SIGINT)  # a first Ctrl-C after another signal is the second stop request
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the second stop request did not raise KeyboardInterrupt")
    finally:
        watch.close()
    assert signal.getsignal(signal.SIGINT) is before


def test_only_the_named_signals_are_taken_and_unknown_names_are_refused():
    before = signal.getsignal(signal.SIGUSR1)
    watch = PreemptionWatch(("SIGTERM",))
    try:
        assert signal.getsignal(signal.SIGUSR1) is before
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # repeated: still one stop request, nothing raised
        assert watch.requested() == "SIGTERM"
    finally:
        watch.close()
    with pytest.raises(ValueError, match=r"trainer.exit_signals: \['SIGHUP'\]"):
        PreemptionWatch(("SIGHUP",))
