"""Convert checkpoints between Hugging Face and the mcore format (see models/weights.py).

    python -m megatron_dapo.convert hf-to-mcore --hf DIR --out DIR [--tp N --pp N --ep N] [--dtype D]
    python -m megatron_dapo.convert mcore-to-hf --mcore DIR --out DIR [--dtype D] [--drop-mtp]

Both directions are streaming, tensor-by-tensor transforms in one process (no model is built,
no GPU is used): memory stays near one shard file. The mcore checkpoint stores unsharded
tensors, so any parallel layout can load it (`models.weights.load_mcore_weights`); --tp/--pp/--ep
are checked against the architecture (heads, KV groups, vocab, layers, experts must divide)
and recorded as the intended layout. Supported: Qwen2 / Qwen2.5, Qwen3, Qwen3-MoE. Files are
read with safetensors only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from megatron_dapo.models.arch import check_layout
from megatron_dapo.models.hf import (
    arch_from_hf_config,
    canonical_param_names,
    hf_config_from_arch,
    hf_sources,
    read_hf_config,
    to_hf,
    to_mcore,
)
from megatron_dapo.models.weights import (
    MCORE_METADATA,
    SafetensorsDir,
    ShardedSafetensorsWriter,
    read_mcore_metadata,
    save_mcore_checkpoint,
)

_DTYPES = {"keep": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor if dtype is None else tensor.to(dtype)


def hf_to_mcore(hf_dir: str, out_dir: str, *, tp: int = 1, pp: int = 1, ep: int = 1,
                dtype: torch.dtype | None = None) -> None:
    """HF checkpoint -> mcore checkpoint. Every HF tensor must be used (except a tied lm_head)."""
    config = read_hf_config(hf_dir)
    arch = arch_from_hf_config(config, name=os.path.basename(os.path.normpath(hf_dir)))
    check_layout(arch, tp=tp, pp=pp, ep=ep)
    source = SafetensorsDir(hf_dir)
    plan = [(name, *hf_sources(name)) for name in canonical_param_names(arch)]
    needed = {n for _, _, hf_names in plan for n in hf_names}
    missing = sorted(needed - set(source.keys()))
    if missing:
        raise ValueError(f"{hf_dir}: {len(missing)} expected tensor(s) missing, e.g. {missing[:5]}")
    ignorable = {"lm_head.weight"} if not arch.untie_embeddings_and_output_weights else set()
    unused = sorted(set(source.keys()) - needed - ignorable)
    if unused:
        raise ValueError(f"{hf_dir}: {len(unused)} tensor(s) have no Megatron counterpart, "
                         f"e.g. {unused[:5]}")
    tensors = ((name, _cast(to_mcore(kind, [source.get(n) for n in hf_names], arch), dtype))
               for name, kind, hf_names in plan)
    save_mcore_checkpoint(out_dir, tensors, arch=arch, hf_config=config,
                          layout={"tp": tp, "pp": pp, "ep": ep})


def mcore_to_hf(mcore_dir: str, out_dir: str, *, dtype: torch.dtype | None = None,
                drop_mtp: bool = False) -> None:
    """mcore checkpoint -> HF checkpoint (safetensors + config.json)."""
    arch, meta = read_mcore_metadata(mcore_dir)
    if arch.mtp_num_layers and not drop_mtp:
        raise ValueError(f"{mcore_dir}: the model has {arch.mtp_num_layers} MTP layer(s), which HF "
                         "Qwen checkpoints cannot hold; pass --drop-mtp to export without them")
    source = SafetensorsDir(mcore_dir, index_name=MCORE_METADATA)
    writer = ShardedSafetensorsWriter(out_dir)
    first_dtype = None
    for name in canonical_param_names(arch, include_mtp=False):
        kind, hf_names = hf_sources(name)
        full = source.get(name)
        first_dtype = first_dtype or full.dtype
        for hf_name, tensor in zip(hf_names, to_hf(kind, full, arch), strict=True):
            writer.add(hf_name, _cast(tensor, dtype))
    weight_map = writer.close()
    if len(set(weight_map.values())) > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
    config = hf_config_from_arch(arch, base=meta.get("hf_config"), dtype=dtype or first_dtype)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_dapo.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    to_m = sub.add_parser("hf-to-mcore", help="Hugging Face checkpoint -> mcore checkpoint")
    to_m.add_argument("--hf", required=True, help="HF model directory (config.json + *.safetensors)")
    to_m.add_argument("--out", required=True, help="output directory")
    for flag in ("--tp", "--pp", "--ep"):
        to_m.add_argument(flag, type=int, default=1, help="intended parallel size (checked, recorded)")
    to_m.add_argument("--dtype", choices=sorted(_DTYPES), default="keep")
    to_h = sub.add_parser("mcore-to-hf", help="mcore checkpoint -> Hugging Face checkpoint")
    to_h.add_argument("--mcore", required=True, help="mcore checkpoint directory")
    to_h.add_argument("--out", required=True, help="output directory")
    to_h.add_argument("--dtype", choices=sorted(_DTYPES), default="keep")
    to_h.add_argument("--drop-mtp", action="store_true", help="export without the MTP layers")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "hf-to-mcore":
            for flag in ("tp", "pp", "ep"):
                if getattr(args, flag) < 1:
                    raise ValueError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
            hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep, dtype=_DTYPES[args.dtype])
        else:
            mcore_to_hf(args.mcore, args.out, dtype=_DTYPES[args.dtype], drop_mtp=args.drop_mtp)
    except (ValueError, FileNotFoundError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
