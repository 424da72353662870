"""The preflight of a run (`python -m megatron_dapo.train --config ... --check`, which the SLURM script runs
before it starts Ray or any trainer rank): everything a 16 x 8 job would otherwise find out minutes into the
allocation, checked on one CPU in seconds, all of it, one line per problem.

    the config resolves          (load_config: unknown keys, bad values, cross-checks)
    the tokenizer loads          data.tokenizer
    the data files load          data.train_files / data.val_files: every row, with that tokenizer, and
                                 at least one generation batch of usable prompts
    the epochs hold the steps    trainer.total_epochs over the prompts reaches trainer.total_training_steps
    the model fits the layout    model.hf_path's config.json (or the preset) against TP / PP / EP / VPP,
                                 and the tokenizer's vocabulary
    the reward loads             reward.custom_function
    the output is writable       trainer.output_dir's run directory and the checkpoint directory, not
                                 held by another run, and no checkpoints a fresh run would mix with
    the memory plan fits         the per-GPU plan (`python -m megatron_dapo.plan`) at --gpu-memory-gb

`check(cfg)` returns the problems as (what, message) pairs; `main` prints them and exits 2 if there are
any, else prints one "preflight: ok" line with what was checked.
"""

from __future__ import annotations

import os
import tempfile


def _writable(directory: str) -> str | None:
    """None when files can be created in `directory` (made if missing), else why not."""
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".preflight-"):
            pass
    except OSError as e:
        return f"cannot write there ({e.strerror or e})"
    return None


def check(cfg, *, gpu_memory_gib: float = 80.0) -> tuple[list[tuple[str, str]], list[str]]:
    """(problems, what was checked); a problem is (the key or file, the message)."""
    from megatron_dapo.config import ConfigError

    problems: list[tuple[str, str]] = []
    done: list[str] = []

    tokenizer = None
    try:
        from megatron_dapo.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(cfg.data.tokenizer)
        done.append(f"tokenizer ({tokenizer.vocab_size} tokens)")
    except Exception as e:  # noqa: BLE001 - any failure to load is the problem to report
        problems.append(("data.tokenizer", f"{cfg.data.tokenizer!r} does not load: {type(e).__name__}: {e}"))

    if tokenizer is None and cfg.data.task == "files":  # the rows cannot be read; the files must still exist
        for key, path in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
            if path and not os.path.isfile(path):
                problems.append((key, f"{path}: no such file"))
    if tokenizer is not None:
        from megatron_dapo.data.build import build_datasets
        from megatron_dapo.data.dataset import DatasetError

        try:
            train, val = build_datasets(cfg, tokenizer)
            done.append(f"data ({len(train)} training prompts" + (f", {len(val)} validation" if val else "") + ")")
        except (DatasetError, FileNotFoundError, ValueError) as e:
            problems.append(("data", str(e)))
        else:
            from megatron_dapo.trainer.schedule import schedule

            plan = schedule(cfg, prompts=len(train))
            if plan.problem():
                problems.append(("trainer.total_epochs", plan.problem()))
            else:
                done.append(f"schedule ({plan.steps} steps; the epochs hold {plan.gen_batches:,} generation batches)")

    arch = None
    try:
        from megatron_dapo.models.arch import check_layout
        from megatron_dapo.models.config_arch import model_arch

        arch = model_arch(cfg, vocab_size=tokenizer.vocab_size if tokenizer is not None else 0)
        p = cfg.parallel
        check_layout(arch, tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                     ep=p.expert_model_parallel_size, etp=p.expert_tensor_parallel_size,
                     vpp=p.virtual_pipeline_model_parallel_size)
        if cfg.model.hf_path and cfg.model.arch != "hf":  # the weights the actor starts from: the preset's shape
            from megatron_dapo.models.hf import arch_from_hf

            if not os.path.isfile(os.path.join(cfg.model.hf_path, "config.json")):
                raise FileNotFoundError(f"model.hf_path {cfg.model.hf_path!r} has no config.json (an HF model "
                                        "directory is expected)")
            hf = arch_from_hf(cfg.model.hf_path)
            differ = [f"{k} {getattr(hf, k)} (model.arch {getattr(arch, k)})"
                      for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                "num_query_groups", "vocab_size") if getattr(hf, k) != getattr(arch, k)]
            if differ:
                raise ValueError(f"{cfg.model.hf_path}/config.json is another model: " + ", ".join(differ))
        done.append(f"model ({arch.num_layers} layers, hidden {arch.hidden_size}) at the layout")
    except (OSError, ValueError, KeyError) as e:
        arch = None  # the plan needs the model's shape: it is checked once that is right
        where = cfg.model.hf_path if cfg.model.arch == "hf" else f"model.arch={cfg.model.arch}"
        problems.append(("model", f"{where}: {e}"))

    try:
        from megatron_dapo.rewards.build import build_score_fn

        build_score_fn(cfg)
        done.append("reward")
    except ConfigError as e:
        problems.append((e.key, e.message))

    from megatron_dapo.trainer.run import _check_fresh_start
    from megatron_dapo.trainer.rundir import holder

    for directory in dict.fromkeys((cfg.run_dir, cfg.ckpt_dir)):
        other = holder(directory)
        for problem in (_writable(directory), other and f"another run holds it: {other}"):
            if problem:
                problems.append((directory, problem))
    try:
        _check_fresh_start(cfg)
        done.append("output directories")
    except ConfigError as e:
        problems.append((e.key, e.message))

    if arch is not None:
        from megatron_dapo.plan import check_fits, plan_from_config, plan_host

        try:
            plan = plan_from_config(cfg, arch=arch, gpu_memory_gib=gpu_memory_gib)
            check_fits(plan, host=plan_host(cfg, memory_plan=plan))
            done.append(f"memory plan (training peak {plan.train_peak / 2**30:.1f} GiB of {gpu_memory_gib:g})")
        except ConfigError as e:
            problems.append((e.key, e.message))
        except ValueError as e:
            problems.append(("memory plan", str(e)))
    return problems, done


def main(cfg, *, gpu_memory_gib: float = 80.0) -> int:
    import sys

    problems, done = check(cfg, gpu_memory_gib=gpu_memory_gib)
    for what, message in problems:
        print(f"preflight: {what}: {' '.join(message.split())}", file=sys.stderr)
    if problems:
        return 2
    print(f"preflight: ok: {', '.join(done)}")
    return 0
