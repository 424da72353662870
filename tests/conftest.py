"""Test-suite wiring: tests under tests/gpu get the `gpu` marker (and are skipped without CUDA)."""

import os
import pathlib

import pytest

# Deterministic, small thread count: CI has 2 cores and tests may run next to each other.
os.environ.setdefault("OMP_NUM_THREADS", "2")


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


# tryfirst: pytest-xdist's worker reads the xdist_group markers in its own collection hook (it appends the
# group to the test's id for --dist loadgroup), and that hook is registered after this conftest, so it runs
# first unless this one is asked to run before it.
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
