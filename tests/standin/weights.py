"""The stand-in's tensor-parallel receiver ranks: weight-update groups (gloo), broadcast receives,
serialized-tensor payloads, and per-rank checksums of what arrived.

A server launched with --tp-size K runs K receiver ranks (threads of the server process, one work
thread each, so every rank enters each collective concurrently as SGLang's K scheduler processes
do). For /init_weights_update_group each rank joins the named group as rank `rank_offset + tp_rank`
of `world_size`; a server can hold several named groups at once (one per trainer sender). The
group is the one the trainer's `sglang.weights.init_weight_update_group` builds: TCP rendezvous at
master_address:master_port, a store prefixed with the group name, and the gloo backend under the
prefixes torch's `_new_process_group_helper` uses ("<group>/", "cpu/"), built directly here because
torch allows a group name once per process and the K ranks share this process.

/update_weights_from_tensor: each rank opens its own entry of `serialized_named_tensors` (base64 of
a ForkingPickler pickle, SGLang's MultiprocessingSerializer) with a restricted unpickler, as
SGLang's SafeUnpickler does. CPU tensors shared through file descriptors reach back to the
sender's resource_sharer with the receiver's multiprocessing authkey: from a process that is not
the sender's multiprocessing child this fails with AuthenticationError, as it does for real.
A CUDA IPC handle's device slot (torch's `rebuild_cuda_tensor` argument `storage_device`) is read as
SGLang 0.5.8-0.5.23 reads it once `monkey_patch_torch_reductions` ran (it runs before every tensor
update; `_device_from_maybe_uuid`): an int is this process's own device index, a str is a device
UUID looked up among the devices this process sees (CUDA_VISIBLE_DEVICES), and a UUID it does not
see is an error that takes the server down (SGLang: "Invalid device_uuid=...").
"""

from __future__ import annotations

import base64
import hashlib
import inspect
import io
import math
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401  (registers the tensor reducers ForkingPickler uses)
from torch.distributed import distributed_c10d as c10d
from torch.multiprocessing import reductions

from tests.standin.state import RankError

_ALLOWED_MODULES = {"torch._utils", "torch.multiprocessing.reductions", "torch.storage", "torch._tensor",
                    "torch.nn.parameter"}
_ALLOWED = {("builtins", n) for n in ("list", "tuple", "dict", "str", "int", "float", "bool", "bytes", "set")} | {
    ("collections", "OrderedDict"), ("copyreg", "__newobj__"), ("multiprocessing.resource_sharer", "DupFd"),
    ("multiprocessing.reduction", "_rebuild_partial"), ("torch", "Size"), ("torch", "device"),
    ("torch", "Tensor"), ("torch", "UntypedStorage"), ("torch", "TypedStorage"),
    ("types", "SimpleNamespace")}  # a flattened bucket's metadata (SGLang 0.5.23 utils/common.py:3176 allows it)


# The argument of torch's rebuild_cuda_tensor that names the storage's device (found by name: SGLang
# hard-codes its position, 6, which is where torch has kept it).
DEVICE_SLOT = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters).index("storage_device")


def local_cuda_uuids() -> list[str]:
    """The UUIDs of the CUDA devices this process sees, by index, spelled as SGLang compares them."""
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def local_cuda_index(device: int | str) -> int:
    """The device slot of a CUDA IPC handle as this process's device index (module docstring)."""
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        uuids = local_cuda_uuids()
        if device in uuids:
            return uuids.index(device)
        seen = ", ".join(f"{i}={u}" for i, u in enumerate(uuids)) or "none"
        raise ValueError(f"Invalid device_uuid={device}: a CUDA IPC handle of a device this server does not "
                         f"see (its devices: {seen}; CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")
    raise TypeError(f"CUDA IPC handle: device slot {device!r} is neither a device index nor a device UUID")


def _torch_rebuild_cuda_tensor(*args):
    return reductions.rebuild_cuda_tensor(*args)


def _rebuild_cuda_tensor_here(*args):
    """torch's rebuild_cuda_tensor with the device slot read as SGLang reads it."""
    return _torch_rebuild_cuda_tensor(*args[:DEVICE_SLOT], local_cuda_index(args[DEVICE_SLOT]),
                                      *args[DEVICE_SLOT + 1:])


class _RestrictedUnpickler(pickle.Unpickler):
    """Tensors, storages and plain containers only (the allowlist idea of SGLang's SafeUnpickler)."""

    def find_class(self, module, name):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor_here
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED or (
                module == "torch" and (name.endswith("Storage") or isinstance(getattr(torch, name, None),
                                                                               torch.dtype))):
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


FLATTENED_BUCKET = "flattened_bucket"


def deserialize(entry: str, load_format: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """One TP rank's entry as its (name, tensor) pairs. load_format "flattened_bucket": the entry is a dict
    {"flattened_tensor": uint8, "metadata": [objects with name, shape, dtype, start_idx, end_idx]} and the
    tensors are its byte slices viewed as their dtype and shape (SGLang 0.5.23 model_runner_components/
    weight_updater.py:354 -> _update_weights_from_flattened_bucket :383-405 -> weight_sync/tensor_bucket.py
    reconstruct_tensors); anything else in that format fails as SGLang's attribute / key access does."""
    data = base64.b64decode(entry, validate=True)
    obj = _RestrictedUnpickler(io.BytesIO(data)).load()
    if load_format == FLATTENED_BUCKET:
        flat, metadata = obj["flattened_tensor"], obj["metadata"]  # TypeError / KeyError as in SGLang
        return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in metadata]
    if load_format is not None:  # weight_updater.py:380 (no custom loaders here)
        raise NotImplementedError(f"Unknown load_format={load_format}")
    if not (isinstance(obj, list) and all(isinstance(x, tuple) and len(x) == 2 for x in obj)):
        raise ValueError("serialized_named_tensors entry is not a list of (name, tensor) pairs")
    return obj


def tensor_checksum(t: torch.Tensor) -> dict[str, Any]:
    """sha256 of the tensor's bytes (exact: a transport either delivers them or not), with its dtype,
    shape and float64 sums for reading a mismatch."""
    c = t.detach().contiguous().cpu()
    raw = c.view(torch.uint8) if c.numel() else c
    return {"sha256": hashlib.sha256(raw.numpy().tobytes()).hexdigest(), "dtype": str(c.dtype).removeprefix("torch."),
            "shape": list(c.shape), "sum": float(c.double().sum()), "sumsq": float(c.double().pow(2).sum())}


def join_group(*, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               timeout_s: float) -> dist.ProcessGroupGloo:
    timeout = timedelta(seconds=timeout_s)
    store, _, _ = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore("cpu/", c10d.PrefixStore(f"{group_name}/", c10d.PrefixStore(group_name, store)))
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


class Ranks:
    """K receiver ranks; `run(fn)` calls fn(rank) on every rank's own thread and returns the results."""

    def __init__(self, tp_size: int, *, timeout_s: float = 120.0):
        self.tp_size, self.timeout_s = tp_size, timeout_s
        self.groups: list[dict[str, dist.ProcessGroupGloo]] = [{} for _ in range(tp_size)]
        self._pools = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tp{r}") for r in range(tp_size)]

    def run(self, fn) -> list:
        futures = [pool.submit(fn, r) for r, pool in enumerate(self._pools)]
        errors, out = [], []
        for r, f in enumerate(futures):
            try:
                out.append(f.result())
            except Exception as e:  # noqa: BLE001 - every rank's error is reported with its rank
                errors.append((r, e))
        if errors:
            r, e = errors[0]
            raise RankError(r, e)
        return out

    def init_group(self, body: dict) -> None:
        name = body["group_name"]
        if name in self.groups[0]:
            raise ValueError(f"weight-update group {name!r} already exists on this server")
        self.run(lambda r: self.groups[r].__setitem__(name, join_group(
            master_address=body["master_address"], master_port=body["master_port"], rank=body["rank_offset"] + r,
            world_size=body["world_size"], group_name=name, timeout_s=self.timeout_s)))

    def destroy_group(self, name: str) -> bool:
        if name not in self.groups[0]:
            return False
        self.run(lambda r: self.groups[r].pop(name))
        return True

    def receive(self, body: dict) -> list[dict[str, torch.Tensor]]:
        """Every rank receives the request's tensors, broadcast from group rank 0, in request order."""
        name = body["group_name"]
        if name not in self.groups[0]:
            raise ValueError(f"weight-update group {name!r} is not initialized on this server "
                             f"(groups: {sorted(self.groups[0])})")
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
        for n, dt in zip(names, dtypes, strict=True):
            if not isinstance(getattr(torch, dt, None), torch.dtype):
                raise ValueError(f"parameter {n!r}: dtype {dt!r} is not a torch dtype name")

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        if body.get("load_format") == FLATTENED_BUCKET:
            # SGLang 0.5.23 weight_updater.py:275 -> _receive_bucketed_weights_from_distributed :297-307:
            # FlattenedTensorBucket.empty (weight_sync/tensor_bucket.py:87-111) lays the tensors end to end in
            # request order, refusing an empty bucket and a tensor at an offset its element size does not
            # divide, then one uint8 broadcast fills it.
            offsets, offset = [], 0
            for n, dt, shape in zip(names, dtypes, shapes, strict=True):
                dtype = getattr(torch, dt)
                if offset % dtype.itemsize:
                    raise ValueError(f"Unaligned received tensor {n}: byte offset {offset}, dtype {dtype}")
                offsets.append((n, dtype, tuple(shape), offset))
                offset += math.prod(shape) * dtype.itemsize
            if not offsets:
                raise ValueError("Cannot create empty tensor bucket")

            def recv_flat(r):
                flat = torch.empty(offset, dtype=torch.uint8)
                self.groups[r][name].broadcast([flat], opts).wait()
                return {n: flat[o:o + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
                        for n, dtype, shape, o in offsets}

            return self.run(recv_flat)

        def recv(r):  # any other load_format is ignored on this route (weight_updater.py:275)
            out = {}
            for n, dt, shape in zip(names, dtypes, shapes, strict=True):
                t = torch.empty(tuple(shape), dtype=getattr(torch, dt))
                self.groups[r][name].broadcast([t], opts).wait()
                out[n] = t
            return out

        return self.run(recv)

    def open_serialized(self, entries: list[str], load_format: str | None = None) -> list[dict[str, torch.Tensor]]:
        """Each rank opens its own entry (index tp_rank), as SGLang's TP workers do."""
        if len(entries) != self.tp_size:
            raise ValueError(f"serialized_named_tensors has {len(entries)} entries, the server has "
                             f"tp_size={self.tp_size} (one per TP rank)")
        return self.run(lambda r: {n: t.clone() for n, t in deserialize(entries[r], load_format)})
