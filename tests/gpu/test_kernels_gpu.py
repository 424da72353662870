"""The compiled Triton kernels on CUDA against their references (tests/conftest.py adds the gpu
marker and skips these without CUDA).

Shape legend: hidden [N, H], weight [V, H], labels [N]; log_prob, old_log_prob, advantages,
response_mask [B, T]. Tolerances and their reasons are those of tests/kernels (same helpers).

Nothing here imports megatron_dapo.kernels or triton at module level: collecting this file
happens before tests/kernels/conftest.py, which on a CPU-only machine must set TRITON_INTERPRET=1
before triton is first imported. Run with `pytest -m gpu tests/gpu`, without TRITON_INTERPRET.
"""

from types import SimpleNamespace

import pytest
import torch


@pytest.fixture(scope="module")
def lib():
    from megatron_dapo.algos import policy_loss
    from megatron_dapo.kernels import clipped_loss, logprob_entropy
    from tests.kernels import test_clipped_loss, test_logprob_entropy

    if logprob_entropy.triton is None:
        pytest.fail(f"triton failed to import: {logprob_entropy.TRITON_IMPORT_ERROR!r}")
    kernels = (logprob_entropy._lse_entropy_fwd_kernel, clipped_loss._clipped_loss_fwd_kernel,
               logprob_entropy.tl.sum)
    if any(isinstance(k, logprob_entropy.InterpretedFunction) for k in kernels):
        pytest.fail("TRITON_INTERPRET=1 was set when triton was imported: these tests check compiled kernels")
    return SimpleNamespace(le=logprob_entropy, cl=clipped_loss, pl=policy_loss,
                           le_tests=test_logprob_entropy, cl_tests=test_clipped_loss)


@pytest.mark.parametrize(
    "n,h,v,dtype,temperature,chunk_size",
    [
        (37, 48, 1003, torch.float32, 0.7, 16),
        (37, 48, 1003, torch.bfloat16, 1.3, None),
        (1000, 512, 50257, torch.float32, 0.9, 256),  # several backward chunks, ragged tiles
        (2048, 1024, 32000, torch.bfloat16, 1.0, None),
    ],
)
def test_compiled_logprob_entropy_matches_reference(n, h, v, dtype, temperature, chunk_size, lib):
    t = lib.le_tests
    hidden, weight, labels, g_lp, g_ent = t.make_inputs(n, h, v, dtype=dtype, device="cuda", seed=n)
    want = t.run(lib.le.fused_logprob_entropy_reference, hidden, weight, labels, g_lp, g_ent,
                 temperature=temperature)
    got = t.run(lib.le.fused_logprob_entropy, hidden, weight, labels, g_lp, g_ent, temperature=temperature,
                chunk_size=chunk_size, backend="triton")
    if dtype == torch.float32:
        t.assert_all_close(got, want, **t.FP32_TOL)
    else:
        t.assert_all_close(got[:2], want[:2], **t.FP32_TOL)
        t.assert_bf16_grads_close(got, want)


def test_compiled_logprob_only_gradient_and_auto_backend(lib):
    t = lib.le_tests
    hidden, weight, labels, g_lp, _ = t.make_inputs(300, 128, 5000, device="cuda")
    want = t.run(lib.le.fused_logprob_entropy_reference, hidden, weight, labels, g_lp, compute_entropy=False)
    got = t.run(lib.le.fused_logprob_entropy, hidden, weight, labels, g_lp, compute_entropy=False)  # auto
    t.assert_all_close(got, want, **t.FP32_TOL)


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("dp_size,batch_num_tokens,global_batch_size",
                         [(1, None, None), (2, torch.tensor(2700.0), 9)])
def test_compiled_clipped_loss_equals_compute_policy_loss_vanilla(mode, dp_size, batch_num_tokens,
                                                                  global_batch_size, lib):
    t = lib.cl_tests
    batch = t.make_batch(6, 1500, device="cuda")
    kwargs = dict(loss_agg_mode=mode, dp_size=dp_size, global_batch_size=global_batch_size,
                  batch_num_tokens=None if batch_num_tokens is None else batch_num_tokens.cuda())
    want = t.loss_and_grad(lib.pl.compute_policy_loss_vanilla, *batch, **kwargs)
    got = t.loss_and_grad(lib.cl.fused_clipped_token_loss, *batch, **kwargs, backend="triton")
    t.assert_same(got, want)


def test_compiled_clipped_loss_large_batch_and_hand_computed_tokens(lib):
    t = lib.cl_tests
    batch = t.make_batch(64, 8192, device="cuda", seed=1)
    want = t.loss_and_grad(lib.pl.compute_policy_loss_vanilla, *batch)
    got = t.loss_and_grad(lib.cl.fused_clipped_token_loss, *batch)  # auto: triton on CUDA
    t.assert_same(got, want)
    t.test_hand_computed_tokens(("triton", torch.device("cuda")))
    t.test_bf16_inputs_give_the_fp32_spec_rounded_to_bf16(("triton", torch.device("cuda")))
    t.test_exact_ties_at_the_clip_bounds_follow_torch(("triton", torch.device("cuda")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_logprob_stats_sum_sq_and_no_grad_equal_grad(dtype):
    from megatron_dapo.kernels import fused_logprob_stats, fused_logprob_stats_reference
    from tests.kernels import test_logprob_entropy as t
    from tests.kernels.test_logprob_stats import test_no_grad_and_grad_logprobs_are_bitwise_equal

    hidden, weight, labels, _, _ = t.make_inputs(1000, 512, 50257, dtype=dtype, device="cuda", seed=2)
    want = fused_logprob_stats_reference(hidden, weight, labels, temperature=0.9, compute_sum_sq=True)
    with torch.no_grad():
        got = fused_logprob_stats(hidden, weight, labels, temperature=0.9, compute_sum_sq=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **t.FP32_TOL)  # forward: fp32 accumulation whatever the dtype

    class _Request:  # the CPU test's fixture lookup, answered with the GPU
        @staticmethod
        def getfixturevalue(name):
            return torch.device("cuda")

    test_no_grad_and_grad_logprobs_are_bitwise_equal("triton", dtype, _Request())
