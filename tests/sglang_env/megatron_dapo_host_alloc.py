"""Lets SGLang 0.5.23's routed-experts capture (--enable-return-routed-experts) start on a CPU-only torch, in the
test venv only (loaded by a .pth).

Why: the capture keeps a host buffer of every token's routed experts (sglang/srt/state_capturer/base.py,
BaseHostCache), allocated through `ALLOC_MEMORY_FUNCS[device]` of sglang/srt/mem_cache/pool_host/common.py.
For any device but npu / musa / xpu that is `alloc_with_host_register`, which pins the buffer with
`torch.cuda.cudart().cudaHostRegister`: on a CPU build torch raises "Torch not compiled with CUDA enabled"
and the scheduler dies at start-up. This hook maps device "cpu" to a plain host allocation once that
module is imported: on a CPU server the buffer is already where the reply reads it, so pinning (which
only speeds device-to-host copies) has nothing to do. GPU servers never take this path.
"""

import importlib.abc
import importlib.util
import sys

_MODULE = "sglang.srt.mem_cache.pool_host.common"


def _plain_host_tensor(dims, dtype, device, pin_memory, allocator=None, registration_granularity_bytes=None):
    import torch

    return torch.empty(dims, dtype=dtype, device="cpu")


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        module.ALLOC_MEMORY_FUNCS["cpu"] = _plain_host_tensor


class _PlainCpuHostAlloc(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    if not any(isinstance(f, _PlainCpuHostAlloc) for f in sys.meta_path):
        sys.meta_path.insert(0, _PlainCpuHostAlloc())
