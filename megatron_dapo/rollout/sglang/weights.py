"""Actor -> SGLang weight sync: size buckets, request payloads, the weight-update process group.

Two transports, both sent bucket by bucket (a bucket holds whole tensors up to `bucket_bytes`; a
tensor larger than the bucket travels alone, since SGLang loads parameters whole):

- colocated (`/update_weights_from_tensor`): SGLang's `serialized_named_tensors` is a list with
  one entry per TP rank of the server; each entry is the base64 text of a
  `multiprocessing.reduction.ForkingPickler` pickle of `[(name, tensor), ...]`, exactly what
  SGLang's `MultiprocessingSerializer.serialize(obj, output_str=True)` produces. For CUDA tensors
  that pickle holds CUDA IPC handles (no copy), so it only works between processes on one node.
  The server unpickles it: only send it to servers this job started.
- disaggregated (`/update_weights_from_distributed`): the trainer (rank 0) and every server TP
  rank (ranks `rank_offset + tp_rank`) join one process group created by `/init_weights_update_group`;
  per bucket the trainer posts `names` / `dtypes` / `shapes` and broadcasts each tensor from rank 0
  in that order, which is the order the server receives them in.

`init_weight_update_group` builds that group the way SGLang's receiver side does (TCP rendezvous at
`tcp://master_address:master_port`, a store prefixed with the group name, a group separate from the
default one), so both sides agree on the store keys.

Shape legend: tensors keep their own shapes; `bucket_bytes` counts `numel * element_size`.
"""

from __future__ import annotations

import base64
import contextlib
import io
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

# torch.multiprocessing registers the tensor reducers (shared memory / CUDA IPC) with ForkingPickler.
import torch.multiprocessing  # noqa: F401

MIB = 1024 * 1024

PostToServers = Callable[[str, list[dict[str, Any]]], None]
"""post(path, bodies): POST bodies[i] to server i concurrently; raise if any server fails."""


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bucket_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors, in order, into buckets of at most `bucket_bytes` (an oversize tensor goes alone)."""
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be an int >= 1, got {bucket_bytes!r}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    seen: set[str] = set()
    for i, item in enumerate(named_tensors):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"named_tensors[{i}] must be a (name, tensor) pair, got {type(item).__name__}")
        name, t = item
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"named_tensors[{i}] ({name!r}) is a {type(t).__name__}, expected a torch.Tensor")
        if name in seen:
            raise ValueError(f"named_tensors[{i}]: parameter {name!r} appears twice")
        seen.add(name)
        n = tensor_nbytes(t)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's dtype spelling: the torch attribute name ("bfloat16"), read back with getattr(torch, ...)."""
    name = str(dtype).removeprefix("torch.")
    if getattr(torch, name, None) is not dtype:
        raise ValueError(f"dtype {dtype} has no torch.<name> spelling SGLang can read back")
    return name


_SHARING_LOCK = threading.Lock()


@contextlib.contextmanager
def _cpu_storage_by_file_name() -> Iterator[None]:
    """torch's "file_system" sharing strategy for the block: a CPU storage pickles as the name of a
    shared-memory file, which the server process can open. Under the default "file_descriptor" strategy
    it pickles as a descriptor that only the sender's own multiprocessing children can receive: an
    SGLang 0.5.23 server that unpickles one fails the authkey check and the whole server exits
    (measured). The strategy is process-wide, so the switch is held under a lock and undone after."""
    import torch.multiprocessing as tmp

    with _SHARING_LOCK:
        before = tmp.get_sharing_strategy()
        if before != "file_system":
            tmp.set_sharing_strategy("file_system")
        try:
            yield
        finally:
            if before != "file_system":
                tmp.set_sharing_strategy(before)


def serialize_named_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """Base64 text of a ForkingPickler pickle of the list (SGLang's MultiprocessingSerializer format):
    CUDA IPC handles for device tensors, shared-memory file names for CPU tensors (never descriptors).
    The caller keeps the tensors alive until the server has answered.

    A CUDA handle names its device by the sender's index (torch's own reduction), not by the device's
    UUID as SGLang's `monkey_patch_torch_reductions` would on the sending side. This matters for servers
    under another CUDA_VISIBLE_DEVICES than the node leader that sends: SGLang (0.5.8-0.5.23,
    `_device_from_maybe_uuid`) reads an int as its own device index and looks a UUID up among the
    devices it sees only, raising "Invalid device_uuid" (the server dies) for any other. The servers
    placed through Ray see only their bundle's GPUs: the node's second server (GPUs 4-7) cannot see the
    leader's GPU 0, so a UUID would kill it, while the index opens the handle in its device 0's context
    and reaches the leader's memory through peer access over NVLink (CUDA IPC with a device outside
    CUDA_VISIBLE_DEVICES, which NCCL relies on since CUDA 10.1; not yet run on GPUs here). A UUID
    becomes the right choice once every server sees its node's GPUs (tests/standin/weights.py reads
    the slot as SGLang does)."""
    tensors = [(name, t.detach().contiguous()) for name, t in named_tensors]
    return _pickled(tensors, cpu=any(t.device.type == "cpu" for _, t in tensors))


def _pickled(obj: Any, *, cpu: bool) -> str:
    buf = io.BytesIO()
    with _cpu_storage_by_file_name() if cpu else contextlib.nullcontext():
        ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


FLATTENED_BUCKET = "flattened_bucket"
"""The `load_format` under which SGLang (0.5.8 to 0.5.23) takes a bucket as one byte tensor: on
/update_weights_from_distributed one uint8 broadcast of the bucket's tensors end to end, cut back by the
request's names / dtypes / shapes (0.5.23 model_runner_components/weight_updater.py:275 and
weight_sync/tensor_bucket.py `FlattenedTensorBucket.empty`; 0.5.8 model_runner.py:1264); on
/update_weights_from_tensor a {"flattened_tensor", "metadata"} dict per TP rank (0.5.23
weight_updater.py:354, `_update_weights_from_flattened_bucket`). One collective or one shared tensor per
bucket instead of one per tensor: 18,867 of them per sync at Qwen3-30B-A3B's structure."""


def flattened_bytes(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The tensors' bytes end to end as one uint8 tensor (their order kept), or None when one would start at
    an offset that is not a multiple of its element size: the receiver views each slice as its dtype
    (0.5.23 tensor_bucket.py refuses "Unaligned received tensor"), so such a bucket goes tensor by tensor."""
    offset = 0
    for t in tensors:
        if offset % t.element_size():
            return None
        offset += tensor_nbytes(t)
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def flattened_entry(specs: Sequence[tuple[str, Sequence[int], torch.dtype]], flat: torch.Tensor) -> dict[str, Any]:
    """What one TP rank of /update_weights_from_tensor unpickles for a flattened bucket: the byte tensor and,
    per tensor, the fields SGLang reads (`meta.name`, `.shape`, `.dtype`, `.start_idx`, `.end_idx`, `.numel`;
    0.5.23 weight_updater.py:392-401) as a types.SimpleNamespace, which every supported release's
    SafeUnpickler admits (0.5.23 utils/common.py:3176; 0.5.8 allows the `types.` prefix), unlike a class of
    this project the server cannot import."""
    from types import SimpleNamespace

    metadata, offset = [], 0
    for name, shape, dtype in specs:  # (name, shape, dtype) of each tensor of `flat`, in order
        n = math.prod(shape) * dtype.itemsize
        metadata.append(SimpleNamespace(name=name, shape=tuple(shape), dtype=dtype, start_idx=offset,
                                        end_idx=offset + n, numel=n))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"the flattened bucket holds {flat.numel()} bytes, its tensors {offset}")
    return {"flattened_tensor": flat, "metadata": metadata}


def serialize_flattened(entry: dict[str, Any]) -> str:
    """serialize_named_tensors for a flattened_entry (the same handles: CUDA IPC, or a shared-memory file)."""
    return _pickled(entry, cpu=entry["flattened_tensor"].device.type == "cpu")


def tensor_update_payload(
    serialized_per_rank: Sequence[str],
    *,
    flush_cache: bool,
    weight_version: str | None,
    load_format: str | None = None,
) -> dict[str, Any]:
    """JSON body of POST /update_weights_from_tensor for one bucket."""
    if not serialized_per_rank or not all(isinstance(s, str) and s for s in serialized_per_rank):
        raise ValueError("serialized_per_rank must hold one non-empty serialized entry per server TP rank")
    return {
        "serialized_named_tensors": list(serialized_per_rank),
        "load_format": load_format,
        "flush_cache": flush_cache,
        "weight_version": weight_version,
    }


def distributed_update_payload(
    bucket: Sequence[tuple[str, torch.Tensor]],
    *,
    group_name: str,
    flush_cache: bool,
    weight_version: str | None,
    load_format: str | None = None,
) -> dict[str, Any]:
    """JSON body of POST /update_weights_from_distributed for one bucket (the tensors travel by broadcast:
    one per tensor, or one byte tensor with load_format=FLATTENED_BUCKET)."""
    body = {
        "names": [name for name, _ in bucket],
        "dtypes": [dtype_name(t.dtype) for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "weight_version": weight_version,
    }
    if load_format is not None:
        body["load_format"] = load_format
    return body


def weight_group_layout(tp_sizes: Sequence[int]) -> tuple[list[int], int]:
    """Rank offsets of each server in the weight-update group, and its world size (trainer = rank 0)."""
    if not tp_sizes:
        raise ValueError("tp_sizes is empty: at least one server joins the weight-update group")
    offsets = []
    next_rank = 1
    for i, tp in enumerate(tp_sizes):
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp_sizes[{i}] must be an int >= 1, got {tp!r}")
        offsets.append(next_rank)
        next_rank += tp
    return offsets, next_rank


def init_weights_update_group_payload(
    *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
) -> dict[str, Any]:
    """JSON body of POST /init_weights_update_group for one server."""
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group_name,
        "backend": backend,
    }


def init_weight_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = 600.0,
) -> torch.distributed.ProcessGroup:
    """Join the weight-update group as `rank` (the trainer is rank 0 and hosts the TCP store).

    Mirrors the receiver side of SGLang (and the custom-group helpers of OpenRLHF / verl / slime):
    this group is independent of the default (Megatron) process group, which it neither needs nor
    touches. Uses torch's private `_new_process_group_helper`, as those projects do.
    """
    from torch.distributed import distributed_c10d as c10d

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside the weight-update group of world_size {world_size}")
    timeout = timedelta(seconds=timeout_s)
    init_method = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name, timeout=timeout
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def broadcast_bucket(
    bucket: Sequence[tuple[str, torch.Tensor]], *, group: torch.distributed.ProcessGroup
) -> None:
    """Broadcast every tensor of `bucket` from group rank 0, in bucket order (the receiver's order)."""
    handles = [
        torch.distributed.broadcast(t.detach().contiguous(), src=0, group=group, async_op=True)
        for _, t in bucket
    ]
    for h in handles:
        h.wait()


def receive_bucket(
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    *,
    group: torch.distributed.ProcessGroup,
    device: str | torch.device = "cpu",
) -> list[tuple[str, torch.Tensor]]:
    """The receiver side of `broadcast_bucket` (what an SGLang server does with a request's metadata)."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
    out = []
    handles = []
    for name, dt, shape in zip(names, dtypes, shapes, strict=True):
        dtype = getattr(torch, dt, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"parameter {name!r}: dtype {dt!r} is not a torch dtype name")
        t = torch.empty(tuple(shape), dtype=dtype, device=device)
        handles.append(torch.distributed.broadcast(t, src=0, group=group, async_op=True))
        out.append((name, t))
    for h in handles:
        h.wait()
    return out


def buckets_with_last(
    named_tensors: Iterable[tuple[str, torch.Tensor]], *, bucket_mb: float
) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """`bucket_named_tensors` with buckets of `bucket_mb` MiB, each paired with "is the last bucket"."""
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb!r}")
    it = bucket_named_tensors(named_tensors, bucket_bytes=max(1, int(bucket_mb * MIB)))
    prev = next(it, None)
    for cur in it:
        yield prev, False
        prev = cur
    if prev is not None:
        yield prev, True


def send_tensor_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    bucket_mb: float,
    tp_size: int,
    num_servers: int,
    weight_version: str,
    post: PostToServers,
) -> int:
    """Colocated sync; returns the number of buckets. Each bucket is serialized once per (server, TP
    rank): every receiving process opens its own handles (a CPU shared-memory handle opens only once).
    The cache is flushed and the version set with the last bucket only."""
    n = 0
    for bucket, last in buckets_with_last(named_tensors, bucket_mb=bucket_mb):
        bodies = [
            tensor_update_payload(
                [serialize_named_tensors(bucket) for _ in range(tp_size)],
                flush_cache=last,
                weight_version=weight_version if last else None,
            )
            for _ in range(num_servers)
        ]
        post("/update_weights_from_tensor", bodies)
        n += 1
    return n


def join_weight_group(
    *,
    master_address: str,
    master_port: int,
    tp_size: int,
    num_servers: int,
    group_name: str,
    backend: str,
    timeout_s: float,
    post: PostToServers,
) -> torch.distributed.ProcessGroup:
    """Create the trainer (rank 0) + servers group: the servers join through /init_weights_update_group
    while this process hosts the rendezvous at master_address:master_port."""
    offsets, world_size = weight_group_layout([tp_size] * num_servers)
    bodies = [
        init_weights_update_group_payload(
            master_address=master_address,
            master_port=master_port,
            rank_offset=off,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        for off in offsets
    ]
    with ThreadPoolExecutor(max_workers=1) as pool:
        # The servers block in this request until every rank has joined, so post in the background.
        posting = pool.submit(post, "/init_weights_update_group", bodies)
        try:
            group = init_weight_update_group(
                master_address=master_address,
                master_port=master_port,
                rank=0,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
                timeout_s=timeout_s,
            )
        except Exception as e:
            # The servers' replies explain most rendezvous failures: report them with ours.
            raise RuntimeError(
                f"weight-update group {group_name!r}: trainer side failed ({e}); servers: {posting.exception()}"
            ) from e
        posting.result()
    return group


def send_distributed_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    bucket_mb: float,
    group: torch.distributed.ProcessGroup,
    group_name: str,
    num_servers: int,
    weight_version: str,
    post: PostToServers,
) -> int:
    """Disaggregated sync; returns the number of buckets. Per bucket: post names/dtypes/shapes (the
    servers then wait in broadcasts), broadcast the tensors from rank 0, wait for the replies."""
    n = 0
    with ThreadPoolExecutor(max_workers=1) as pool:
        for bucket, last in buckets_with_last(named_tensors, bucket_mb=bucket_mb):
            body = distributed_update_payload(
                bucket,
                group_name=group_name,
                flush_cache=last,
                weight_version=weight_version if last else None,
            )
            posting = pool.submit(post, "/update_weights_from_distributed", [body] * num_servers)
            broadcast_bucket(bucket, group=group)
            posting.result()
            n += 1
    return n
