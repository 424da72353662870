"""The trainer's memory around colocated rollout (workers/memory.py) and the servers' planned KV pool."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.config import load_config
from megatron_dapo.plan import plan_from_config
from megatron_dapo.rollout.sglang.build import sglang_launch_plan
from megatron_dapo.workers import memory

RECIPES = ("configs/dapo_qwen2.5_32b.yaml", "configs/dapo_qwen3_30b_a3b.yaml")


def test_free_for_rollout_offloads_then_collects_then_returns_the_cache(monkeypatch):
    calls = []

    class Offload:
        def offload(self):
            calls.append("offload")
            return 0

    monkeypatch.setattr(memory, "gc", type("GC", (), {"collect": staticmethod(lambda: calls.append("gc.collect"))}))
    monkeypatch.setattr(memory, "empty_cache", lambda: calls.append("empty_cache"))
    assert memory.free_for_rollout(Offload()) == {}  # no CUDA: no memory figures
    assert calls == ["offload", "gc.collect", "empty_cache"]
    calls.clear()
    memory.free_for_rollout(None)
    assert calls == ["gc.collect", "empty_cache"]


def test_offload_on_cpu_moves_nothing_and_leaves_the_state_as_it_was():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([p])
    p.grad = torch.ones(3)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    off = memory.OptimizerOffload(type("Megatron", (), {"optimizer": opt})(), masters=True)
    assert off.offload() == 0 and off.reload() == 0
    assert all(torch.equal(opt.state[p][k], v) for k, v in before.items())


def _recipe(path: str, *overrides: str):
    return load_config(path, list(overrides))


@pytest.mark.parametrize("recipe", RECIPES)
def test_colocated_gpu_servers_get_the_planned_steady_state_kv_pool(recipe):
    """--max-total-tokens of launched colocated servers is the planner's pool beside the trainer's steady
    state, below what SGLang would size at launch (Adam's moments do not exist yet then)."""
    cfg = _recipe(recipe)
    plan = plan_from_config(cfg, gpu_memory_gib=80)
    specs, _, _ = sglang_launch_plan(cfg, gpu_memory_gib=80)
    assert {s.max_total_tokens for s in specs} == {plan.rollout_kv_tokens}
    assert plan.max_seq_len < plan.rollout_kv_tokens < plan.rollout_kv_tokens_at_launch
    offloaded = _recipe(recipe, "actor.offload_optimizer=true")
    specs_off, _, _ = sglang_launch_plan(offloaded, gpu_memory_gib=80)
    assert specs_off[0].max_total_tokens == plan_from_config(offloaded, gpu_memory_gib=80).rollout_kv_tokens
    assert plan.rollout_kv_tokens < specs_off[0].max_total_tokens <= plan.rollout_kv_tokens_at_launch


@pytest.mark.parametrize("overrides", [
    ("rollout.server_max_total_tokens=1234",),           # the user's value stands
    ("rollout.server_device=cpu",),                      # a CPU server sizes from host memory
    ("rollout.mode=disaggregate", "rollout.sglang_urls=[http://10.0.0.1:30000]"),
])
def test_no_planned_cap_where_it_does_not_apply(overrides):
    cfg = _recipe(RECIPES[0], *overrides)
    specs, _, _ = sglang_launch_plan(cfg, gpu_memory_gib=80)
    want = 1234 if "1234" in overrides[0] else None
    assert {s.max_total_tokens for s in specs} == {want}
    assert sglang_launch_plan(_recipe(RECIPES[0]))[0][0].max_total_tokens is None  # no GPU to plan for
