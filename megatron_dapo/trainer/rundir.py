"""One trainer per run directory: a second job started on the same directory refuses before it writes anything.

The job's global rank 0 takes an exclusive `flock` on `<dir>/.megatron_dapo.lock` for the run directory
and the checkpoint directory (when that lies elsewhere) and holds it until `release_run_directories` (the
end of the run) or its death: the kernel drops the lock with the process, so a crashed or SIGKILLed run
never leaves a stale lock behind. The file says who holds it (pid, host, start time, command line), which
the refusal quotes. flock works on local file systems and NFSv4; Lustre needs the `flock` mount option.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time

LOCK_NAME = ".megatron_dapo.lock"

_held: dict[str, int] = {}  # real path of a lock file -> the descriptor that holds it


class RunDirectoryInUse(RuntimeError):
    """Another live trainer holds the directory's lock; the message names it."""


def lock_run_directory(path: str) -> str:
    """Take the lock of directory `path` (created if missing) for this process; returns the lock file.
    Taking it again in the same process is a no-op."""
    os.makedirs(path, exist_ok=True)
    lock = os.path.realpath(os.path.join(path, LOCK_NAME))
    if lock in _held:
        return lock
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder_text(fd)
        os.close(fd)
        raise RunDirectoryInUse(f"{path} is in use by another trainer ({holder}); stop it, or give this run its "
                                "own trainer.output_dir / trainer.experiment_name (trainer.default_local_dir for "
                                "checkpoints)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv}).encode(), 0)
    _held[lock] = fd
    return lock


def _holder_text(fd: int) -> str:
    """What the lock file's holder wrote of itself (pid, host, start time, command line)."""
    return os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process that wrote nothing yet"


def release_run_directories() -> None:
    """Drop every lock this process holds (the end of the run)."""
    while _held:
        _, fd = _held.popitem()
        os.close(fd)  # closing the descriptor releases the flock


def holder(path: str) -> str | None:
    """Who holds directory `path`'s lock (its lock file's text), or None when no live trainer does. Takes
    nothing: the preflight asks before a job starts."""
    lock = os.path.join(path, LOCK_NAME)
    if not os.path.isfile(lock) or os.path.realpath(lock) in _held:
        return None
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder_text(fd)
    finally:
        os.close(fd)  # also drops the shared lock when it was taken
    return None
