"""Per-row tensors too large for the SQLite queue, in files beside it: the R3 routing of the queue trainer.

A row's routing at the MoE recipe is ~2.5 MB (uint8 [48 layers, ~6.5k tokens, top-8]). As a SQLite blob
it is slow to read back (SQLite walks a blob's chain of overflow pages one page at a time: ~1.3 GB/s here)
and slower to delete (every page of the chain is read to free it: the drop of one step's trained rows
took ~1.7 ms a row, minutes a step at the recipe), on rank 0 while every other rank waits. Here a row's
tensor is one file, `<spool>/<name>`, its raw bytes; the queue field holds a small JSON reference
`{"spool": name, "dtype": ..., "shape": [...]}`. Reading it back is one file read, dropping it one unlink.

Consistency without a second transaction: a producer writes the file before the transaction that
references it, under a name no other write uses (the trajectory key and the claim token), so a referenced
file is always whole. A file no row references (a write that lost its claim, a crash between the file and
the transaction, trajectories deleted by a recovery) is removed by `sweep`, which leaves files younger than
a grace period alone while producers may be between a file and its transaction.

Layout: `spool_dir(queue_path)` = `<queue_path>.spool/`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

_DTYPES = {"uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32}


def spool_dir(queue_path: str | os.PathLike) -> str:
    return f"{os.path.abspath(queue_path)}.spool"


def write_tensor(directory: str, name: str, tensor: torch.Tensor) -> dict:
    """Write `tensor` (a CPU integer tensor) as `<directory>/<name>`; returns its reference."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise TypeError(f"spool {name!r}: dtype {tensor.dtype} is not one of {sorted(_DTYPES)}")
    if "/" in name or name.startswith("."):
        raise ValueError(f"spool: {name!r} is not a plain file name")
    os.makedirs(directory, exist_ok=True)
    tensor.detach().contiguous().numpy().tofile(os.path.join(directory, name))
    return {"spool": name, "dtype": dtype, "shape": list(tensor.shape)}


def read_tensor(directory: str, ref: dict | None, *, mapped: bool = True) -> torch.Tensor | None:
    """The tensor a reference names (None for None). A missing or short file is an error naming it.
    mapped: a private memory map of the file (its pages are read when first touched, e.g. as the tensor is
    sent; removing the file later leaves the map valid); else read into memory at once (one map a tensor
    counts against the kernel's vm.max_map_count: `map_budget`)."""
    if ref is None:
        return None
    path, dtype, shape = os.path.join(directory, ref["spool"]), _DTYPES[ref["dtype"]], ref["shape"]
    numel = 1
    for d in shape:
        numel *= d
    want = numel * torch.empty(0, dtype=dtype).element_size()
    try:
        have = os.path.getsize(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"the queue references {path}, which is gone") from None
    if have != want:
        raise ValueError(f"{path}: {have} bytes, its queue reference says {want} ({ref['dtype']} {shape})")
    if not numel:
        return torch.empty(shape, dtype=dtype)
    if mapped:
        return torch.from_file(path, shared=False, size=numel, dtype=dtype).view(shape)
    import numpy as np

    return torch.from_numpy(np.fromfile(path, dtype=str(dtype).removeprefix("torch."))).view(shape)


def map_budget() -> int:
    """How many tensors to read as memory maps at once: a quarter of the kernel's vm.max_map_count (the
    process's libraries, allocator and the rest keep the others), 16,000 where it cannot be read."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read()) // 4
    except (OSError, ValueError):
        return 16_000


def drop(directory: str, refs: Iterable[dict | None]) -> int:
    """Remove the files of these references; returns how many were removed."""
    removed = 0
    for ref in refs:
        if ref is not None:
            try:
                os.remove(os.path.join(directory, ref["spool"]))
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def sweep(directory: str, live: Iterable[dict | None], *, min_age_s: float = 0.0) -> int:
    """Remove every file of `directory` that none of the `live` references names and that was written more
    than `min_age_s` ago; returns how many. While producers write, `min_age_s` must exceed the time from a
    file's write to the commit of the transaction that references it (the files of a claim being written
    are named by no row yet); with no producer running, 0."""
    import time

    if not os.path.isdir(directory):
        return 0
    keep = {ref["spool"] for ref in live if ref is not None}
    before, removed = time.time() - min_age_s, 0
    for name in os.listdir(directory):
        if name not in keep:
            path = os.path.join(directory, name)
            try:
                if os.path.getmtime(path) <= before:
                    os.remove(path)
                    removed += 1
            except FileNotFoundError:
                pass
    return removed
