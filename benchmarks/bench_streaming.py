"""Streaming dynamic sampling against whole generation batches, on the tiny CPU config's shape.

The embedded default's batch shape when these figures were taken, pinned here (SHAPE: data.train_batch_size 32
from data.gen_batch_size 48, rollout.n 8, responses of at most 12 tokens, the local engine's rows per forward
rollout.max_num_seqs 256; the default is now 64 from 96 x 4 in forwards of 384 rows) with a random
model (no SFT warm-up, so the run starts at once) and dynamic sampling on the shaped reward (seq_reward: a
random model never answers right, but the overlong penalty varies with the response length inside a group).
Each mode runs `STEPS` steps of `DAPOTrainer.fit` in this process, one after the other; figures are means
over steps 2.. (step 1 pays one-off start-up costs):

    gen_tokens_per_trained_token  every response token generated / response tokens trained on
    step_s, gen_s                 perf/time_per_step and timing_s/gen
    cut_groups                    groups streaming cut per step
    kept_len, finished_len        mean response length of the trained rows / of every finished row

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_streaming.py [--quick] [--steps N]

Prints human-readable lines, then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHAPE = ["trainer.sft_warmup_steps=0", "algorithm.filter_groups.metric=seq_reward", "trainer.test_freq=0",
         "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.logger=[tensorboard]",
         "data.arithmetic.num_train=2000", "data.arithmetic.num_val=8"]
METRICS = {"gen_tokens_per_trained_token": "train/gen_tokens_per_trained_token", "step_s": "perf/time_per_step",
           "gen_s": "timing_s/gen", "cut_groups": "train/num_cut_groups",
           "kept_len": "train/kept_response_length_mean", "finished_len": "train/finished_response_length_mean",
           "gen_batches": "train/num_gen_batches"}


def _means(run_dir: pathlib.Path) -> dict[str, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {k: statistics.mean(e.value for e in acc.Scalars(tag) if e.step >= 2) for k, tag in METRICS.items()}


def bench(out: pathlib.Path, steps: int, extra: list[str]) -> dict[str, float]:
    import logging

    from megatron_dapo.config import load_config
    from megatron_dapo.trainer.run import run

    logging.disable(logging.INFO)
    figures = {}
    for label, streaming in (("off", "false"), ("on", "true")):
        cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), SHAPE + extra + [
            f"trainer.output_dir={out}", f"trainer.experiment_name=streaming_{label}", f"trainer.total_training_steps={steps}",
            f"algorithm.filter_groups.streaming={streaming}"])
        t0 = time.perf_counter()
        run(cfg)
        figures[f"{label}_wall_s"] = time.perf_counter() - t0
        figures.update({f"{label}_{k}": v for k, v in _means(out / f"streaming_{label}").items()})
    return figures


SHAPE = ["data.train_batch_size=32", "data.gen_batch_size=48", "rollout.n=8", "actor.ppo_mini_batch_size=32",
         "rollout.max_num_seqs=256", "actor.lr=3e-4", "actor.adam_beta2=0.999"]


def main(argv: list[str]) -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--quick", action="store_true", help="3 steps of a quarter-size batch")
    args.add_argument("--steps", type=int, default=None)
    a = args.parse_args(argv)
    steps = a.steps or (3 if a.quick else 5)
    extra = SHAPE + (["data.train_batch_size=8", "data.gen_batch_size=12", "actor.ppo_mini_batch_size=4",
                      "rollout.max_num_seqs=64"] if a.quick else [])
    with tempfile.TemporaryDirectory() as tmp:
        f = bench(pathlib.Path(tmp), steps, extra)
    print(f"tiny_cpu shape{' (quick: a quarter of the batch)' if a.quick else ''}, random model, {steps} steps, "
          f"means over steps 2..{steps}:")
    print(f"  {'streaming':10s} {'gen tok/trained tok':>20s} {'step s':>8s} {'gen s':>8s} {'cut groups':>11s} "
          f"{'kept len':>9s} {'finished len':>13s}")
    for label in ("off", "on"):
        print(f"  {label:10s} {f[f'{label}_gen_tokens_per_trained_token']:20.3f} {f[f'{label}_step_s']:8.2f} "
              f"{f[f'{label}_gen_s']:8.2f} {f[f'{label}_cut_groups']:11.1f} {f[f'{label}_kept_len']:9.2f} "
              f"{f[f'{label}_finished_len']:13.2f}")
    figures = {"steps": steps, "quick": a.quick, "threads": torch.get_num_threads(), **f}
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}))


if __name__ == "__main__":
    main(sys.argv[1:])
