"""`exit_process`, how `python -m megatron_dapo.train` and the tests' rank scripts end: everything the
interpreter's own exit does before its teardown happens (non-daemon threads joined, an idle thread pool's
workers released, atexit handlers, logging flushed, stdout flushed), the exit code kept, and the teardown
itself (module cleanup, the finalizers of objects still alive) skipped."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.sglang_real.conftest import ROOT

CHILD = textwrap.dedent("""
    import atexit, concurrent.futures, logging, sys, threading, time
    from megatron_dapo.trainer.run import exit_process, freeze_startup_objects

    out = sys.argv[1]
    freeze_startup_objects()  # as a trainer process does: the gc.unfreeze atexit handler is registered
    log = logging.getLogger("child")
    log.addHandler(logging.FileHandler(f"{out}/log.txt", delay=False))
    log.setLevel(logging.INFO)
    log.info("a line a FileHandler buffers until logging's atexit flush")

    def late_writer():
        time.sleep(0.5)
        with open(f"{out}/thread.txt", "w") as f:
            f.write("joined")

    threading.Thread(target=late_writer).start()  # non-daemon: the exit waits for it
    pool = concurrent.futures.ThreadPoolExecutor(2)
    pool.submit(lambda: 1).result()  # an idle pool: its workers must be released, not waited on forever
    atexit.register(lambda: open(f"{out}/atexit.txt", "w").write("ran"))

    class Finalized:
        def __del__(self):
            open(f"{out}/teardown.txt", "w").write("ran")

    kept = Finalized()  # alive until the teardown, which exit_process skips
    sys.stdout.write("no newline, still in the buffer")
    exit_process(3)
""")


def test_exit_process_runs_what_exit_runs_keeps_the_code_and_skips_the_teardown(tmp_path):
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 3, r.stderr[-3000:]
    assert r.stdout == "no newline, still in the buffer"
    assert (tmp_path / "thread.txt").read_text() == "joined"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert (tmp_path / "log.txt").read_text() == "a line a FileHandler buffers until logging's atexit flush\n"
    assert not (tmp_path / "teardown.txt").exists()  # the teardown was skipped
    assert "leaked" not in r.stderr  # nanobind's leak report comes from the teardown only


def test_python_m_train_exits_through_it_with_its_code(tmp_path):
    """A config error's exit code 2 and its one line come out of `python -m megatron_dapo.train` as before."""
    r = subprocess.run([sys.executable, "-m", "megatron_dapo.train", "--config", "configs/tiny_cpu.yaml",
                        "actor.lr=fast"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "actor.lr" in r.stderr, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "megatron_dapo.train", "--config", "configs/tiny_cpu.yaml",
                        "--print-config"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "actor:" in r.stdout and r.stdout.endswith("\n"), r.stderr[-2000:]
