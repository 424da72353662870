"""What a checkpoint costs the training loop, synchronous against asynchronous (trainer.async_save), on CPU.

A random model of the tiny CPU config's family made larger (8 layers, hidden 512, ffn 2048: about 26M
parameters; with fp32 Adam its checkpoint is about 0.3 GB) runs `--steps` steps three times, each in a
fresh process: with no checkpoint but the last step's, with a synchronous save after every step, and
with an asynchronous one after every step. Per mode:

    fit_s                     wall time of DAPOTrainer.fit (every step, and the saves)
    step_s                    fit_s / steps
    first_save_s              the loop's time in the first save (it also starts the writers' result-queue
                              process, once per run)
    blocked_per_later_save_s  median over the later saves of the loop's time in a save call plus the
                              completions that follow it (for the asynchronous mode: staging and starting
                              the writer, then waiting for it if it is not done, Megatron's metadata, the
                              manifest of the files the trainer wrote itself, the rename)
    ckpt_mb                   size of the last checkpoint

On a GPU node the background writer runs on host cores the training step barely uses; on a 2-core CPU
machine it competes with the step itself, so the overlap gains less here than there.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_async_save.py [--steps 6]

Prints human-readable lines, then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHAPE = ["trainer.sft_warmup_steps=0", "algorithm.filter_groups.enable=false", "trainer.test_freq=0",
         "trainer.val_before_train=false", "trainer.logger=[tensorboard]", "data.arithmetic.num_train=2000",
         "data.arithmetic.num_val=8", "data.train_batch_size=8", "data.gen_batch_size=8", "rollout.n=4",
         "actor.ppo_mini_batch_size=8", "data.max_response_length=6", "reward.overlong_buffer.len=4",
         "model.num_layers=8", "model.hidden_size=512", "model.ffn_hidden_size=2048",
         "model.num_attention_heads=8", "model.num_query_groups=8", "trainer.max_ckpt_to_keep=2"]
MODES = {"no_save": ["trainer.save_freq=-1"], "sync": ["trainer.save_freq=1"],
         "async": ["trainer.save_freq=1", "trainer.async_save=true"]}


def child(mode: str, steps: int, out: str) -> dict:
    """One mode in this process: fit with the save calls timed."""
    import logging

    from megatron_dapo.config import load_config
    from megatron_dapo.trainer.run import build_trainer, close_parts

    logging.disable(logging.INFO)
    cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"),
                      SHAPE + MODES[mode] + [f"trainer.total_training_steps={steps}", f"trainer.output_dir={out}",
                                             "trainer.experiment_name=b"])
    trainer = build_trainer(cfg)
    calls: list[tuple[str, float]] = []  # ("save" | "finish", seconds), in order

    def timed(fn, kind):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                calls.append((kind, time.perf_counter() - t0))
        return wrapper

    trainer._save = timed(trainer._save, "save")
    trainer._finish_save = timed(trainer._finish_save, "finish")
    t0 = time.perf_counter()
    try:
        trainer.fit()
    finally:
        close_parts(trainer.p)
    fit_s = time.perf_counter() - t0
    per_save: list[float] = []  # a save's call plus the completions that follow it, until the next save
    for kind, seconds in calls:
        if kind == "save":
            per_save.append(seconds)
        elif per_save:
            per_save[-1] += seconds
    last = pathlib.Path(out) / "b/ckpt" / f"global_step_{steps}"
    size = sum(p.stat().st_size for p in last.rglob("*") if p.is_file())
    later = per_save[1:]
    return {"fit_s": fit_s, "step_s": fit_s / steps, "saves": len(per_save), "first_save_s": per_save[0],
            "blocked_per_later_save_s": statistics.median(later) if later else None, "ckpt_mb": size / 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--child", choices=list(MODES))
    p.add_argument("--out")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.out)))
        return
    figures = {}
    for mode in MODES:
        with tempfile.TemporaryDirectory() as out:
            r = subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(args.steps), "--out", out],
                               cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            if r.returncode != 0:
                sys.exit(f"{mode} failed:\n{r.stderr[-3000:]}")
            figures[mode] = json.loads(r.stdout.strip().splitlines()[-1])
        f = figures[mode]
        later = f"{f['blocked_per_later_save_s']:.2f} s" if f["blocked_per_later_save_s"] is not None else "-"
        print(f"{mode:8s} fit {f['fit_s']:6.1f} s  step {f['step_s']:5.2f} s  {f['saves']} saves: the first "
              f"{f['first_save_s']:.2f} s, each later one {later} (median)  checkpoint {f['ckpt_mb']:.0f} MB")
    base = figures["no_save"]["step_s"]
    for mode in ("sync", "async"):
        figures[mode]["step_s_added_by_saving"] = figures[mode]["step_s"] - base
    print(f"a save after every step adds {figures['sync']['step_s_added_by_saving']:.2f} s per step synchronously, "
          f"{figures['async']['step_s_added_by_saving']:.2f} s asynchronously")
    print(json.dumps({"steps": args.steps, **figures}))


if __name__ == "__main__":
    main()
