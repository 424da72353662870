"""Evaluate a model on a prompt set: avg@n (mean accuracy over n samples) and unbiased pass@k.

    python -m megatron_dapo.eval --model CKPT_OR_HF_DIR --data aime-2024.parquet --n 32 \
        --temperature 1.0 --top-p 0.7 --max-tokens 20480

--model is an HF checkpoint directory (config.json + safetensors) or a trainer checkpoint
(`.../ckpt/global_step_<k>` written at any TP / PP / EP, or `.../ckpt` for its latest step; the run's
config.yaml gives the architecture and tokenizer; see `convert.load_trainer_checkpoint`).
--data is a parquet / jsonl file in the DAPO-Math / AIME layout, or `arithmetic` for the synthetic
task's validation split. For a trainer checkpoint, the options not given (n, sampling, lengths, the
reward) are the run's own (its rollout.val_kwargs, data.* and reward.*).
Generation uses the local Megatron engine (or SGLang servers with
--engine sglang --sglang-url URL). The last line printed is a JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import defaultdict

import torch


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
    p.add_argument("--data", required=True)
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
    p.add_argument("--sglang-url", action="append", default=[])
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


_DEFAULTS = {"n": 32, "temperature": 1.0, "top_p": 0.7, "top_k": -1, "max_tokens": 20480, "max_prompt_length": 4096}


def _load_model(path: str, tokenizer_spec: str | None):
    """(GPTModel, tokenizer spec, pgs, the run's Config or None) from an HF directory or a trainer checkpoint."""
    from megatron_dapo.parallel import init_parallel

    pgs = init_parallel()
    if os.path.exists(os.path.join(path, "config.json")):
        from megatron_dapo.models.hf import load_hf_as_mcore

        return load_hf_as_mcore(path, pgs=pgs), tokenizer_spec if tokenizer_spec is not None else path, pgs, None
    from megatron_dapo.convert import is_trainer_checkpoint, load_trainer_checkpoint

    if is_trainer_checkpoint(path):
        # Any layout the trainer wrote (TP / PP / EP / VPP): resharded into one process's model.
        loaded = load_trainer_checkpoint(path, backend=None)
        spec = tokenizer_spec if tokenizer_spec is not None else loaded.cfg.data.tokenizer
        return loaded.model, spec, loaded.pgs, loaded.cfg
    raise FileNotFoundError(f"--model {path}: neither an HF directory (config.json) nor a trainer checkpoint "
                            "(trainer_state.pt, or a ckpt/ directory with latest_checkpointed_iteration.txt)")


def _fill_defaults(args, run) -> None:
    """Options not given come from the run's config for a trainer checkpoint (its validation sampling,
    rollout.val_kwargs, and its lengths, which its model was built for), else from _DEFAULTS."""
    from_run = {} if run is None else {
        "n": run.rollout.val_kwargs.n, "temperature": run.rollout.val_kwargs.temperature,
        "top_p": run.rollout.val_kwargs.top_p, "top_k": run.rollout.val_kwargs.top_k,
        "max_tokens": run.data.max_response_length, "max_prompt_length": run.data.max_prompt_length}
    for name, default in _DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, from_run.get(name, default))


def _dataset(spec: str, tokenizer, max_prompt_length: int):
    if spec == "arithmetic":
        from megatron_dapo.config.schema import ArithmeticConfig
        from megatron_dapo.data.arithmetic import make_arithmetic_dataset

        a = ArithmeticConfig()  # the standard synthetic validation set, whatever model is evaluated
        return make_arithmetic_dataset("val", num_samples=a.num_val, seed=a.seed, min_digits=a.min_digits,
                                       max_digits=a.max_digits, operators=a.operators, tokenizer=tokenizer)
    from megatron_dapo.data.dataset import load_prompt_dataset

    return load_prompt_dataset(spec, tokenizer, max_prompt_length=max_prompt_length, prompt_overflow="error")


def evaluate(args) -> dict[str, float]:
    from megatron_dapo.data.tokenizer import load_tokenizer
    from megatron_dapo.rewards.manager import RewardManager, get_reward_fn
    from megatron_dapo.rollout.base import SamplingParams
    from megatron_dapo.trainer import stages

    model, tok_spec, pgs, run = _load_model(args.model, args.tokenizer)
    _fill_defaults(args, run)
    tokenizer = load_tokenizer(tok_spec)
    data = _dataset(args.data, tokenizer, args.max_prompt_length)
    if args.engine == "local":
        from megatron_dapo.rollout.local_engine import LocalEngine

        engine = LocalEngine(model, pgs=pgs, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    else:
        from megatron_dapo.rollout.sglang.engine import SGLangEngine

        if not args.sglang_url:
            raise SystemExit("--engine sglang needs --sglang-url (one per server)")
        engine = SGLangEngine(args.sglang_url)
    if args.reward != "auto":
        score_fn = get_reward_fn(args.reward)
    elif run is not None and (run.reward.custom_function.path or run.reward.function != "auto"):
        from megatron_dapo.rewards.build import build_score_fn

        score_fn = build_score_fn(run)  # the run's own reward (a custom function included)
    else:
        score_fn = get_reward_fn("arithmetic" if args.data == "arithmetic" else "math_dapo")
    sampling = SamplingParams(max_new_tokens=args.max_tokens, n=args.n, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, stop_token_ids=(tokenizer.eos_id,), seed=args.seed)
    ks = args.k or [k for k in (2 ** i for i in range(12)) if k <= args.n]
    correct: dict[str, list[bool]] = defaultdict(list)
    records = list(data)
    with RewardManager(score_fn, max_response_length=args.max_tokens) as rm:
        for start in range(0, len(records), 64):
            chunk = records[start:start + 64]
            rollout = stages.generate(engine, chunk, sampling, group_suffix="eval", pad_id=tokenizer.pad_id,
                                      max_response_length=args.max_tokens)
            scored = stages.score(rollout, chunk, n=args.n, tokenizer=tokenizer, reward_manager=rm)
            for i, acc in enumerate(scored.extra["acc"]):
                correct[chunk[i // args.n].uid].append(bool(acc))
    return summarize(correct, ks)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    torch.manual_seed(args.seed)
    figures = evaluate(args)
    for k, v in figures.items():
        print(f"{k:>12}: {v:.4f}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
