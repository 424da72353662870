"""CUDA check of the optimizer offload around colocated rollout (workers/memory.py; its order is tested on
CPU in tests/trainer/test_cluster_in_a_box.py): the state leaves the GPU, comes back, and the next step is
the step without offload."""

import pytest
import torch

from megatron_dapo.workers.memory import OptimizerOffload, free_for_rollout, reclaim_for_training

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _setup():
    torch.manual_seed(0)
    masters = [torch.nn.Parameter(torch.randn(1024, 1024, device="cuda")) for _ in range(4)]  # fp32 masters
    opt = torch.optim.Adam(masters, lr=1e-2)
    for p in masters:
        p.grad = torch.randn_like(p)
    opt.step()
    return masters, opt, type("MegatronLike", (), {"optimizer": opt})()


def test_offload_moves_masters_and_moments_to_pinned_host_and_back_unchanged():
    masters, opt, megatron = _setup()
    ref_masters, ref_opt, _ = _setup()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    off = OptimizerOffload(megatron, masters=True)
    metrics = free_for_rollout(off)
    expected = 3 * 4 * 1024 * 1024 * 4  # masters + exp_avg + exp_avg_sq, fp32
    assert metrics["perf/optimizer_offloaded_gib"] * 2**30 == expected
    assert before - torch.cuda.memory_allocated() >= expected
    assert all(p.device.type == "cpu" and p.is_pinned() for p in masters)
    assert all(s["exp_avg"].device.type == "cpu" for s in opt.state.values())
    reclaim_for_training(off)
    assert all(p.device.type == "cuda" for p in masters)
    for p, q in zip(masters, ref_masters):
        p.grad = q.grad = torch.ones_like(p)
    opt.step()
    ref_opt.step()
    for p, q in zip(masters, ref_masters):
        assert torch.equal(p, q)
    free_for_rollout(off)  # the pinned buffers are reused: a second offload allocates no host memory
    assert len(off._host) == 3 * 4
