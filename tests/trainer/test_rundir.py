"""One trainer per run directory (trainer/rundir.py): a live holder refuses the second, a dead one does not."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest

from megatron_dapo.trainer import rundir

ROOT = pathlib.Path(__file__).resolve().parents[2]
HOLD = ("import sys, time; from megatron_dapo.trainer.rundir import lock_run_directory; "
        "lock_run_directory(sys.argv[1]); print('locked', flush=True); time.sleep(600)")


def _holder(directory) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_live_trainer_s_directory_is_refused_naming_it_and_freed_when_it_dies(tmp_path):
    other = _holder(tmp_path)
    try:
        with pytest.raises(rundir.RunDirectoryInUse, match=rf'{tmp_path} is in use by another trainer \(\{{"pid": '
                                                           rf'{other.pid}, "host": .*trainer.output_dir'):
            rundir.lock_run_directory(str(tmp_path))
    finally:
        other.send_signal(signal.SIGKILL)  # no clean-up: the kernel drops the lock with the process
        other.wait()
    try:
        lock = rundir.lock_run_directory(str(tmp_path))
        assert rundir.lock_run_directory(str(tmp_path)) == lock  # again in the same process: a no-op
        assert f'"pid": {os.getpid()}' in pathlib.Path(lock).read_text()
    finally:
        rundir.release_run_directories()
    again = _holder(tmp_path)  # released: another process takes it
    again.kill()
    again.wait()


def test_the_trainer_refuses_before_writing_anything_in_a_directory_in_use(tmp_path):
    from megatron_dapo.config import load_config
    from megatron_dapo.trainer.run import build_trainer

    cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), [f"trainer.output_dir={tmp_path}"])
    other = _holder(cfg.run_dir)
    try:
        with pytest.raises(rundir.RunDirectoryInUse, match=str(other.pid)):
            build_trainer(cfg)
        assert sorted(p.name for p in pathlib.Path(cfg.run_dir).iterdir()) == [rundir.LOCK_NAME]  # no config.yaml
    finally:
        other.kill()
        other.wait()
