"""CUDA checks of the actor's packed (thd) sequences (skipped without CUDA; see tests/conftest.py).

With Transformer Engine the actor packs each micro-batch into one row with cu_seqlens
(workers/microbatch.py); the packing itself is tested on CPU (tests/workers/test_microbatch.py),
the attention over it only here: compute_log_prob and one update in thd give the bshd values
(right-padded rows, the same model and weights), fillers included.

Runs in a fresh Python process: CPU tests in the same pytest session may have installed
models.cpu_compat, which replaces torch.cuda entry points process-wide.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                                 reason="thd needs Transformer Engine")]

THD_VS_BSHD = textwrap.dedent("""
    import dataclasses, torch
    from megatron_dapo.config import load_config
    from megatron_dapo.parallel import init_parallel
    from megatron_dapo.workers.build import build_actor
    from megatron_dapo.workers.policy import PolicyModel
    from tests.workers._actor_cases import PAD, VOCAB, overrides, policy_batch, random_batch

    pgs = init_parallel()
    raw = random_batch(seed=5, B=16, P=12, T=40)
    args = (raw["prompt_ids"], raw["prompt_length"], raw["responses"], raw["response_length"])
    m = raw["response_mask"]
    results = {}
    real = PolicyModel._agreed_counts
    PolicyModel._agreed_counts = lambda self, local: [c + 1 for c in real(self, local)]  # one filler each
    for packed in (True, False):
        cfg = load_config("configs/tiny_cpu.yaml", overrides(**{"model.params_dtype": "bf16",
                                                                "actor.ppo_mini_batch_size": 4}))
        a = build_actor(cfg, pgs, vocab_size=VOCAB, pad_id=PAD)
        assert a.policy.packed, "the TE spec must choose thd"
        a.policy.packed = packed
        a.policy.max_tokens = 96
        lp = a.compute_log_prob(*args, with_entropy=True)
        metrics, on_policy = a.update_policy_on_policy(dataclasses.replace(policy_batch(a, raw), old_log_probs=None))
        results[packed] = (lp.log_probs * m, lp.entropy * m, on_policy.log_probs, metrics)
    (lp_t, ent_t, on_t, m_t), (lp_b, ent_b, on_b, m_b) = results[True], results[False]
    # bf16 activations, two attention kernels (thd varlen vs bshd causal): 5e-2 bounds their round-off
    # at these log-prob sizes; a token read at a wrong position or across a sequence boundary is O(1)
    err = float((lp_t - lp_b).abs().max())
    assert err < 5e-2, err
    assert float((ent_t - ent_b).abs().max()) < 5e-2
    assert float((on_t - lp_t).abs().max()) < 5e-2
    assert abs(m_t["actor/pg_loss"] - m_b["actor/pg_loss"]) < 1e-2 and m_t["actor/ppo_kl"] == 0.0
    print("OK thd", err)
""")


def test_thd_packed_log_probs_and_update_equal_bshd_on_cuda():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-c", THD_VS_BSHD], capture_output=True, text=True, timeout=600,
                         cwd=root, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                             filter(None, [root, os.environ.get("PYTHONPATH")]))))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    assert "OK thd" in run.stdout
