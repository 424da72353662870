"""Run the Triton kernels in Triton's interpreter when there is no CUDA.

Triton reads TRITON_INTERPRET once, when it is imported, so this conftest sets it at import time,
before any test module here imports triton. That works as long as nothing collected earlier in
the same pytest process imported triton (megatron.core does); the `triton_device` fixture fails
with the fix if it did. With CUDA the variable is left alone and the same tests run the compiled
kernels on CUDA tensors, so `pytest tests/` on a GPU machine compiles everywhere, tests/gpu too.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def triton_device() -> torch.device:
    """Where backend="triton" runs in this process: compiled on CUDA, else the interpreter on CPU."""
    from megatron_dapo.kernels import logprob_entropy

    if logprob_entropy.triton is None:
        pytest.fail(f"triton failed to import: {logprob_entropy.TRITON_IMPORT_ERROR!r}")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not logprob_entropy._interpreting():
        pytest.fail(
            "triton was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1 (a module "
            "collected earlier imports it, e.g. through megatron.core); set TRITON_INTERPRET=1 in the "
            "environment or in tests/conftest.py when CUDA is unavailable"
        )
    return torch.device("cpu")
