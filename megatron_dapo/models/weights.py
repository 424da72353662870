"""Megatron weights <-> the canonical (world-1) state, and the mcore safetensors format.

The canonical state of an architecture is the state dict of its GPTModel built with the local
spec at TP = PP = EP = 1: names like `decoder.layers.{L}.self_attention.linear_qkv.weight`
with global layer indices L and global expert indices in
`decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight`, full (unsharded)
tensors. Any parallel layout loads from it and gathers back to it:

- `load_canonical_state(model, get_tensor, pgs=...)`: fill this rank's parameters, slicing
  each full tensor for its TP (or expert-TP) rank; SwiGLU `linear_fc1` = [gate; up] is sliced
  per half, so rank r holds [gate_r; up_r] as Megatron expects.
- `gather_canonical_state(model, pgs=...)`: yield (name, full tensor or None, is_writer) for every
  parameter of this rank, TP-gathered to the writer only; exactly one rank in the world is the
  writer of each name (pipeline stages and expert-parallel ranks write their own parts).
- `gather_stage_state(model, pgs=...)`: every tensor of a pipeline stage, experts of all EP ranks
  included, on the stage's first rank only (the weight sync's sender; see rollout/sglang/sync.py).

Transformer-Engine parameter names (norms fused into linear_qkv / linear_fc1, grouped
experts `weight{j}`) are translated to the local names here, so checkpoints do not depend on
the layer spec.

The mcore checkpoint format (written by `python -m megatron_dapo.convert hf-to-mcore`):

    DIR/mcore_checkpoint.json   {"format": "megatron_dapo.mcore/v1", "arch": {ModelArch fields},
                                 "hf_config": {...} or null, "layout": {"tp","pp","ep"} or null,
                                 "weight_map": {name: file}}
    DIR/model-00001-of-0000N.safetensors   canonical tensors

It is read with safetensors only (no pickle); `layout` records the parallel sizes it was
checked against, and any layout can load it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_dapo.models.arch import ModelArch

__all__ = ["canonical_name", "partition_dims", "load_canonical_state", "gather_canonical_state",
           "gather_stage_state", "is_stage_sender", "SafetensorsDir",
           "ShardedSafetensorsWriter", "save_mcore_checkpoint", "read_mcore_metadata",
           "load_mcore_weights", "MCORE_FORMAT"]

MCORE_FORMAT = "megatron_dapo.mcore/v1"
MCORE_METADATA = "mcore_checkpoint.json"

_DECODER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_LOCAL_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)(\.)")
_TE_GROUPED_EXPERT = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
_TE_FUSED_NORMS = (   # TE spec fuses the pre-norms into the following linear layer
    (".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
    (".self_attention.linear_qkv.layer_norm_bias", ".input_layernorm.bias"),
    (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
    (".mlp.linear_fc1.layer_norm_bias", ".pre_mlp_layernorm.bias"),
)


def _unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers (they hold it as `.module`)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _num_local_experts(model) -> int:
    config = model.config
    return config.num_moe_experts // config.expert_model_parallel_size if config.num_moe_experts else 0


def canonical_name(model, local_name: str, *, ep_rank: int) -> str:
    """The canonical (world-1, local-spec) name of one of `model`'s parameters."""
    name = local_name
    match = _DECODER_LAYER.match(name)
    if match:
        global_layer = model.decoder.layers[int(match.group(1))].layer_number - 1
        name = f"decoder.layers.{global_layer}.{match.group(2)}"
    for te_suffix, local_suffix in _TE_FUSED_NORMS:
        if name.endswith(te_suffix):
            name = name[: -len(te_suffix)] + local_suffix
    offset = ep_rank * _num_local_experts(model)
    grouped = _TE_GROUPED_EXPERT.search(name)
    if grouped:
        layer, kind, index = grouped.group(1), grouped.group(2), int(grouped.group(3))
        name = name[: grouped.start()] + f".mlp.experts.local_experts.{index + offset}.{layer}.{kind}"
    else:
        name = _LOCAL_EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}", name)
    return name


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _is_glu(model, name: str) -> bool:
    return model.config.gated_linear_unit and re.search(r"\.linear_fc1\.(weight|bias)$", name) is not None


def _shard(full: torch.Tensor, *, dim: int, rank: int, size: int, glu: bool, name: str) -> torch.Tensor:
    if full.shape[dim] % (size * (2 if glu else 1)):
        raise ValueError(f"{name}: dim {dim} of shape {tuple(full.shape)} does not split into {size} shards")
    if not glu:
        return full.chunk(size, dim=dim)[rank]
    gate, up = full.chunk(2, dim=dim)
    return torch.cat([gate.chunk(size, dim=dim)[rank], up.chunk(size, dim=dim)[rank]], dim=dim)


def _unshard(shards: list[torch.Tensor], *, dim: int, glu: bool) -> torch.Tensor:
    if not glu:
        return torch.cat(shards, dim=dim)
    halves = [s.chunk(2, dim=dim) for s in shards]
    return torch.cat([torch.cat([g for g, _ in halves], dim=dim), torch.cat([u for _, u in halves], dim=dim)], dim=dim)


def partition_dims(model) -> dict[str, int]:
    """{local parameter name: the dim it is split along over TP (or expert TP)}; parameters
    not listed are replicated. Read from the module classes (Megatron's column / row parallel
    linears and vocab-parallel embedding, and their Transformer-Engine versions): Megatron
    sets the `partition_dim` attribute only when it initialises weights itself."""
    dims = {}
    for module_name, module in model.named_modules():
        cls = type(module).__name__
        if "ColumnParallel" in cls or cls == "VocabParallelEmbedding":
            weight_dim, bias_dim = 0, 0
        elif "RowParallel" in cls:
            weight_dim, bias_dim = 1, None       # row-parallel bias is added after the reduce
        else:
            continue
        for param_name, _ in module.named_parameters(recurse=False):
            dim = weight_dim if param_name.startswith("weight") else \
                bias_dim if param_name.startswith("bias") else None    # TE fused layer_norm_*
            if dim is not None:
                dims[f"{module_name}.{param_name}" if module_name else param_name] = dim
    return dims


def _tp_coords(name: str, pgs) -> tuple[object, int, int]:
    if _is_expert(name):
        return pgs.expt_tp, pgs.etp_rank, pgs.etp_size
    return pgs.tp, pgs.tp_rank, pgs.tp_size


def load_canonical_state(model, get_tensor: Callable[[str], torch.Tensor], *, pgs,
                         skip: Callable[[str], bool] = lambda name: False) -> list[str]:
    """Copy canonical tensors into this rank's parameters; return the canonical names loaded.

    get_tensor(name) returns the full tensor (any dtype; it is cast to the parameter's dtype).
    `skip(name)` leaves a parameter as it is (e.g. MTP layers absent from an HF checkpoint).
    Tied output weights on the last pipeline stage read the input embedding.
    """
    model = _unwrap(model)
    loaded = []
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    dims = partition_dims(model)
    with torch.no_grad():
        for local_name, param in model.named_parameters():
            name = canonical_name(model, local_name, ep_rank=pgs.ep_rank)
            if skip(name):
                continue
            source = "embedding.word_embeddings.weight" if (tied and name == "output_layer.weight") else name
            full = get_tensor(source)
            if local_name in dims:
                _, rank, size = _tp_coords(name, pgs)
                full = _shard(full, dim=dims[local_name], rank=rank, size=size,
                              glu=_is_glu(model, name), name=name)
            if tuple(full.shape) != tuple(param.shape):
                raise ValueError(f"{name} (local {local_name}): checkpoint shard has shape "
                                 f"{tuple(full.shape)}, the model expects {tuple(param.shape)}")
            param.copy_(full)
            loaded.append(name)
    return loaded


def _gather_to_first(full: torch.Tensor, group, rank: int, size: int,
                     traffic: dict | None = None) -> list[torch.Tensor] | None:
    """dist.gather of `full` to the group's rank 0: the shards there, None elsewhere (no copy kept).
    traffic: {"sent": bytes, "received": bytes} counters of this rank, updated."""
    shards = [torch.empty_like(full) for _ in range(size)] if rank == 0 else None
    dist.gather(full.contiguous(), shards, dst=dist.get_global_rank(group, 0), group=group)
    if traffic is not None:
        n = full.numel() * full.element_size()
        key, amount = ("received", n * (size - 1)) if rank == 0 else ("sent", n)
        traffic[key] = traffic.get(key, 0) + amount
    return shards


def _tp_full(model, local_name: str, name: str, param: torch.Tensor, dims: dict, pgs,
             traffic: dict | None = None) -> torch.Tensor | None:
    """The full tensor on TP (or expert-TP) rank 0, None on the other ranks of that group."""
    full = param.detach()
    if local_name not in dims:
        return full
    group, rank, size = _tp_coords(name, pgs)
    if size == 1:
        return full
    shards = _gather_to_first(full, group, rank, size, traffic)
    return None if shards is None else _unshard(shards, dim=dims[local_name], glu=_is_glu(model, name))


def _writes(pgs, expert: bool) -> tuple[bool, bool]:
    """(this rank writes the name, this rank's TP group holds the writer) for a dense / expert name."""
    if expert:
        return (pgs.etp_rank == 0 and pgs.expt_dp_rank == 0 and pgs.cp_rank == 0,
                pgs.cp_rank == 0 and pgs.expt_dp_rank == 0)
    return pgs.tp_rank == 0 and pgs.cp_rank == 0 and pgs.dp_rank == 0, pgs.cp_rank == 0 and pgs.dp_rank == 0


def gather_canonical_state(model, *, pgs, traffic: dict | None = None
                           ) -> Iterator[tuple[str, torch.Tensor | None, bool]]:
    """Yield (canonical name, full tensor or None, is_writer) for each parameter of this rank.

    A collective: every rank of the world must iterate it to the end. Exactly one rank writes each
    name: dense parameters tp/cp/dp rank 0 of each pipeline stage, expert parameters expert-TP /
    expert-DP rank 0 of each expert-parallel rank. TP shards are gathered to the writer only
    (dist.gather, not all_gather) and the tensor stays where the parameter lives (no host copy);
    every other rank gets None. Replicas that write nothing (dp > 0, cp > 0) skip the gather.
    """
    model = _unwrap(model)
    dims = partition_dims(model)
    with torch.no_grad():
        for local_name, param in model.named_parameters():
            name = canonical_name(model, local_name, ep_rank=pgs.ep_rank)
            writer, group_writes = _writes(pgs, _is_expert(name))
            full = _tp_full(model, local_name, name, param, dims, pgs, traffic) if group_writes else None
            yield name, full if writer else None, writer


def is_stage_sender(pgs) -> bool:
    """The rank that holds every tensor of its pipeline stage during `gather_stage_state`: the first
    rank of the stage (tp = cp = dp = 0, hence also expert-TP = EP = expert-DP = 0)."""
    return pgs.tp_rank == 0 and pgs.cp_rank == 0 and pgs.dp_rank == 0


def gather_stage_state(model, *, pgs, traffic: dict | None = None
                       ) -> Iterator[tuple[str, torch.Tensor | None, int]]:
    """(canonical name, full tensor or None, full size in bytes) of every tensor of this rank's pipeline
    stage, in the same order and with the same sizes on every rank of the stage; the tensor exists on
    the stage's sender only (`is_stage_sender`), None elsewhere.

    A collective over the stage. Dense tensors are gathered over TP to the sender; expert tensors over
    expert-TP, then over EP, so the sender also gets the experts of every EP rank (global expert
    indices). Only the sender ever holds a full tensor, one parameter at a time; nothing is copied to
    host. Every rank knows every size without a tensor (shard size x TP), so all ranks of a stage can
    cut the same buckets without talking to each other (rollout/sglang/sync.py relies on it).
    """
    inner = _unwrap(model)
    sender = is_stage_sender(pgs)
    dims = partition_dims(inner)
    n_local = _num_local_experts(inner)
    with torch.no_grad():
        for local_name, param in inner.named_parameters():
            name = canonical_name(inner, local_name, ep_rank=pgs.ep_rank)
            expert = _is_expert(name)
            writer, group_writes = _writes(pgs, expert)
            tp_size = _tp_coords(name, pgs)[2] if local_name in dims else 1
            nbytes = param.numel() * tp_size * param.element_size()
            full = _tp_full(inner, local_name, name, param, dims, pgs, traffic) if group_writes else None
            if not expert or pgs.ep_size == 1:
                yield name, full if sender else None, nbytes
                continue
            per_ep = _gather_to_first(full, pgs.ep, pgs.ep_rank, pgs.ep_size, traffic) if writer else None
            local = _LOCAL_EXPERT.search(name)
            local_index = int(local.group(2)) - pgs.ep_rank * n_local
            for k in range(pgs.ep_size):
                global_name = name[: local.start(2)] + str(local_index + k * n_local) + name[local.end(2):]
                yield global_name, per_ep[k] if (sender and per_ep is not None) else None, nbytes


class SafetensorsDir:
    """Read tensors by name from a directory of safetensors files (one file, or an index)."""

    def __init__(self, path: str, index_name: str = "model.safetensors.index.json"):
        self.path = path
        index = os.path.join(path, index_name)
        if os.path.exists(index):
            with open(index) as f:
                self.weight_map = json.load(f)["weight_map"]
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no .safetensors files in {path}")
            self.weight_map = {}
            for file in files:
                with safe_open(os.path.join(path, file), framework="pt") as handle:
                    self.weight_map.update({key: file for key in handle.keys()})
        self._handles: dict[str, object] = {}

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} not found in {self.path}")
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = safe_open(os.path.join(self.path, file), framework="pt")
        return self._handles[file].get_tensor(name)


def _umask() -> int:
    """This process's umask, read without changing it (os.umask would, for a moment, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


class ShardedSafetensorsWriter:
    """Write named tensors into files of at most `max_shard_bytes`; `close()` names them
    `{prefix}-0000k-of-0000n.safetensors` (or `{prefix}.safetensors` when there is one)
    and returns the weight map {name: file}."""

    def __init__(self, out_dir: str, prefix: str = "model", max_shard_bytes: int = 5 * 2**30):
        self.out_dir, self.prefix, self.max_shard_bytes = out_dir, prefix, max_shard_bytes
        os.makedirs(out_dir, exist_ok=True)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._files: list[tuple[str, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in names for _, names in self._files):
            raise ValueError(f"tensor {name!r} written twice")
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().cpu().contiguous()
        self._pending_bytes += size

    def _flush(self) -> None:
        tmp = f"{self.prefix}.part{len(self._files):05d}.tmp"
        path = os.path.join(self.out_dir, tmp)
        save_file(self._pending, path, metadata={"format": "pt"})
        os.chmod(path, 0o666 & ~_umask())  # safetensors creates its files 0600; weights are files like any other
        self._files.append((tmp, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> dict[str, str]:
        """Finish the files; returns {} (and writes nothing) if no tensor was added."""
        if self._pending:
            self._flush()
        n = len(self._files)
        weight_map = {}
        for k, (tmp, names) in enumerate(self._files):
            final = f"{self.prefix}.safetensors" if n == 1 else f"{self.prefix}-{k + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.out_dir, tmp), os.path.join(self.out_dir, final))
            weight_map.update({name: final for name in names})
        return weight_map


def save_mcore_checkpoint(out_dir: str, tensors: Iterable[tuple[str, torch.Tensor]], *,
                          arch: ModelArch, hf_config: dict | None = None,
                          layout: dict | None = None) -> None:
    """Write canonical tensors and the metadata file (single process)."""
    writer = ShardedSafetensorsWriter(out_dir)
    for name, tensor in tensors:
        writer.add(name, tensor)
    weight_map = writer.close()
    meta = {"format": MCORE_FORMAT, "arch": arch.to_dict(), "hf_config": hf_config,
            "layout": layout, "weight_map": weight_map}
    with open(os.path.join(out_dir, MCORE_METADATA), "w") as f:
        json.dump(meta, f, indent=1)


def read_mcore_metadata(ckpt_dir: str) -> tuple[ModelArch, dict]:
    """(arch, metadata dict) of an mcore checkpoint; raises ValueError if it is not one."""
    path = os.path.join(ckpt_dir, MCORE_METADATA)
    if not os.path.exists(path):
        raise ValueError(f"{ckpt_dir} is not an mcore checkpoint: {MCORE_METADATA} is missing")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != MCORE_FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, expected {MCORE_FORMAT!r}")
    return ModelArch.from_dict(meta["arch"]), meta


def load_mcore_weights(model, ckpt_dir: str, *, pgs) -> list[str]:
    """Load an mcore checkpoint into this rank's (sharded) model."""
    read_mcore_metadata(ckpt_dir)
    source = SafetensorsDir(ckpt_dir, index_name=MCORE_METADATA)
    return load_canonical_state(model, source.get, pgs=pgs)
