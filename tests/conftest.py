"""Test-suite wiring: tests under tests/gpu get the `gpu` marker (and are skipped without CUDA); the
pytest-xdist groups; each test's CPU seconds (its process and the child processes it waited for: servers,
torchrun jobs) recorded as the `cpu_s` property (in --junitxml) and, with --durations, the tests that used
the most CPU listed at the end: on 2 cores the suite's time is its CPU, not its slowest test. A process is
counted when it is waited for: the session's shared servers land on the test whose teardown stops them."""

import os
import pathlib
import resource

import pytest

# One intra-op thread per process (the test processes and every process they start inherit it): the suite
# runs two pytest-xdist workers and their servers and ranks on 2 cores, where a second OpenMP thread only
# spins. Measured alone on this machine: tests/trainer/test_fit.py 18.2 s of CPU at 2 threads, 14.1 s at 1,
# in the same wall time; tests/kernels 49.3 s and 45.6 s of wall at 2, 43.5 s and 42.2 s at 1.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# Triton reads TRITON_INTERPRET once, at its first import (megatron.core imports triton): set it
# before anything is collected, so the kernel tests run the interpreter on CPU-only machines.
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_GPU_DIR = pathlib.Path(__file__).parent / "gpu"


_SHARED_SERVERS = "real_servers"
"""The fixture of tests/sglang_real that starts two real SGLang servers once per pytest process."""
# Real Ray clusters on one machine share /tmp/ray (its latest session, the address a driver finds): their
# tests run one at a time, on one pytest-xdist worker.
_RAY_FILES = {pathlib.Path(__file__).parent / f for f in
              ("launch/test_ray_job.py", "rollout/test_ray_pool.py", "rollout/test_ray_sglang.py")}


# pytest-xdist's worker reads the xdist_group markers in its own collection hook, after this one, and appends
# the group to each test's id for --dist loadgroup; pytest 9.2 no longer reads the attribute it writes (the
# groups are silently dropped: pytest-xdist issue 1386), so the dev extras keep pytest below 9.2.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    import torch

    has_cuda = torch.cuda.is_available()
    for item in items:
        path = pathlib.Path(str(item.fspath))
        if _SHARED_SERVERS in getattr(item, "fixturenames", ()):
            # one worker runs every test of the session's two servers, so they start once; the tests that
            # launch their own servers run on either worker beside them
            item.add_marker(pytest.mark.xdist_group("sglang_shared_servers"))
        elif path in _RAY_FILES:
            item.add_marker(pytest.mark.xdist_group("ray"))
        if _GPU_DIR in path.parents:
            item.add_marker(pytest.mark.gpu)
            if not has_cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))



def pytest_configure(config):
    """Refuse --dist loadgroup where pytest-xdist cannot apply the groups: it marks a grouped test by
    rewriting the test's `_nodeid`, which pytest 9.2's `nodeid` no longer reads (pytest-xdist issue 1386);
    the shared servers would then start on every worker and the Ray tests meet in /tmp/ray, silently."""
    from _pytest.nodes import Node

    if getattr(config.option, "dist", "no") == "loadgroup" and "_nodeid" not in Node.nodeid.fget.__code__.co_names:
        raise pytest.UsageError(f"pytest {pytest.__version__}: pytest-xdist's --dist loadgroup cannot group tests "
                                "with it (the project's dev extras pin pytest<9.2)")


def _cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_CPU_AT_START] = _cpu_s()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "teardown" and _CPU_AT_START in item.stash:  # before the teardown report copies the properties
        item.user_properties.append(("cpu_s", round(_cpu_s() - item.stash[_CPU_AT_START], 2)))
        left = _children_alive()
        if left:  # a process a test left running spends CPU beside the tests after it
            item.user_properties.append(("children_alive", left))
    yield


def _children_alive() -> str:
    """This process's live children after a test, as `pid:name`."""
    import psutil

    alive = []
    for child in psutil.Process().children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{child.pid}:{' '.join(child.cmdline()[:3])[:80]}")
        except psutil.Error:
            pass
    return ", ".join(alive)


_CPU_AT_START = pytest.StashKey[float]()
_CPU_BY_TEST: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if report.when == "teardown":  # on the pytest-xdist controller too: the reports carry the properties
        for name, value in report.user_properties:
            if name == "cpu_s":
                _CPU_BY_TEST[report.nodeid] = value


def pytest_terminal_summary(terminalreporter, config):
    if not config.option.durations or not _CPU_BY_TEST:
        return
    most = sorted(_CPU_BY_TEST.items(), key=lambda kv: -kv[1])[:config.option.durations]
    terminalreporter.write_sep("=", f"most CPU, {len(most)} tests (with the processes they waited for; "
                                    f"{sum(_CPU_BY_TEST.values()):.0f} s in all)")
    for nodeid, seconds in most:
        terminalreporter.write_line(f"{seconds:8.1f}s cpu  {nodeid}")

