"""fused_logprob_entropy / fused_logprob_stats with the vocabulary split over 2 tensor-parallel gloo ranks.

Each rank holds half of weight [V, H] (Megatron's layout: rank r owns rows [r V/2, (r+1) V/2)),
the same hidden [N, H] and the same global labels [N]; the result must equal the unsharded
reference: logprobs, entropy and sum_v p_v^2 [N], the full hidden gradient [N, H] on every rank,
and on rank r the rows of the reference weight gradient that rank owns; the no-grad call (old
log-probs) gives the differentiable call's values bit for bit. fp32 tolerances as in
test_logprob_entropy.py (only the summation order differs).
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing import assert_close

from tests.kernels.test_logprob_entropy import FP32_TOL, make_inputs, run

WORLD = 2
N, H, V = 11, 24, 202  # 101 columns per rank: partial vocab tiles on both ranks


def _worker(rank: int, init_file: str, backends: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        from megatron_dapo.kernels import (
            fused_logprob_entropy,
            fused_logprob_entropy_reference,
            fused_logprob_stats,
            fused_logprob_stats_reference,
        )

        hidden, weight, labels, g_lp, g_ent = make_inputs(N, H, V, seed=3)
        labels[1] = V // 2 - 1  # last column of rank 0
        labels[2] = V // 2  # first column of rank 1
        want = run(fused_logprob_entropy_reference, hidden, weight, labels, g_lp, g_ent, temperature=0.8)
        rows = slice(rank * V // WORLD, (rank + 1) * V // WORLD)
        for backend in backends:
            got = run(fused_logprob_entropy, hidden, weight[rows], labels, g_lp, g_ent, temperature=0.8,
                      tp_group=dist.group.WORLD, backend=backend, chunk_size=4)
            for name, a, b in zip(("logprobs", "entropy", "grad_hidden", "grad_weight shard"), got,
                                  (*want[:3], want[3][rows])):
                assert_close(a, b, **FP32_TOL, msg=lambda m, n=name, be=backend: f"rank {rank} {be} {n}: {m}")
            kwargs = dict(temperature=0.8, tp_group=dist.group.WORLD, backend=backend, chunk_size=4,
                          compute_sum_sq=True)
            _, _, sq_want = fused_logprob_stats_reference(hidden, weight, labels, temperature=0.8, compute_sum_sq=True)
            with torch.no_grad():
                old = fused_logprob_stats(hidden, weight[rows], labels, **kwargs)
            new = fused_logprob_stats(hidden, weight[rows].clone().requires_grad_(), labels, **kwargs)
            assert_close(old[2], sq_want, **FP32_TOL, msg=lambda m, be=backend: f"rank {rank} {be} sum_sq: {m}")
            for name, a, b in zip(("logprobs", "entropy", "sum_sq"), old, new):
                assert torch.equal(a, b.detach()), f"rank {rank} {backend} no-grad {name} differs"
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_tp2_vocab_sharded_results_equal_the_unsharded_reference(tmp_path):
    backends = ["torch"]
    # the CPU workers can run the triton kernels only through the interpreter (inherited env)
    if os.environ.get("TRITON_INTERPRET") == "1":
        backends.append("triton")
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"), backends), nprocs=WORLD, join=True)
