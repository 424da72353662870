"""RewardManager throughput: milliseconds per batch of the arithmetic reward in worker processes and inline.

    python benchmarks/bench_reward.py [--rows 384 4096] [--repeats 5]

The embedded default scores 384 responses a step (48 prompts x 8) in one worker process
(reward.timeout_s = 10, reward.num_workers = 1). Prints the median of `repeats` batches per row count
and mode, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from megatron_dapo.rewards import RewardManager, arithmetic


def _median_ms(manager: RewardManager, rows: int, repeats: int) -> float:
    responses = [str(i % 197) for i in range(rows)]
    truths = [str(i % 193) for i in range(rows)]
    manager.score(responses[:1], truths[:1], [1])  # start the workers outside the timed region
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        manager.score(responses, truths, [1] * rows)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[384, 4096])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    fn = arithmetic.compute_score
    figures = {}
    for rows in args.rows:
        for name, kw in (("workers1", {"timeout_s": 10.0, "num_workers": 1}),
                         ("workers2", {"timeout_s": 10.0, "num_workers": 2}), ("inline", {"timeout_s": 0.0})):
            with RewardManager(fn, max_response_length=16, **kw) as m:
                ms = _median_ms(m, rows, args.repeats)
            figures[f"{name}_{rows}_ms"] = round(ms, 2)
            print(f"{rows:6d} rows  {name:9s} {ms:8.2f} ms  ({ms * 1000 / rows:.1f} us/row)", flush=True)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
