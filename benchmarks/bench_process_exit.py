"""The CPU a training process spends after its last line: `sys.exit` (the interpreter's teardown) against
`trainer.run.exit_process` (the same exit steps, no teardown), as `python -m megatron_dapo.train` ends.

    python benchmarks/bench_process_exit.py [--runs 3]

Each run starts a child that imports what a trainer rank imports (torch, Megatron-Core, the trainer, the
actor builder), builds the project's Megatron-Core model with its optimizer at the embedded default's size
(configs/tiny_cpu.yaml's model, one gloo rank), freezes the startup objects as `build_trainer` does, writes
its CPU seconds so far, and exits one way or the other. The parent reads the child's whole CPU from
`os.wait4`: the difference is the exit. Prints the median per way and ends with one JSON line.
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

ROOT = pathlib.Path(__file__).resolve().parents[1]

CHILD = """
import gc, os, sys, time
import torch
from megatron_dapo.config import load_config
from megatron_dapo.trainer.run import exit_process, freeze_startup_objects
from megatron_dapo.trainer import fit  # noqa: F401  (what a trainer rank imports)
from megatron_dapo.workers.build import build_actor
from megatron_dapo.parallel import init_parallel

cfg = load_config(os.path.join(sys.argv[3], "configs/tiny_cpu.yaml"), [])
pgs = init_parallel(seed=cfg.trainer.seed)
actor = build_actor(cfg, pgs, vocab_size=256, pad_id=0)
freeze_startup_objects()
with open(sys.argv[2], "w") as f:
    f.write(f"{time.process_time()} {gc.get_freeze_count()}")
if sys.argv[1] == "exit_process":
    exit_process(0)
sys.exit(0)
"""


def one_run(way: str) -> tuple[float, int]:
    """(CPU seconds of the child after its last line, objects frozen)."""
    with tempfile.TemporaryDirectory() as d:
        mark = os.path.join(d, "mark")
        env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                   RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", PYTHONWARNINGS="ignore")
        proc = subprocess.Popen([sys.executable, "-c", CHILD, way, mark, str(ROOT)], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)
        err = proc.stderr.read().decode(errors="replace")
        proc.stderr.close()
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"the {way} child failed:\n{err[-3000:]}")
        before, frozen = open(mark).read().split()
        return usage.ru_utime + usage.ru_stime - float(before), int(frozen)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    result = {}
    for way in ("sys_exit", "exit_process"):
        runs = [one_run(way) for _ in range(args.runs)]
        seconds = statistics.median(s for s, _ in runs)
        result[f"{way}_cpu_s"] = round(seconds, 3)
        result["objects_frozen"] = runs[-1][1]
        print(f"{way:>13}: {seconds:.3f} s of CPU after the last line (median of {args.runs}: "
              f"{', '.join(f'{s:.3f}' for s, _ in runs)})")
    result["saved_cpu_s"] = round(result["sys_exit_cpu_s"] - result["exit_process_cpu_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
