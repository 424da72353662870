"""cpu_compat: every shim makes the Megatron operation it exists for work on a CPU-only torch.

Each test names the shim (see the comments in megatron_dapo/models/cpu_compat.py). The EP=2
alltoall exchange that "a2asplits" enables for real runs in test_multiproc.py.
"""

import threading

import pytest
import torch

from megatron_dapo.models import cpu_compat
from megatron_dapo.models.arch import get_arch
from megatron_dapo.models.builder import build_gpt_model

from .conftest import sample_tokens

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is for CPU-only torch")


def test_install_twice_changes_nothing(pgs):
    import megatron.core.transformer.moe.token_dispatcher as td

    assert cpu_compat.is_installed()
    before = (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.Stream,
              td.maybe_move_tensor_to_cpu, torch._C._len_torch_function_stack())
    cpu_compat.install()
    cpu_compat.install()
    after = (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.Stream,
             td.maybe_move_tensor_to_cpu, torch._C._len_torch_function_stack())
    assert before == after


def test_curdev_rope_forward_runs_on_cpu(pgs):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    assert torch.cuda.current_device() == "cpu"
    rope = RotaryEmbedding(kv_channels=32, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)
    emb = rope(16)
    assert emb.shape == (16, 1, 1, 32) and emb.device.type == "cpu"
    # angle of position p, frequency i is p * base^(-2i/d)
    torch.testing.assert_close(emb[5, 0, 0, 1], torch.tensor(5 * 10000 ** (-2 / 32)))


def test_rng_tracker_fork_works_without_cuda_rng(pgs):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    with get_cuda_rng_tracker().fork():
        x = torch.rand(3)
    assert x.shape == (3,)


def test_ckptrng_and_recompute_full_activation_recompute_gives_the_plain_gradient(pgs):
    """model.recompute=full: the checkpoint saves and restores the (absent) CUDA generator ("ckptrng") and
    recomputes each layer inside the backward pass under the device mode ("recompute")."""
    tokens, pos = sample_tokens(2, 16, vocab=512, seed=4)
    grads = []
    for overrides in ({}, {"recompute_granularity": "full", "recompute_method": "uniform",
                           "recompute_num_layers": 1}):
        model = build_gpt_model(get_arch("tiny"), pgs=pgs, seed=2, config_overrides=overrides)
        model.train()
        model(tokens, pos, None).float().square().mean().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)


def test_tegemm_moe_router_forward(pgs):
    model = build_gpt_model(get_arch("tiny_moe"), pgs=pgs, seed=2)
    router = model.decoder.layers[0].mlp.router
    probs, routing_map = router(torch.randn(8, 1, 128))
    assert routing_map.shape == (8, 4) and (routing_map.sum(-1) == 2).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(8))     # renormalised top-2


def test_streams_alltoall_dispatcher_builds_and_events_time(pgs):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    model = build_gpt_model(get_arch("tiny_moe"), pgs=pgs, seed=2, moe_token_dispatcher_type="alltoall")
    assert isinstance(model.decoder.layers[0].mlp.token_dispatcher, MoEAlltoAllTokenDispatcher)
    ids, pos = sample_tokens(2, 8, vocab=512)
    assert model(ids, pos).shape == (2, 8, 512)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    end.record()
    assert start.elapsed_time(end) >= 0.0
    torch.cuda.current_stream().record_event()
    torch.cuda.nvtx.range_push("x")
    torch.cuda.nvtx.range_pop()


def test_a2asplits_cpu_split_sizes_become_numpy(pgs):
    import numpy as np
    from megatron.core.transformer.moe import token_dispatcher as td

    out = td.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert isinstance(out, np.ndarray) and out.tolist() == [3, 1]
    assert torch.is_tensor(td.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=False))


def test_devmode_rewrites_cuda_placement_and_type_strings(pgs):
    x = torch.ones(2, device="cuda")
    assert x.device.type == "cpu" and x.cuda() is x and x.pin_memory() is x
    assert x.to("cuda").device.type == "cpu"
    assert x.type() == "torch.cuda.FloatTensor"
    assert x.type("torch.cuda.DoubleTensor").dtype == torch.float64


def test_devmode_is_per_thread_and_enter_device_mode_enables_it(pgs):
    results = {}

    def plain():
        try:
            torch.ones(1, device="cuda")
            results["plain"] = "ok"
        except (AssertionError, RuntimeError) as err:     # CPU-only torch refuses cuda
            results["plain"] = type(err).__name__

    def entered():
        cpu_compat.enter_device_mode()
        results["entered"] = torch.ones(1, device="cuda").device.type

    for fn in (plain, entered):
        t = threading.Thread(target=fn)
        t.start()
        t.join()
    assert results == {"plain": results["plain"], "entered": "cpu"} and results["plain"] != "ok"


def test_devmode_pp1_schedule_and_optimizer_step_with_grad_clip(pgs):
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = build_gpt_model(get_arch("tiny"), pgs=pgs, seed=5)
    config = model.config
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.5), [ddp])
    config.finalize_model_grads_func = finalize_model_grads
    ids, pos = sample_tokens(2, 16, vocab=512)

    def forward_step(data_iterator, m):
        loss = m(ids, pos, labels=ids.roll(-1, 1))
        return loss, lambda out: (out.mean(), {"loss": out.mean().detach()})

    before = [p.detach().clone() for p in model.parameters()]
    ddp.zero_grad_buffer()
    opt.zero_grad()
    losses = get_forward_backward_func(pp_size=1, vp_size=None)(
        forward_step_func=forward_step, data_iterator=iter([None]), model=[ddp], num_microbatches=1,
        seq_length=16, micro_batch_size=2, forward_only=False, pg_collection=pgs.collection)
    expected_norm = torch.sqrt(sum((p.main_grad.float() ** 2).sum() for p in model.parameters()))
    ok, grad_norm, _ = opt.step()
    assert ok and len(losses) == 1 and torch.isfinite(losses[0]["loss"])
    assert grad_norm == pytest.approx(expected_norm.item(), rel=1e-5) and grad_norm > 0.5
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_sync_dist_checkpoint_save_load_round_trip(pgs, tmp_path):
    from megatron.core import dist_checkpointing

    src = build_gpt_model(get_arch("tiny"), pgs=pgs, seed=11)
    dst = build_gpt_model(get_arch("tiny"), pgs=pgs, seed=12)
    dist_checkpointing.save(src.sharded_state_dict(), str(tmp_path))
    dst.load_state_dict(dist_checkpointing.load(dst.sharded_state_dict(), str(tmp_path)))
    for (name, a), b in zip(src.named_parameters(), dst.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_missing_psutil_is_reported_instead_of_a_silent_checkpoint_hang(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "psutil" else real(name, *a))
    with pytest.raises(ImportError, match="psutil is required"):
        cpu_compat.check_required_packages()
