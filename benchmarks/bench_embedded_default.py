"""The embedded default (`make train`) on this machine: minutes, GEMM rate, held-out accuracy before and after.

    python benchmarks/bench_embedded_default.py [--threads 2] [key=value ...]

Runs `python -m megatron_dapo.train --config configs/tiny_cpu.yaml` from an empty output directory (the
supervised warm-up included, as a new user's first `make train`), then reads the run's TensorBoard
events back. Prints the processor, the fp32 GEMM rate at the model's training shapes and on a square
1024 GEMM, the wall-clock minutes of the whole run and up to the end of the warm-up (start-up included), and mean@4 / pass@4 on the
held-out problems at step 0 (after the warm-up) and at the last step. Ends with one JSON line.
Extra `key=value` arguments go to the run (e.g. `trainer.seed=1`). Also prints how many generation batches
dynamic sampling needed per step (mean, max), against algorithm.filter_groups.max_num_gen_batches.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def processor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gemm_gflops(M: int, K: int, N: int, *, budget_s: float = 0.5) -> float:
    """Best fp32 [M, K] @ [K, N] rate in GFLOP/s, repeated within about budget_s."""
    a, b = torch.randn(M, K), torch.randn(K, N)
    a @ b
    best, spent = float("inf"), 0.0
    while spent < budget_s or best == float("inf"):
        t0 = time.perf_counter()
        a @ b
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return 2 * M * K * N / best / 1e9


def _scalars(run_dir: str, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(run_dir, "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the run (default: unset, as make train)")
    args, extra = ap.parse_known_args(argv)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    # The training GEMMs of the tiny model: 2,048 tokens through hidden 128 -> ffn 2 x 256, and square 1024.
    model_rate = gemm_gflops(2048, 128, 512)
    square_rate = gemm_gflops(1024, 1024, 1024)
    print(f"processor: {processor()}; {threads} threads; fp32 GEMM {model_rate:.0f} GFLOP/s at [2048,128]x[128,512], "
          f"{square_rate:.0f} GFLOP/s at 1024^3", flush=True)
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "megatron_dapo.train", "--config", "configs/tiny_cpu.yaml",
               f"trainer.output_dir={out}", *extra]
        started, t0 = datetime.now(), time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        total_s = time.perf_counter() - t0
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            print(log[-4000:])
            raise SystemExit(f"the run failed with exit code {proc.returncode}")
        run_dir = glob.glob(os.path.join(out, "*", "tb"))[0].rsplit("/tb", 1)[0]
        mean = _scalars(run_dir, "val/arithmetic/acc/mean@4")
        best = _scalars(run_dir, "val/arithmetic/acc/pass@4")
        gen_batches = [v for _, v in _scalars(run_dir, "train/num_gen_batches")]
    warm = re.search(r"supervised warm-up: (\{.*\})", log)
    warm_m = json.loads(warm.group(1).replace("'", '"')) if warm else {}
    stamps = re.findall(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) .*supervised warm-up: ", log, re.M)
    warm_s = ((datetime.strptime(stamps[-1], "%Y-%m-%d %H:%M:%S,%f") - started).total_seconds()
              if stamps else None)
    figures = {
        "processor": processor(), "threads": threads,
        "gemm_gflops_model_shape": round(model_rate, 1), "gemm_gflops_1024": round(square_rate, 1),
        "minutes": round(total_s / 60, 2),
        "minutes_to_warmup_end": None if warm_s is None else round(warm_s / 60, 2),
        "warmup_steps": warm_m.get("sft/steps"), "warmup_probe_acc": warm_m.get("sft/probe_acc"),
        "mean4_before": round(mean[0][1], 3) if mean else None, "mean4_after": round(mean[-1][1], 3) if mean else None,
        "pass4_before": round(best[0][1], 3) if best else None, "pass4_after": round(best[-1][1], 3) if best else None,
        "mean4_curve": [[s, round(v, 3)] for s, v in mean],
        # dynamic sampling's generation batches per step: how close the run came to max_num_gen_batches
        "gen_batches_max": int(max(gen_batches)) if gen_batches else None,
        "gen_batches_mean": round(sum(gen_batches) / len(gen_batches), 2) if gen_batches else None,
        "steps_over_5_gen_batches": sum(1 for g in gen_batches if g > 5),
    }
    print(f"run: {figures['minutes']} min (warm-up: {figures['warmup_steps']} steps, probe {figures['warmup_probe_acc']}); "
          f"held-out mean@4 {figures['mean4_before']} -> {figures['mean4_after']}, "
          f"pass@4 {figures['pass4_before']} -> {figures['pass4_after']}; generation batches per step: mean "
          f"{figures['gen_batches_mean']}, max {figures['gen_batches_max']}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
