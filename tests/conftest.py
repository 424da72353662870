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


def pytest_collection_modifyitems(config, items):
    import torch

    has_cuda = torch.cuda.is_available()
    for item in items:
        if _GPU_DIR in pathlib.Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)
            if not has_cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))
