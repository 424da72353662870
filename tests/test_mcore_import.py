"""megatron_dapo.mcore_import: Megatron-Core imports without TorchDynamo and wandb, and a function
decorated with the deferred torch.compile is compiled once, at its first call, with its arguments."""

from __future__ import annotations

import json
import subprocess
import sys

from megatron_dapo.mcore_import import deferred_compile

_PROBE = """
import json, sys
import megatron_dapo
import megatron.core
import megatron.core.jit
import torch
out = {"dynamo": "torch._dynamo" in sys.modules, "wandb": "wandb" in sys.modules,
       "fuser_deferred": megatron.core.jit.jit_fuser.__name__ == "compile_later",
       "torch_compile_restored": torch.compile.__module__ == "torch"}
import wandb  # megatron saw it missing; it is importable again afterwards
out["wandb_importable"] = hasattr(wandb, "init")
print(json.dumps(out))
"""


def test_megatron_core_imports_without_dynamo_or_wandb_and_torch_compile_is_restored():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"dynamo": False, "wandb": False, "fuser_deferred": True, "torch_compile_restored": True,
                   "wandb_importable": True}


def test_deferred_compile_compiles_once_at_the_first_call_with_the_decorators_arguments():
    calls = []

    def fake_compile(fn, **kwargs):
        calls.append((fn.__name__, kwargs))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    compile_later = deferred_compile(fake_compile)

    @compile_later
    def plain(x):
        return x + 1

    @compile_later(mode="max-autotune", dynamic=False)
    def with_args(x, *, y):
        return x * y

    assert calls == [] and plain.__name__ == "plain" and with_args.__name__ == "with_args"
    assert plain(1) == ("compiled", 2) and plain(2) == ("compiled", 3)
    assert with_args(3, y=4) == ("compiled", 12)
    assert calls == [("plain", {}), ("with_args", {"mode": "max-autotune", "dynamic": False})]


def test_a_process_that_imported_megatron_first_is_left_alone():
    probe = ("import sys, megatron.core, megatron_dapo; import megatron.core.jit as j, torch; "
             "print(j.jit_fuser is torch.compile)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "True"
