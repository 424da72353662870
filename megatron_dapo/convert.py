"""Convert checkpoints between Hugging Face, the mcore format (see models/weights.py) and HF out of
the trainer's checkpoints.

    python -m megatron_dapo.convert hf-to-mcore --hf DIR --out DIR [--tp N --pp N --ep N] [--dtype D]
    python -m megatron_dapo.convert mcore-to-hf --mcore DIR --out DIR [--dtype D] [--drop-mtp]

`--mcore` is either form of Megatron checkpoint:
- an mcore directory (`mcore_checkpoint.json`, written by hf-to-mcore): a streaming, tensor-by-tensor
  transform in one process (no model is built, no GPU is used), memory near one shard file;
- a trainer checkpoint, `runs/<exp>/ckpt/global_step_<k>` (Megatron dist_checkpointing, written at
  any TP / PP / EP / VPP), or the `ckpt/` directory itself (its latest step). The run's
  `config.yaml` (next to `ckpt/`; `--config` to name another) gives the architecture and tokenizer;
  the model is built once at TP = PP = EP = 1 on CPU, dist_checkpointing reshards into it (only the
  model: the optimizer state is not read), and it is written through `models.hf.save_mcore_as_hf`.
  Memory: the model once in its params dtype (about 64 GB for a 32B model in bf16). The tokenizer
  files of `data.tokenizer` (an HF directory) are copied next to the weights, or the synthetic task's
  character vocabulary is written as HF files, so transformers, SGLang and vLLM load the directory as it is.

The mcore format stores unsharded tensors, so any parallel layout can load it
(`models.weights.load_mcore_weights`); --tp/--pp/--ep are checked against the architecture (heads,
KV groups, vocab, layers, experts must divide) and recorded as the intended layout. Supported:
Qwen2 / Qwen2.5, Qwen3, Qwen3-MoE. HF files are read with safetensors only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from typing import NamedTuple

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

log = logging.getLogger(__name__)


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


# --- trainer checkpoints -------------------------------------------------------------------------

TRAINER_STATE = "trainer_state.pt"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "added_tokens.json", "tokenizer.model", "chat_template.jinja")
# The checkpoint is read at a world of one whatever layout wrote it.
SINGLE_PROCESS_OVERRIDES = ["trainer.resume_mode=disable", "trainer.nnodes=1", "trainer.n_gpus_per_node=1",
                   "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
                   "parallel.expert_model_parallel_size=1", "parallel.expert_tensor_parallel_size=null",
                   "parallel.virtual_pipeline_model_parallel_size=null", "parallel.context_parallel_size=1",
                   "parallel.sequence_parallel=null"]


class TrainerModel(NamedTuple):
    model: object
    """The GPTModel at TP = PP = EP = 1 holding the checkpoint's weights (eval mode)."""
    cfg: object
    """The run's Config (with the single-process layout)."""
    arch: object
    """Its ModelArch."""
    pgs: object
    """The ParallelGroups it was built on (a world of one)."""
    step_dir: str
    """The global_step_<k> directory that was read."""


def is_trainer_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, TRAINER_STATE)) or os.path.isfile(
        os.path.join(path, "latest_checkpointed_iteration.txt"))


def resolve_step_dir(path: str) -> str:
    """`ckpt/global_step_<k>` as given, or the newest step of a `ckpt/` directory that verifies against its
    manifest; a given step directory must verify. Either way before anything in it is unpickled (torch's
    distributed checkpoint reads `model/.metadata` with pickle): a file that differs from the manifest is
    refused, naming it (CheckpointCorrupt)."""
    from megatron_dapo.trainer.checkpoint import CheckpointCorrupt, newest_verified, verify_checkpoint

    if os.path.isfile(os.path.join(path, TRAINER_STATE)):
        problem = verify_checkpoint(path)
        if problem == "no manifest":
            log.warning("%s has no manifest (written before checkpoints carried one): loading without verifying",
                        path)
        elif problem is not None:
            raise CheckpointCorrupt(f"{path}: {problem}")
        return path
    step = newest_verified(path) if os.path.isfile(os.path.join(path, "latest_checkpointed_iteration.txt")) else None
    if step is None:
        raise FileNotFoundError(f"{path}: neither a global_step_<k> directory ({TRAINER_STATE}) nor a checkpoint "
                                "root with latest_checkpointed_iteration.txt")
    return step


def find_run_config(step_dir: str) -> str:
    """The run's config.yaml: runs/<exp>/config.yaml for runs/<exp>/ckpt/global_step_<k>."""
    step_dir = os.path.abspath(step_dir)
    candidates = [os.path.join(step_dir, "config.yaml"),
                  os.path.join(os.path.dirname(os.path.dirname(step_dir)), "config.yaml"),
                  os.path.join(os.path.dirname(step_dir), "config.yaml")]
    for path in candidates:
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{step_dir}: the run's config.yaml is not at any of {candidates}; "
                            "pass --config runs/<exp>/config.yaml")


def load_trainer_checkpoint(path: str, *, config_path: str | None = None, backend: str | None = "gloo",
                            overrides: list[str] | None = None) -> TrainerModel:
    """Build the run's model at TP = PP = EP = 1 and load a trainer checkpoint's weights into it.

    path: `ckpt/global_step_<k>` or `ckpt/`. backend: the single-process world's ("gloo" = CPU, the
    exporter's; None = CUDA when available, the evaluator's). The model is built uninitialised
    (`init_weights=False`, no seed), so every tensor comes from the checkpoint: dist_checkpointing
    raises on any one it lacks.
    """
    from megatron.core import dist_checkpointing

    from megatron_dapo.config import load_config
    from megatron_dapo.data.tokenizer import load_tokenizer
    from megatron_dapo.models.builder import build_gpt_model
    from megatron_dapo.models.config_arch import model_arch
    from megatron_dapo.parallel import init_parallel

    step = resolve_step_dir(path)
    if not os.path.isdir(os.path.join(step, "model")):
        raise FileNotFoundError(f"{step}: no model/ directory (Megatron dist checkpoint) inside")
    cfg = load_config(config_path or find_run_config(step), [*SINGLE_PROCESS_OVERRIDES, *(overrides or [])])
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    arch = model_arch(cfg, vocab_size=tokenizer.vocab_size)
    pgs = init_parallel(backend=backend)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.model.params_dtype]
    model = build_gpt_model(arch, pgs=pgs, params_dtype=dtype, seed=None, init_weights=False)
    # Only the model's tensors are requested; the optimizer's in the same checkpoint are not read.
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, os.path.join(step, "model"))
    model.load_state_dict(state["model"])
    return TrainerModel(model.eval(), cfg, arch, pgs, step)


def trainer_checkpoint_to_hf(path: str, out_dir: str, *, config_path: str | None = None,
                             dtype: torch.dtype | None = None, drop_mtp: bool = False) -> str:
    """Trainer checkpoint -> HF directory (safetensors, config.json, the run's tokenizer files).
    Returns the step directory that was exported."""
    from megatron_dapo.data.tokenizer import BUILTIN_CHAR, CharTokenizer
    from megatron_dapo.models.hf import save_mcore_as_hf

    loaded = load_trainer_checkpoint(path, config_path=config_path)
    cfg, arch = loaded.cfg, loaded.arch
    if arch.mtp_num_layers and not drop_mtp:
        raise ValueError(f"{loaded.step_dir}: the model has {arch.mtp_num_layers} MTP layer(s), which HF Qwen "
                         "checkpoints cannot hold; pass --drop-mtp to export without them")
    base = read_hf_config(cfg.model.hf_path) if cfg.model.hf_path else None
    os.makedirs(out_dir, exist_ok=True)
    save_mcore_as_hf(loaded.model, out_dir, pgs=loaded.pgs, arch=arch, hf_config=base, dtype=dtype,
                     drop_mtp=drop_mtp)
    if cfg.data.tokenizer in ("", BUILTIN_CHAR):  # the synthetic task's own vocabulary, as HF files
        CharTokenizer().save_pretrained(out_dir)
    for source in (cfg.data.tokenizer, cfg.model.hf_path):
        if source and os.path.isdir(source):
            for name in _TOKENIZER_FILES + ("generation_config.json",):
                if os.path.isfile(os.path.join(source, name)) and not os.path.exists(os.path.join(out_dir, name)):
                    shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
    return loaded.step_dir


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
    to_h = sub.add_parser("mcore-to-hf", help="mcore or trainer checkpoint -> Hugging Face checkpoint")
    to_h.add_argument("--mcore", required=True, help="mcore checkpoint directory, or a trainer checkpoint "
                      "(runs/<exp>/ckpt/global_step_<k>, or runs/<exp>/ckpt for its latest step)")
    to_h.add_argument("--out", required=True, help="output directory")
    to_h.add_argument("--config", default=None, help="the run's config.yaml for a trainer checkpoint "
                      "(default: runs/<exp>/config.yaml next to ckpt/)")
    to_h.add_argument("--dtype", choices=sorted(_DTYPES), default="keep")
    to_h.add_argument("--drop-mtp", action="store_true", help="export without the MTP layers")
    return parser


def main(argv: list[str] | None = None) -> int:
    from megatron_dapo.trainer.checkpoint import CheckpointCorrupt
    from megatron_dapo.trainer.run import quiet_libraries

    quiet_libraries()
    args = _parser().parse_args(argv)
    try:
        if args.command == "hf-to-mcore":
            for flag in ("tp", "pp", "ep"):
                if getattr(args, flag) < 1:
                    raise ValueError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
            hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep, dtype=_DTYPES[args.dtype])
        elif os.path.isfile(os.path.join(args.mcore, MCORE_METADATA)):
            mcore_to_hf(args.mcore, args.out, dtype=_DTYPES[args.dtype], drop_mtp=args.drop_mtp)
        elif is_trainer_checkpoint(args.mcore):
            step = trainer_checkpoint_to_hf(args.mcore, args.out, config_path=args.config,
                                            dtype=_DTYPES[args.dtype], drop_mtp=args.drop_mtp)
            print(f"exported {step}")
        else:
            raise FileNotFoundError(f"--mcore {args.mcore} is not an mcore checkpoint ({MCORE_METADATA}) nor a "
                                    f"trainer checkpoint ({TRAINER_STATE}, or a ckpt/ directory with "
                                    "latest_checkpointed_iteration.txt)")
    except (ValueError, FileNotFoundError, KeyError, CheckpointCorrupt) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
