"""Evaluate a model on a prompt set: avg@n (mean accuracy over n samples) and unbiased pass@k.

    python -m megatron_dapo.eval --model runs/<exp>/ckpt                    # the run's own validation
    python -m megatron_dapo.eval --model CKPT_OR_HF_DIR --data aime-2024.parquet --engine sglang \
        --servers 2 rollout.tensor_model_parallel_size=4

--model is an HF checkpoint directory (config.json + safetensors) or a trainer checkpoint
(`.../ckpt/global_step_<k>` written at any TP / PP / EP, or `.../ckpt` for its latest step; the run's
config.yaml gives the architecture and tokenizer; see `convert.load_trainer_checkpoint`).
--data is a parquet / jsonl file in the DAPO-Math / AIME layout, or `arithmetic` for the synthetic
task's validation split. For a trainer checkpoint every option not given is the run's own: --data its
validation set, the sampling its rollout.val_kwargs, the lengths its data.*, the reward its reward.*, and the
seed the one its validation used at that step, so the figure equals the run's validation at that step.

Engines: `local` (default) generates in this process with the Megatron model, fine for small models.
`sglang` is the path that scales: with --sglang-url it uses servers already serving the model; without,
it launches them with the trainer's own launcher (`rollout.*` keys given as key=value: TP size, device,
SGLang's python, port, extra flags; --servers of them), after exporting a trainer checkpoint to HF
(--export-dir, default `<step>/hf`, reused when present), evaluates through them and stops them.
The last line printed is a JSON object of the figures; errors are one line on stderr (exit 2).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import sys
from collections import defaultdict
from typing import NamedTuple

import torch

log = logging.getLogger("megatron_dapo")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(correct_by_prompt: dict[str, list[bool]], ks: list[int]) -> dict[str, float]:
    n = min(len(v) for v in correct_by_prompt.values())
    flat = [c for v in correct_by_prompt.values() for c in v]
    out = {f"avg@{n}": sum(flat) / len(flat), "num_prompts": float(len(correct_by_prompt))}
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(len(v), sum(v), k) for v in correct_by_prompt.values()) / len(correct_by_prompt)
    return out


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m megatron_dapo.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--data", default=None, help="prompt file or `arithmetic` (default: the run's validation set; "
                                                "required for an HF directory)")
    p.add_argument("--config", default=None, help="the run's config.yaml for a trainer checkpoint "
                                                  "(default: runs/<exp>/config.yaml next to ckpt/)")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer dir or builtin:char (default: from the model)")
    for flag, tp, default in (("--n", int, 32), ("--temperature", float, 1.0), ("--top-p", float, 0.7),
                              ("--top-k", int, -1), ("--max-tokens", int, 20480), ("--max-prompt-length", int, 4096)):
        p.add_argument(flag, type=tp, default=None,
                       help=f"default: the run's (a trainer checkpoint), else {default}")
    p.add_argument("--k", type=int, nargs="*", default=None, help="pass@k values (default: powers of 2 up to n)")
    p.add_argument("--reward", choices=("auto", "math_dapo", "arithmetic"), default="auto",
                   help="auto: the run's reward for a trainer checkpoint, else arithmetic for --data arithmetic "
                        "and math_dapo for files")
    p.add_argument("--engine", choices=("local", "sglang"), default="local")
    p.add_argument("--sglang-url", action="append", default=[], help="a server already serving the model "
                                                                      "(repeat per server); none: launch them")
    p.add_argument("--servers", type=int, default=1, help="SGLang servers to launch (each of "
                                                           "rollout.tensor_model_parallel_size GPUs)")
    p.add_argument("--export-dir", default=None, help="where a trainer checkpoint's HF export goes for launched "
                                                      "servers (default: <step>/hf)")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="--engine local: rows per forward (default: the run's rollout.max_num_seqs, as its "
                        "validation generated; else 64)")
    p.add_argument("--dump", default=None, help="write every sample (prompt uid, sample index, response, score, acc) "
                                                "to this JSONL file")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: the run's validation seed at "
                                                          "that step for a trainer checkpoint, else 0)")
    p.add_argument("overrides", nargs="*", help="for launched servers: rollout.* keys (e.g. "
                                                "rollout.tensor_model_parallel_size=8), model.params_dtype, "
                                                "trainer.output_dir (logs under <run dir>/sglang)")
    return p.parse_args(argv)


_DEFAULTS = {"n": 32, "temperature": 1.0, "top_p": 0.7, "top_k": -1, "max_tokens": 20480, "max_prompt_length": 4096}


class Source(NamedTuple):
    """What --model names: an HF directory (run None) or a trainer checkpoint's step directory, its run's
    config (the single-process layout) and its step."""

    path: str
    run: object | None
    step: int | None
    config_path: str | None


def _source(args) -> Source:
    from megatron_dapo.convert import (
        SINGLE_PROCESS_OVERRIDES,
        find_run_config,
        is_trainer_checkpoint,
        resolve_step_dir,
    )

    if os.path.isfile(os.path.join(args.model, "config.json")):
        return Source(args.model, None, None, None)
    if not is_trainer_checkpoint(args.model):
        raise FileNotFoundError(f"--model {args.model}: neither an HF directory (config.json) nor a trainer "
                                "checkpoint (trainer_state.pt, or a ckpt/ directory with "
                                "latest_checkpointed_iteration.txt)")
    from megatron_dapo.config import load_config

    step_dir = resolve_step_dir(args.model)
    config_path = args.config or find_run_config(step_dir)
    step = re.fullmatch(r"global_step_(\d+)", os.path.basename(os.path.normpath(step_dir)))
    return Source(step_dir, load_config(config_path, SINGLE_PROCESS_OVERRIDES), int(step.group(1)) if step else None,
                  config_path)


def _fill_defaults(args, src: Source) -> None:
    """Options not given come from the run's config for a trainer checkpoint (its validation sampling,
    rollout.val_kwargs, its lengths, which its model was built for, and the seed its validation used at
    that step: trainer.seed + step), else from _DEFAULTS."""
    run = src.run
    from_run = {} if run is None else {
        "n": run.rollout.val_kwargs.n, "temperature": run.rollout.val_kwargs.temperature,
        "top_p": run.rollout.val_kwargs.top_p, "top_k": run.rollout.val_kwargs.top_k,
        "max_tokens": run.data.max_response_length, "max_prompt_length": run.data.max_prompt_length}
    for name, default in _DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, from_run.get(name, default))
    if args.max_batch_size is None:
        args.max_batch_size = run.rollout.max_num_seqs if run is not None else 64
    if args.seed is None:
        args.seed = run.trainer.seed + src.step if run is not None and src.step is not None else 0
    if args.tokenizer is None:
        args.tokenizer = run.data.tokenizer if run is not None else src.path
    if args.data is None and run is None:
        raise ValueError(f"--data is required for an HF directory ({src.path}): a prompt file or `arithmetic`")


def _dataset(args, src: Source, tokenizer):
    """--data (`arithmetic`: the standard synthetic split, the same for every model), or without it the run's
    own validation set."""
    from megatron_dapo.data.build import build_val_dataset

    run = src.run
    if args.data is None:
        data = build_val_dataset(run, tokenizer)
        if data is None:
            raise ValueError(f"{src.config_path}: the run has no validation set (data.val_files is empty); pass --data")
        return data
    if args.data == "arithmetic":
        from megatron_dapo.config.schema import ArithmeticConfig
        from megatron_dapo.data.arithmetic import make_arithmetic_dataset

        a = ArithmeticConfig()  # the standard synthetic validation set, whatever model is evaluated
        return make_arithmetic_dataset("val", num_samples=a.num_val, seed=a.seed, min_digits=a.min_digits,
                                       max_digits=a.max_digits, operators=a.operators, tokenizer=tokenizer)
    from megatron_dapo.data.dataset import load_prompt_dataset

    return load_prompt_dataset(args.data, tokenizer, max_prompt_length=args.max_prompt_length, prompt_overflow="error")


@contextlib.contextmanager
def _engine(args, src: Source, tokenizer):
    """The engine --engine names (see the module docstring); launched servers are stopped on the way out."""
    if args.engine == "local":
        from megatron_dapo.rollout.local_engine import LocalEngine

        model, pgs = _local_model(src)
        yield LocalEngine(model, pgs=pgs, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
                          max_batch_size=args.max_batch_size)
        return
    from megatron_dapo.rollout.sglang.build import connect, launch_sglang

    if args.sglang_url:
        from megatron_dapo.rollout.sglang.engine import SGLangEngine

        engine = SGLangEngine(args.sglang_url)
        try:
            yield engine
        finally:
            engine.close()
        return
    cfg = _server_config(args, src, _hf_dir(args, src))
    servers = launch_sglang(cfg)
    try:
        engine = connect(cfg, [u for s in servers for u in getattr(s, "urls", [s.url])], servers)
        try:
            yield engine
        finally:
            engine.close()
    finally:
        from megatron_dapo.rollout.sglang.server import stop_servers

        stop_servers(servers)


def _local_model(src: Source):
    """(GPTModel, pgs) in this process: an HF directory converted, or the trainer checkpoint resharded."""
    if src.run is None:
        from megatron_dapo.models.hf import load_hf_as_mcore
        from megatron_dapo.parallel import init_parallel

        pgs = init_parallel()
        return load_hf_as_mcore(src.path, pgs=pgs), pgs
    from megatron_dapo.convert import load_trainer_checkpoint

    loaded = load_trainer_checkpoint(src.path, config_path=src.config_path, backend=None)
    return loaded.model, loaded.pgs


def _hf_dir(args, src: Source) -> str:
    """The HF directory launched servers load: --model itself, or the trainer checkpoint's export (written
    once, at --export-dir or <step>/hf, then reused)."""
    if src.run is None:
        return src.path
    out = args.export_dir or os.path.join(src.path, "hf")
    if os.path.isfile(os.path.join(out, "config.json")):
        log.info("reusing the export in %s", out)
        return out
    from megatron_dapo.convert import trainer_checkpoint_to_hf

    trainer_checkpoint_to_hf(src.path, out, config_path=src.config_path)
    log.info("exported %s to %s", src.path, out)
    return out


def _server_config(args, src: Source, hf_dir: str):
    """The Config the trainer's launcher reads (rollout/sglang/build.py sglang_launch_plan): the run's (or the
    defaults), serving hf_dir with its tokenizer, --servers servers of the given rollout.* keys, contexts
    long enough for the evaluation's prompts and responses."""
    from megatron_dapo.config import ConfigError, load_config

    bad = [o for o in args.overrides if not o.startswith(("rollout.", "model.params_dtype=", "trainer.output_dir="))]
    if bad:
        raise ConfigError(bad[0].split("=", 1)[0], "launched servers take rollout.* keys, model.params_dtype (the "
                                                   "served dtype) and trainer.output_dir (their logs' run directory)")
    tokenizer = args.tokenizer if args.tokenizer and not args.tokenizer.startswith("builtin:") else hf_dir
    if src.run is not None and src.run.data.tokenizer in ("", "builtin:char"):
        tokenizer = hf_dir  # the export carries the synthetic task's vocabulary as HF files
    cfg = load_config(src.config_path, [f"model.hf_path={hf_dir}", f"data.tokenizer={tokenizer}",
                                        f"data.max_prompt_length={args.max_prompt_length}",
                                        f"data.max_response_length={args.max_tokens}", "rollout.engine=sglang",
                                        "rollout.mode=disaggregate", "rollout.sglang_urls=[]", "trainer.nnodes=1",
                                        "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
                                        "parallel.expert_model_parallel_size=1", "queue.enable=false",
                                        *args.overrides])
    return dataclasses.replace(cfg, trainer=dataclasses.replace(
        cfg.trainer, n_gpus_per_node=max(args.servers, 1) * cfg.rollout.tensor_model_parallel_size))


def evaluate(args) -> dict[str, float]:
    from megatron_dapo.data.tokenizer import load_tokenizer
    from megatron_dapo.rewards.manager import RewardManager, get_reward_fn
    from megatron_dapo.rollout.base import SamplingParams
    from megatron_dapo.trainer import stages

    src = _source(args)
    _fill_defaults(args, src)
    tokenizer = load_tokenizer(args.tokenizer)
    data = _dataset(args, src, tokenizer)
    run = src.run
    if args.reward != "auto":
        score_fn = get_reward_fn(args.reward)
    elif run is not None:
        from megatron_dapo.rewards.build import build_score_fn

        score_fn = build_score_fn(run)  # the run's own reward (a custom function included)
    else:
        score_fn = get_reward_fn("arithmetic" if args.data == "arithmetic" else "math_dapo")
    sampling = SamplingParams(max_new_tokens=args.max_tokens, n=args.n, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, stop_token_ids=(tokenizer.eos_id,), seed=args.seed)
    ks = args.k or [k for k in (2 ** i for i in range(12)) if k <= args.n]
    correct: dict[str, list[bool]] = defaultdict(list)
    records = list(data)
    log.info("evaluating %s: %d prompts x %d samples, seed %d", src.path, len(records), args.n, args.seed)
    dump = open(args.dump, "w") if args.dump else contextlib.nullcontext()  # noqa: SIM115 - closed by the with
    with dump, _engine(args, src, tokenizer) as engine, RewardManager(score_fn, max_response_length=args.max_tokens) as rm:
        # The trainer's validation chunks and group ids (trainer/validate.py): the same per-sample seeds.
        for start in range(0, len(records), 256):
            chunk = records[start:start + 256]
            rollout = stages.generate(engine, chunk, sampling, group_suffix="val", pad_id=tokenizer.pad_id,
                                      max_response_length=args.max_tokens)
            scored = stages.score(rollout, chunk, n=args.n, tokenizer=tokenizer, reward_manager=rm)
            for i, acc in enumerate(scored.extra["acc"]):
                correct[chunk[i // args.n].uid].append(bool(acc))
                if args.dump:
                    dump.write(json.dumps({"uid": chunk[i // args.n].uid, "sample": int(rollout.sample_index[i]),
                                           "response": scored.response_text[i], "score": float(scored.scores[i]),
                                           "acc": bool(acc)}) + "\n")
    return summarize(correct, ks)


def main(argv: list[str] | None = None) -> int:
    from megatron_dapo.config import ConfigError
    from megatron_dapo.data.dataset import DatasetError
    from megatron_dapo.trainer.checkpoint import CheckpointCorrupt
    from megatron_dapo.trainer.run import quiet_libraries

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    quiet_libraries()
    args = _parse(argv)
    torch.manual_seed(0)
    try:
        figures = evaluate(args)
    except (ConfigError, DatasetError, CheckpointCorrupt, FileNotFoundError, ValueError) as e:
        print(f"eval error: {e}", file=sys.stderr)  # one line, like train's
        return 2
    for k, v in figures.items():
        print(f"{k:>12}: {v:.4f}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
