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


_SGLANG_REAL_DIR = pathlib.Path(__file__).parent / "sglang_real"
# Real Ray clusters on one machine share /tmp/ray (its latest session, the address a driver finds): their
# tests run one at a time, on one pytest-xdist worker.
_RAY_FILES = {pathlib.Path(__file__).parent / f for f in
              ("launch/test_ray_job.py", "rollout/test_ray_pool.py", "rollout/test_ray_sglang.py")}


def pytest_collection_modifyitems(config, items):
    import torch

    has_cuda = torch.cuda.is_available()
    for item in items:
        path = pathlib.Path(str(item.fspath))
        if _SGLANG_REAL_DIR in path.parents:
            # one worker runs them all under pytest-xdist's loadgroup: the session's two servers start once
            item.add_marker(pytest.mark.xdist_group("sglang_real"))
        elif path in _RAY_FILES:
            item.add_marker(pytest.mark.xdist_group("ray"))
        if _GPU_DIR in path.parents:
            item.add_marker(pytest.mark.gpu)
            if not has_cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))
