"""CUDA checks of megatron_dapo.models (skipped without CUDA; see tests/conftest.py).

Each check runs in a fresh Python process: CPU tests in the same pytest session may have
installed models.cpu_compat, which replaces torch.cuda entry points process-wide.

- tiny and tiny_moe build with the Transformer-Engine spec when transformer_engine imports
  (else the local spec), in bf16 on cuda:0, and run forward + backward through token_logprobs.
- a tiny HF Qwen2 and Qwen3-MoE load onto the GPU model (TE parameter names included) with
  transformers' logits (fp32, tolerance for TE's kernels).
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TINY_FWD_BWD = textwrap.dedent("""
    import torch
    from megatron_dapo.models.arch import get_arch
    from megatron_dapo.models.builder import build_gpt_model, default_backend
    from megatron_dapo.models.forward import token_logprobs
    from megatron_dapo.parallel import init_parallel

    pgs = init_parallel()
    assert pgs.backend == "nccl" and pgs.device.type == "cuda"
    print("backend", default_backend("cuda"))
    for name in ("tiny", "tiny_moe"):
        arch = get_arch(name)
        model = build_gpt_model(arch, pgs=pgs, params_dtype=torch.bfloat16, seed=3)
        ids = torch.randint(0, arch.vocab_size, (2, 64), device="cuda")
        pos = torch.arange(64, device="cuda").expand(2, 64)
        lp = token_logprobs(model, ids, pos, ids.roll(-1, 1), pgs=pgs)
        assert lp.shape == (2, 64) and lp.dtype == torch.float32 and bool((lp <= 0).all())
        lp.mean().backward()
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads), name
        print("OK", name, float(lp.mean()))
""")

HF_ON_GPU = textwrap.dedent("""
    import sys, torch, transformers
    from megatron_dapo.models.hf import load_hf_as_mcore

    configs = {
        "qwen2": transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, tie_word_embeddings=False),
        "qwen3_moe": transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
            moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
            max_position_embeddings=64, tie_word_embeddings=False),
    }
    for name, cfg in configs.items():
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        with torch.no_grad():
            for p in hf.parameters():
                p.normal_(0, 0.08)
        path = f"{sys.argv[1]}/{name}"
        hf.save_pretrained(path)
        model = load_hf_as_mcore(path)
        ids = torch.randint(0, 128, (2, 16))
        with torch.no_grad():
            ref = hf(ids).logits
            out = model(ids.cuda(), torch.arange(16, device="cuda").expand(2, 16)).float().cpu()
        err = (out - ref).abs().max().item()
        assert err < 2e-3, (name, err)
        print("OK", name, err)
""")


def _run(script: str, *args: str) -> str:
    run = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                         timeout=600, env=dict(os.environ))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return run.stdout


def test_tiny_and_tiny_moe_forward_backward_on_cuda():
    out = _run(TINY_FWD_BWD)
    assert "OK tiny " in out and "OK tiny_moe " in out


def test_hf_checkpoints_load_on_cuda_with_transformers_logits(tmp_path):
    out = _run(HF_ON_GPU, str(tmp_path))
    assert "OK qwen2" in out and "OK qwen3_moe" in out
