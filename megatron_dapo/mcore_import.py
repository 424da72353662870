"""Megatron-Core imports in about a second instead of three.

`import megatron.core` runs the package's `__init__`, which imports most of Megatron. Two things in it
cost more than the rest of Megatron together (measured with `python -X importtime` on the CI machine):
- **torch.compile at decoration time** (1.2 s): `megatron.core.jit.jit_fuser` is `torch.compile`, and
  the fused bias/activation functions are decorated with it when their modules load; the decoration
  alone imports TorchDynamo and Inductor. Here the decoration is deferred: the function is compiled
  with the same arguments at its first call, exactly when torch.compile would have compiled it anyway.
  `megatron.core.jit.jit_fuser` keeps the deferring decorator, so Megatron modules imported later defer
  too; every other `torch.compile` caller gets the real one.
- **wandb** (0.55 s where it is installed): Megatron's inference `dynamic_context` imports it for its
  own logging, which this trainer never uses. Our W&B logger imports wandb itself when configured.

Every process that imports Megatron pays the import once: each of a node's eight ranks, each checkpoint
converter, each of the test suite's hundreds of gloo processes (2-core CI: 4.2 s -> 2.2 s of CPU each,
torch included). `megatron_dapo/__init__.py` installs the finder, so it applies whichever module of
the project imports Megatron first; a process that imported `megatron.core` before `megatron_dapo`
imports it the usual way.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys

__all__ = ["install", "deferred_compile"]


def deferred_compile(real_compile):
    """A `torch.compile` that compiles at the first call: same arguments, same compiled function."""

    def compile_later(model=None, **kwargs):
        if model is None:  # @torch.compile(mode=..., dynamic=...)
            return lambda fn: compile_later(fn, **kwargs)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = real_compile(model, **kwargs)
            return compiled(*args, **kw)

        return call

    return compile_later


@contextlib.contextmanager
def _lean_import():
    import torch

    real_compile = torch.compile
    block_wandb = "wandb" not in sys.modules
    torch.compile = deferred_compile(real_compile)
    if block_wandb:
        sys.modules["wandb"] = None  # `import wandb` raises ImportError, which Megatron catches
    try:
        yield
    finally:
        torch.compile = real_compile
        if block_wandb and sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]


class _MegatronCoreFinder(importlib.abc.MetaPathFinder):
    """Finds `megatron.core` with the regular path finder and runs its `__init__` under `_lean_import`.
    One use: it leaves `sys.meta_path` as soon as it is asked for the package."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "megatron.core":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_lean(module):
            with _lean_import():
                exec_module(module)

        spec.loader.exec_module = exec_lean
        return spec


def install() -> None:
    """Import `megatron.core` lean from now on in this process (no-op once it is imported)."""
    if "megatron.core" in sys.modules or any(isinstance(f, _MegatronCoreFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _MegatronCoreFinder())
