"""The trainer's GPU memory around colocated rollout: what every rank gives back before the SGLang servers
on its GPU take their memory again, and takes back before the update.

Per step, colocated (trainer/fit.py, the SGLang weight push in rollout/sglang/build.py):

    generation -> servers release weights + KV cache -> reclaim_for_training -> update
    -> free_for_rollout -> servers resume weights -> weight sync -> servers resume KV cache

free_for_rollout: the optimizer state to host memory (actor.offload_optimizer), then gc.collect() (tensors
only a reference cycle still holds) and torch.cuda.empty_cache(), so the allocator's cached blocks (the
training peak: activations, the LM head's working memory, the gathered log-probs) go back to the driver
before torch_memory_saver maps the servers' pages again. What stays is the trainer's steady state, which
the servers' KV pool was planned against (plan/memory.py; the launch caps the pool at that figure).

reclaim_for_training: the optimizer state back onto the GPU (when offloaded).

Offloaded are the tensors of the optimizer state on an accelerator: Adam's moments and, for bf16
parameters, the fp32 master copies (separate tensors; an fp32 parameter is its own master and stays).
They go to pinned host buffers allocated once and reused every step; a CPU run has nothing to move.
"""

from __future__ import annotations

import gc

import torch

GIB = 2**30


def _inner_optimizers(optimizer) -> list:
    """The torch optimizers under a Megatron optimizer (chained: one per parameter kind)."""
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


class OptimizerOffload:
    """Moves a Megatron optimizer's state between its device and pinned host buffers."""

    def __init__(self, optimizer, *, masters: bool):
        """masters: also move the param groups' tensors (the fp32 master copies of bf16 parameters)."""
        self.optimizer, self.masters = optimizer, masters
        self._host: dict[tuple[int, str], torch.Tensor] = {}  # pinned buffers, reused every step
        self._device: dict[tuple[int, str], torch.device] = {}
        self.offloaded = False

    def _slots(self):
        """(key, get, set) for every tensor this offload may move."""
        for opt in _inner_optimizers(self.optimizer):
            if self.masters:
                for group in opt.param_groups:
                    for p in group["params"]:
                        yield (id(p), "data"), (lambda p=p: p.data), (lambda t, p=p: setattr(p, "data", t))
            for state in opt.state.values():
                for name, value in state.items():
                    if isinstance(value, torch.Tensor):
                        yield ((id(state), name), (lambda s=state, k=name: s[k]),
                               (lambda t, s=state, k=name: s.__setitem__(k, t)))

    def offload(self) -> int:
        """Every state tensor on an accelerator to the host; the bytes moved. The masters' .grad are
        dropped first: the next step fills them from the model's gradient buffer anew (Megatron's
        zero_grad sets them to None before each mini-batch anyway)."""
        moved = 0
        if self.masters:
            for opt in _inner_optimizers(self.optimizer):
                for group in opt.param_groups:
                    for p in group["params"]:
                        p.grad = None
        for key, get, put in self._slots():
            t = get()
            if t.device.type == "cpu":
                continue
            host = self._host.get(key)
            if host is None or host.shape != t.shape or host.dtype != t.dtype:
                host = self._host[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)
            self._device[key] = t.device
            put(host)
            moved += t.numel() * t.element_size()
        if moved:
            torch.cuda.synchronize()
        self.offloaded = True
        return moved

    def reload(self) -> int:
        """The tensors offload moved, back onto their devices; the bytes moved."""
        moved = 0
        if not self.offloaded:
            return moved
        for key, get, put in self._slots():
            device = self._device.pop(key, None)
            if device is not None:
                t = get()
                put(t.to(device, non_blocking=True))
                moved += t.numel() * t.element_size()
        self.offloaded = False
        return moved


def empty_cache() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def free_for_rollout(offload: OptimizerOffload | None) -> dict[str, float]:
    """Before colocated servers resume: offload the optimizer (when configured), collect, return the
    allocator's cache. The trainer's memory after it, as metrics (on CUDA)."""
    moved = offload.offload() if offload is not None else 0
    gc.collect()
    empty_cache()
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    out = {"perf/trainer_allocated_gib_at_rollout": torch.cuda.memory_allocated() / GIB,
           "perf/trainer_reserved_gib_at_rollout": torch.cuda.memory_reserved() / GIB}
    if offload is not None:
        out["perf/optimizer_offloaded_gib"] = moved / GIB
    return out


def reclaim_for_training(offload: OptimizerOffload | None) -> None:
    """Before the update: the optimizer state back onto the GPU (when it was offloaded)."""
    if offload is not None:
        offload.reload()
