"""The trainer's log keeps to what a user acts on: Megatron-Core's import-time fallback notices and its INFO
lines are dropped in the training process and in the processes it starts (trainer/run.py quiet_libraries)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

from megatron_dapo.trainer.run import quiet_libraries


def test_megatrons_notices_are_dropped_here_and_in_child_processes(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "default::ResourceWarning")  # a user's own setting is kept
    monkeypatch.setattr(logging.getLogger("megatron.core"), "level", logging.NOTSET)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_libraries()
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", stacklevel=1)
        warnings.warn("Apex is not installed. Falling back to Torch Norm", stacklevel=1)
        warnings.warn("a warning of our own", stacklevel=1)
    assert [str(w.message) for w in seen] == ["a warning of our own"]
    assert not logging.getLogger("megatron.core.distributed.param_and_grad_buffer").isEnabledFor(logging.INFO)
    assert logging.getLogger("megatron.core").isEnabledFor(logging.WARNING)
    child = subprocess.run([sys.executable, "-c", "import warnings; "
                            "warnings.warn('Transformer Engine and Apex are not installed. x'); "
                            "warnings.warn('kept')"], capture_output=True, text=True, check=True)
    assert "not installed" not in child.stderr and "kept" in child.stderr
    assert os.environ["PYTHONWARNINGS"].startswith("default::ResourceWarning,ignore:")
