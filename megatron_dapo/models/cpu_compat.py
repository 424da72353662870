"""The CPU compatibility layer: makes megatron-core 0.16.x run on a CPU-only PyTorch (gloo).

This is the ONE place that patches anything. Each shim below names the error it prevents;
/work/shared/notes/megatron-on-cpu.md has the measurements behind every entry. Everything
else the CPU path needs is a config choice, made in `builder.py`:
`use_cpu_initialization=True`, `moe_grouped_gemm=False` (GroupedMLP needs CUDA grouped_gemm),
bias-free linears for MoE (SequentialMLP adds its bias in place on a view), sequence parallel
for MoE with TP (Megatron's own validation), a norm that supports sequence parallel
(`builder.TorchNorm`), and `batch_p2p_comm=False` for interleaved pipelines.

Usage: `install()` once per process before building a model (it is idempotent; the workers'
`init_parallel` calls it for the gloo backend). It enters `CudaToCpuMode` for the calling thread
only: a TorchFunctionMode is thread-local, so a thread that calls Megatron (for example a
threaded Ray actor) must run `enter_device_mode()` or use `with CudaToCpuMode(): ...`.
Never call it in a process that uses CUDA: it replaces torch.cuda entry points process-wide.

Cost: CudaToCpuMode adds nothing measurable to a b8 x s128 fwd+bwd and ~17% to a KV-cache
decode loop of tiny per-token ops (notes, section "Cost of devmode").
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
import time

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["install", "is_installed", "enter_device_mode", "CudaToCpuMode", "check_required_packages"]

_LOCK = threading.Lock()
_INSTALLED = False
_THREAD = threading.local()      # .mode: the CudaToCpuMode entered by enter_device_mode()


# --- shim "streams": torch.cuda.Stream/Event/current_stream/stream -> CPU stand-ins ----------
# Prevents: "RuntimeError: torch.cuda.Stream requires CUDA support" when MoELayer builds the
# alltoall token dispatcher (token_dispatcher.py:445), and "Tried to instantiate dummy base class
# Event" in the inference engines. The Event keeps wall-clock time so elapsed_time() works.
class _CpuEvent(torch.cpu.Event):
    def __init__(self, *args, **kwargs):     # accepts enable_timing=..., blocking=...
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()

    def elapsed_time(self, end_event) -> float:
        return (end_event._t - self._t) * 1000.0


class _CpuStream(torch.cpu.Stream):
    def record_event(self, event=None):
        event = event if event is not None else _CpuEvent()
        event.record()
        return event


def _patch_torch_cuda_api() -> None:
    # shim "curdev": RoPE moves inv_freq to torch.cuda.current_device() on every forward
    # (rotary_pos_embedding.py:162) and p2p / MTP / inference pass it as device=.
    # Prevents: "AssertionError: Torch not compiled with CUDA enabled". Returns "cpu".
    torch.cuda.current_device = torch.cpu.current_device
    # shim "sync": dist_checkpointing's writer (filesystem_async.py:230) and PP p2p with
    # batch_p2p_sync=True (p2p_communication.py:398) call torch.cuda.synchronize().
    # Prevents: "AssertionError: Torch not compiled with CUDA enabled".
    torch.cuda.synchronize = torch.cpu.synchronize
    # shim "streams" (classes above).
    torch.cuda.Stream, torch.cuda.Event = _CpuStream, _CpuEvent
    torch.cuda.current_stream = lambda *a, **k: _CpuStream()
    torch.cuda.stream = torch.cpu.stream
    # shim "nvtx": the dynamic inference engine brackets steps with NVTX ranges.
    # Prevents: "RuntimeError: NVTX functions not installed".
    import torch.cuda.nvtx as nvtx
    nvtx.range_push = lambda *a, **k: None
    nvtx.range_pop = lambda *a, **k: None
    nvtx.range = lambda *a, **k: contextlib.nullcontext()


def _patch_megatron() -> None:
    # shim "tegemm": moe_utils references te_general_gemm without defining it when Transformer
    # Engine is absent (a Megatron bug). Prevents, in every MoE router forward:
    # "NameError: name 'te_general_gemm' is not defined" (moe_utils.py:1192).
    import megatron.core.transformer.moe.moe_utils as moe_utils
    moe_utils.te_general_gemm = None

    # shim "a2asplits": the alltoall dispatcher turns its split sizes into numpy only when it
    # moves them off a *cuda* tensor; CPU tensors stay tensors. Prevents, with EP > 1:
    # "TypeError: all_to_all_single(): incompatible function arguments".
    import megatron.core.transformer.moe.token_dispatcher as td
    if not getattr(td.maybe_move_tensor_to_cpu, "_megatron_dapo_shim", False):
        original = td.maybe_move_tensor_to_cpu

        def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
            if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
                return tensor.numpy()
            return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

        maybe_move_tensor_to_cpu._megatron_dapo_shim = True
        td.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    # shim "rng" (public API, no patch): Megatron's default tracker needs
    # torch.cuda.get_rng_state, which a CPU build cannot provide. The inference tracker's fork()
    # is a nullcontext. Prevents: "Exception: cuda rng state model-parallel-rng is not added"
    # (random.py:248). Side effect: dropout inside TP regions uses the CPU default generator
    # (our models use dropout 0). `builder.build_gpt_model` re-seeds with the same tracker kind.
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    # shim "ckptrng": full activation recompute (model.recompute=full) saves the CUDA generator's state
    # before a checkpointed forward and restores it around the recompute (CheckpointFunction,
    # random.py:_get_all_rng_states / _set_all_rng_states). Prevents, in the first training forward:
    # "AssertionError: Torch not compiled with CUDA enabled" (random.py:55). On CPU there is no CUDA
    # generator: an empty state is saved and setting it does nothing; the CPU generator's state, which
    # the same functions save and restore, is the one the recompute uses.
    import megatron.core.tensor_parallel.random as mrandom
    if not getattr(mrandom._get_cuda_rng_state, "_megatron_dapo_shim", False):
        def _get_cuda_rng_state(*args, **kwargs):
            return torch.empty(0, dtype=torch.uint8)

        def _set_cuda_rng_state(*args, **kwargs):
            return None

        _get_cuda_rng_state._megatron_dapo_shim = True
        mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = _get_cuda_rng_state, _set_cuda_rng_state

    # shim "recompute": the recomputed forward runs inside the backward pass, which the device mode's own
    # handler of torch.autograd.backward started (a TorchFunctionMode is off inside its handler), so the
    # layers' device="cuda" (transformer/utils.get_default_causal_mask) would reach torch unrewritten.
    # Prevents "Torch not compiled with CUDA enabled" in the first backward with model.recompute=full:
    # the checkpoint's backward runs under a CudaToCpuMode of its own.
    backward = mrandom.CheckpointFunction.backward
    if not getattr(backward, "_megatron_dapo_shim", False):
        def checkpoint_backward(ctx, *args):
            with CudaToCpuMode():
                return backward(ctx, *args)

        checkpoint_backward._megatron_dapo_shim = True
        mrandom.CheckpointFunction.backward = staticmethod(checkpoint_backward)


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)   # device=0 means cuda:0


class CudaToCpuMode(TorchFunctionMode):
    """shim "devmode" (+ "typestr"): rewrite CUDA placements to CPU inside Megatron calls.

    - `device="cuda"` / an int device -> "cpu"; `.cuda()` and `.pin_memory()` -> no-ops;
      `pin_memory=True` -> False; `.to("cuda")` -> `.to("cpu")`.
      Prevents "Torch not compiled with CUDA enabled" from hard-coded device="cuda" in every
      pipeline schedule (schedules.py:596/983/2138, so forward_backward_func needs it even at
      PP=1), FP32Optimizer / MixedPrecisionOptimizer (optimizer.py:473-485, 907), clip_grads.py,
      transformer/utils.get_default_causal_mask (attention without an explicit mask) and the
      text-generation controller; and "pin_memory=True requires a CUDA backend" (dynamic engine).
    - "typestr": a CPU `tensor.type()` reports 'torch.cuda.FloatTensor' etc. Prevents
      "assert param.grad.type() == 'torch.cuda.FloatTensor'" (clip_grads.py:167) and the
      optimizers' "TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor, ...".

    Thread-local: enter it in every thread that calls Megatron.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        if func is torch.Tensor.type:
            if len(args) == 1 and not kwargs:
                name = func(*args)
                return name if args[0].is_cuda else name.replace("torch.", "torch.cuda.", 1)
            if len(args) > 1 and isinstance(args[1], str):
                args = (args[0], args[1].replace("torch.cuda.", "torch.")) + tuple(args[2:])
        return func(*args, **kwargs)
        return func(*args, **kwargs)


def enter_device_mode() -> CudaToCpuMode:
    """Enter CudaToCpuMode for the calling thread for the rest of its life (idempotent)."""
    mode = getattr(_THREAD, "mode", None)
    if mode is None:
        mode = CudaToCpuMode()
        mode.__enter__()
        _THREAD.mode = mode
    return mode


def check_required_packages() -> None:
    """Fail early on a missing package whose absence Megatron does not report.

    psutil: dist_checkpointing's forked writer calls psutil in _process_memory(); without it the
    writer dies and `dist_checkpointing.save` hangs forever with no error (notes, item 5).
    """
    if importlib.util.find_spec("psutil") is None:
        raise ImportError("psutil is required: without it Megatron's dist_checkpointing.save "
                          "hangs silently (its writer process dies); pip install psutil")


def is_installed() -> bool:
    return _INSTALLED


def install(device_mode: bool = True) -> None:
    """Apply every shim once per process (later calls change nothing) and, unless
    device_mode=False, enter CudaToCpuMode for the calling thread."""
    global _INSTALLED
    with _LOCK:
        if not _INSTALLED:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                raise RuntimeError(
                    "cpu_compat.install() would replace torch.cuda entry points in a process "
                    "that already uses CUDA; run CPU models in a separate process")
            check_required_packages()
            _patch_torch_cuda_api()
            _patch_megatron()
            _INSTALLED = True
    if device_mode:
        enter_device_mode()
