"""What checkpoint manifests cost (trainer/checkpoint.py): SHA-256 of every file on save (write_manifest)
and its check on resume (verify_checkpoint), per GiB, on one process.

A checkpoint directory of `--gib` GiB of random bytes in `--files` files (a sharded model + optimizer
checkpoint's layout: many files of equal size) is written to a temporary directory, then hashed and
verified `--repeat` times; the figures are medians. On a cluster every rank hashes 1/world of the files,
so a save's added time is about (checkpoint GiB / ranks) / (GiB/s below), read from the page cache or
the file system.

    .venv/bin/python benchmarks/bench_checkpoint_manifest.py [--gib 2] [--files 16] [--repeat 3]

Prints human-readable lines, then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_dapo.trainer import checkpoint as ckpt  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--files", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    size = int(args.gib * 2**30 / args.files)
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(os.path.join(d, "model"))
        block = os.urandom(min(size, 64 * 2**20))
        for i in range(args.files):
            with open(os.path.join(d, "model", f"__{i}_0.distcp"), "wb") as f:
                left = size
                while left:
                    f.write(block[:min(left, len(block))])
                    left -= min(left, len(block))
        gib = size * args.files / 2**30
        save, load = [], []
        for _ in range(args.repeat):
            t = time.perf_counter()
            ckpt.write_manifest(d, is_rank0=True)
            save.append(time.perf_counter() - t)
            t = time.perf_counter()
            assert ckpt.verify_checkpoint(d) is None
            load.append(time.perf_counter() - t)
    s, v = statistics.median(save), statistics.median(load)
    print(f"{gib:.2f} GiB in {args.files} files, {ckpt.HASH}, median of {args.repeat} (files in the page cache):")
    print(f"  manifest on save: {s:.2f} s = {s / gib:.2f} s/GiB ({gib / s:.2f} GiB/s)")
    print(f"  check on resume:  {v:.2f} s = {v / gib:.2f} s/GiB ({gib / v:.2f} GiB/s)")
    print(json.dumps({"gib": round(gib, 3), "files": args.files, "algorithm": ckpt.HASH,
                      "save_s_per_gib": round(s / gib, 3), "verify_s_per_gib": round(v / gib, 3)}))


if __name__ == "__main__":
    main()
