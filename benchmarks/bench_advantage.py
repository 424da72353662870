"""Time vectorised GRPO advantages against the per-row loop (the specification).

Both are called exactly as the trainer calls them: 16,384 responses in groups of 16, rewards on
the last valid token of a random-length response (T=256), prompt ids as uuid strings (what the
sampler produces) and, second, as an int64 tensor. The loop version is
`compute_grpo_outcome_advantage` itself. Prints human-readable lines, then one JSON object.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_advantage.py
"""

from __future__ import annotations

import json
import time
import uuid

import numpy as np
import torch

from megatron_dapo.algos.advantage import (
    compute_grpo_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
)

ROWS, GROUP, T = 16_384, 16, 256


def make_batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (ROWS,), generator=gen)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()  # [B, T]
    rewards = torch.zeros(ROWS, T)
    rewards[torch.arange(ROWS), lengths - 1] = torch.randint(0, 2, (ROWS,), generator=gen).float() * 2 - 1
    uids = [
        str(uuid.UUID(int=int(i), version=4))
        for i in torch.randint(0, 2**62, (ROWS // GROUP,), generator=gen)
    ]
    index_str = np.array([u for u in uids for _ in range(GROUP)], dtype=object)
    index_int = torch.arange(ROWS // GROUP).repeat_interleave(GROUP)
    return rewards, mask, index_str, index_int


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    torch.manual_seed(0)
    rewards, mask, index_str, index_int = make_batch()
    figures = {"rows": ROWS, "group": GROUP, "response_len": T, "threads": torch.get_num_threads()}
    for label, index in (("str", index_str), ("int", index_int)):
        loop_adv, _ = compute_grpo_outcome_advantage(rewards, mask, index)
        vec_adv, _ = compute_grpo_vectorized_outcome_advantage(rewards, mask, index)
        max_diff = (loop_adv - vec_adv).abs().max().item()
        loop_s = best_of(lambda index=index: compute_grpo_outcome_advantage(rewards, mask, index), 3)
        vec_s = best_of(
            lambda index=index: compute_grpo_vectorized_outcome_advantage(rewards, mask, index), 20
        )
        print(
            f"index={label}: loop {loop_s * 1e3:9.1f} ms   vectorized {vec_s * 1e3:7.2f} ms   "
            f"speedup {loop_s / vec_s:6.1f}x   max |diff| {max_diff:.2e}"
        )
        suffix = "" if label == "str" else "_int_index"
        figures.update(
            {
                f"loop_s{suffix}": round(loop_s, 5),
                f"vectorized_s{suffix}": round(vec_s, 6),
                f"speedup{suffix}": round(loop_s / vec_s, 1),
                f"max_abs_diff{suffix}": max_diff,
            }
        )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
