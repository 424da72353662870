"""The actor at production shapes on several gloo processes: expert parallelism with DP shards whose
packing gives EP partners different micro-batch counts (it deadlocked or crashed before every DP
rank ran the same count), against one process on the same weights."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from tests.standin import free_port
from tests.workers._actor_cases import random_batch

ROOT = pathlib.Path(__file__).resolve().parents[2]
MOE_OVERRIDES = {"model.arch": "tiny_moe", "actor.ppo_mini_batch_size": 4,
                 "actor.max_tokens_per_microbatch": 16,
                 "data.max_prompt_length": 4, "data.max_response_length": 8, "reward.overlong_buffer.len": 4}
"""The whole batch one mini-batch (Megatron's MoE aux loss is per micro-batch, so after an optimizer step
the runs would differ by design, not by error); a budget of 16 tokens: two rows of 11 tokens need two
micro-batches, 5 + 6 one."""


def moe_batch() -> dict:
    """16 rows, prompts of 3 tokens, one mini-batch over DP 4 (contiguous shards of 4 rows). Response
    lengths per rank (8, 8, 2, 3), (7, 1, 1, 2), (1, 2, 2, 1), (8, 7, 8, 7): the ranks plan 3, 2, 2 and 4
    micro-batches, so both EP pairs (ranks 0-1, 2-3) disagree."""
    raw = random_batch(seed=21, B=16, P=4, T=8)
    raw["prompt_length"] = torch.full((16,), 3)
    raw["response_length"] = torch.tensor([8, 8, 2, 3, 7, 1, 1, 2, 1, 2, 2, 1, 8, 7, 8, 7])
    raw["response_mask"] = (torch.arange(8)[None] < raw["response_length"][:, None]).float()
    return raw


def _torchrun(script: str, nproc: int, out_dir, timeout: int):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), str(ROOT / script), str(out_dir)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.multiproc
def test_ep2_with_unequal_shards_runs_equal_microbatch_counts_and_matches_one_process(tmp_path):
    from megatron_dapo.config import load_config
    from megatron_dapo.models.forward import unwrap_model
    from megatron_dapo.models.weights import gather_canonical_state
    from megatron_dapo.parallel import init_parallel
    from megatron_dapo.workers.build import build_actor
    from tests.workers._actor_cases import PAD, VOCAB, overrides, policy_batch

    pgs = init_parallel()
    raw = moe_batch()
    a = build_actor(load_config("configs/tiny_cpu.yaml", overrides(**MOE_OVERRIDES)), pgs, vocab_size=VOCAB, pad_id=PAD)
    init = {name: t.clone() for name, t, _ in gather_canonical_state(unwrap_model(a.policy.chunks[0]), pgs=pgs)}
    torch.save(init, tmp_path / "init.pt")
    ref_lp = a.compute_log_prob(raw["prompt_ids"], raw["prompt_length"], raw["responses"], raw["response_length"])
    ref_m = a.update_policy(policy_batch(a, raw, perturb_old=0.05))
    # A mismatched all-to-all never returns on gloo: the timeout turns the old deadlock into a failure.
    r = _torchrun("tests/workers/_mp_moe.py", 4, tmp_path, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ranks = json.loads((tmp_path / "counts.json").read_text())
    # compute_log_prob, policy_batch's compute_log_prob, the update: planned 3, 2, 2, 4, every rank ran 4
    assert [rk["local"] for rk in ranks] == [[[n]] * 3 for n in (3, 2, 2, 4)]
    assert all(rk["agreed"] == [[4]] * 3 for rk in ranks)
    ep2 = torch.load(tmp_path / "ep2.pt", weights_only=True)
    m = raw["response_mask"]
    # different micro-batch shapes: fp32 round-off only (2.4e-7 seen); a routing or scaling error is O(1)
    torch.testing.assert_close(ep2["log_probs"] * m, ref_lp.log_probs * m, atol=1e-5, rtol=0)
    assert float(ep2["pg_loss"]) == pytest.approx(ref_m["actor/pg_loss"], rel=1e-5, abs=1e-7)
    # the gradient holds Megatron's per-micro-batch aux loss, whose micro-batches differ by design between
    # the runs (8e-6 relative seen); a dropped or doubled micro-batch changes it by far more than 1e-4
    assert float(ep2["grad_norm"]) == pytest.approx(ref_m["actor/grad_norm"], rel=1e-4)
