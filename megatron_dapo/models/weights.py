"""Megatron weights <-> the canonical (world-1) state, and the mcore safetensors format.

The canonical state of an architecture is the state dict of its GPTModel built with the local
spec at TP = PP = EP = 1: names like `decoder.layers.{L}.self_attention.linear_qkv.weight`
with global layer indices L and global expert indices in
`decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight`, full (unsharded)
tensors. Any parallel layout loads from it and gathers back to it:

- `load_canonical_state(model, get_tensor, pgs=...)`: fill this rank's parameters, slicing
  each full tensor for its TP (or expert-TP) rank; SwiGLU `linear_fc1` = [gate; up] is sliced
  per half, so rank r holds [gate_r; up_r] as Megatron expects.
- `gather_canonical_state(model, pgs=...)`: yield (name, full tensor, is_writer) for every
  parameter of this rank, TP-gathered; exactly one rank in the world is the writer of each
  name (pipeline stages and expert-parallel ranks write their own parts).

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

__all__ = ["canonical_name", "partition_dims", "load_canonical_state", "gather_canonical_state", "SafetensorsDir",
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


def gather_canonical_state(model, *, pgs) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """Yield (canonical name, full tensor on CPU, is_writer) for each parameter of this rank.

    A collective: every rank of the world must iterate it to the end. Dense parameters are
    written by tp/cp/dp rank 0 of each pipeline stage; expert parameters by expert-TP /
    expert-DP rank 0 of each expert-parallel rank.
    """
    model = _unwrap(model)
    dense_writer = pgs.tp_rank == 0 and pgs.cp_rank == 0 and pgs.dp_rank == 0
    expert_writer = pgs.etp_rank == 0 and pgs.expt_dp_rank == 0 and pgs.cp_rank == 0
    dims = partition_dims(model)
    with torch.no_grad():
        for local_name, param in model.named_parameters():
            name = canonical_name(model, local_name, ep_rank=pgs.ep_rank)
            full = param.detach()
            if local_name in dims:
                group, _, size = _tp_coords(name, pgs)
                if size > 1:
                    shards = [torch.empty_like(full) for _ in range(size)]
                    dist.all_gather(shards, full.contiguous(), group=group)
                    full = _unshard(shards, dim=dims[local_name], glu=_is_glu(model, name))
            yield name, full.cpu(), expert_writer if _is_expert(name) else dense_writer


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
        save_file(self._pending, os.path.join(self.out_dir, tmp), metadata={"format": "pt"})
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
