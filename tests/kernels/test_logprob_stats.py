"""fused_logprob_stats: log-probs, entropy and sum_v p_v^2 against the full-logits reference, the
no-grad path (bitwise equal to the differentiable one, nothing saved, one chunk live at a time).

Shape legend: hidden [N, H], weight [V, H], labels [N]; logprobs, entropy, sum_sq [N].
Tolerances: FP32_TOL as in test_logprob_entropy.py (only the summation order differs); sum_sq is
at most 1 and sums V terms of the same sign, so the same atol/rtol hold for it. The bitwise
checks compare two calls in one process on one machine with the same chunking (allowed: the
same floating-point operations run in the same order).
"""

import pytest
import torch
from torch.testing import assert_close

from megatron_dapo.kernels import fused_logprob_stats, fused_logprob_stats_reference
from megatron_dapo.kernels.logprob_entropy import torch_chunk_tokens
from tests.kernels.test_logprob_entropy import FP32_TOL, make_inputs, run


def stats_with_grads(fn, hidden, weight, labels, g_lp, g_ent, **kwargs):
    """(logprobs, entropy, sum_sq, grad_hidden, grad_weight) of sum(g_lp lp) + sum(g_ent ent)."""
    def two_outputs(h, w, y, **kw):
        out = fn(h, w, y, compute_sum_sq=True, **kw)
        two_outputs.sum_sq = out[2]
        return out[:2]

    lp, ent, grad_h, grad_w = run(two_outputs, hidden, weight, labels, g_lp, g_ent, **kwargs)
    return lp, ent, two_outputs.sum_sq, grad_h, grad_w


def assert_stats_close(got, want, **tol):
    for name, a, b in zip(("logprobs", "entropy", "sum_sq", "grad_hidden", "grad_weight"), got, want):
        assert (a is None) == (b is None), name
        if a is not None:
            assert_close(a.detach(), b.detach(), **tol, msg=lambda m, name=name: f"{name}: {m}")


def test_reference_sum_sq_closed_forms():
    # zero weight: uniform p = 1/V, so sum p^2 = 1/V; two logits (0, log 3): p = (1/4, 3/4), 10/16
    hidden, _, labels, _, _ = make_inputs(3, 8, 10)
    _, _, sq = fused_logprob_stats_reference(hidden, torch.zeros(10, 8), labels, compute_sum_sq=True)
    assert_close(sq, torch.full((3,), 0.1))
    hidden = torch.tensor([[1.0]])
    weight = torch.tensor([[0.0], [torch.log(torch.tensor(3.0)).item()]])
    lp, ent, sq = fused_logprob_stats_reference(hidden, weight, torch.tensor([1]), compute_sum_sq=True)
    assert_close(sq, torch.tensor([10 / 16]))
    assert_close(lp, torch.log(torch.tensor([0.75])))
    assert_close(ent, torch.tensor([-(0.25 * torch.log(torch.tensor(0.25)) + 0.75 * torch.log(torch.tensor(0.75)))]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("n,h,v,temperature,chunk_size", [(37, 48, 1003, 1.0, 10), (5, 16, 130, 0.7, None),
                                                           (70, 33, 300, 1.3, 32), (1, 16, 17, 1.0, None)])
def test_stats_and_grads_match_reference(backend, n, h, v, temperature, chunk_size, request):
    device = request.getfixturevalue("triton_device") if backend == "triton" else "cpu"
    hidden, weight, labels, g_lp, g_ent = make_inputs(n, h, v, device=device, seed=n + v)
    want = stats_with_grads(fused_logprob_stats_reference, hidden, weight, labels, g_lp, g_ent,
                            temperature=temperature)
    got = stats_with_grads(fused_logprob_stats, hidden, weight, labels, g_lp, g_ent, temperature=temperature,
                           chunk_size=chunk_size, backend=backend)
    assert got[2].dtype == torch.float32 and not got[2].requires_grad  # sum_sq is a metric
    assert_stats_close(got, want, **FP32_TOL)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_grad_stats_match_reference_and_flags_drop_outputs(backend, request):
    device = request.getfixturevalue("triton_device") if backend == "triton" else "cpu"
    hidden, weight, labels, _, _ = make_inputs(37, 48, 1003, device=device)
    want = fused_logprob_stats_reference(hidden, weight, labels, compute_sum_sq=True, temperature=0.9)
    with torch.no_grad():
        got = fused_logprob_stats(hidden, weight, labels, compute_sum_sq=True, temperature=0.9, backend=backend)
        lp_only = fused_logprob_stats(hidden, weight, labels, compute_entropy=False, temperature=0.9,
                                      backend=backend)
    assert_stats_close(got, want, **FP32_TOL)
    assert lp_only[1] is None and lp_only[2] is None
    assert torch.equal(lp_only[0], got[0])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_grad_and_grad_logprobs_are_bitwise_equal(backend, dtype, request):
    device = request.getfixturevalue("triton_device") if backend == "triton" else "cpu"
    hidden, weight, labels, _, _ = make_inputs(45, 40, 777, dtype=dtype, device=device, seed=5)
    kwargs = dict(temperature=0.8, compute_sum_sq=True, backend=backend)
    with torch.no_grad():
        old = fused_logprob_stats(hidden, weight, labels, **kwargs)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    new = fused_logprob_stats(h, w, labels, **kwargs)
    assert new[0].requires_grad and new[1].requires_grad and old[0].grad_fn is None
    for name, a, b in zip(("logprobs", "entropy", "sum_sq"), old, new):
        assert torch.equal(a, b.detach()), name
    # grad mode on but no input requiring grad: the no-grad path as well
    assert torch.equal(fused_logprob_stats(hidden, weight, labels, **kwargs)[0], old[0])
    # the reference pass (log-probs only) and a training pass without entropy: the same log-probs
    with torch.no_grad():
        ref = fused_logprob_stats(hidden, weight, labels, temperature=0.8, compute_entropy=False, backend=backend)
    train = fused_logprob_stats(h, w, labels, temperature=0.8, compute_entropy=False, backend=backend)
    assert torch.equal(ref[0], old[0]) and torch.equal(train[0].detach(), old[0])


def test_no_grad_path_saves_nothing_for_backward():
    hidden, weight, labels, _, _ = make_inputs(20, 16, 300)
    hidden.requires_grad_()
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        with torch.no_grad():
            out = fused_logprob_stats(hidden, weight, labels, compute_sum_sq=True)
        assert packed == [] and all(not t.requires_grad for t in out)
        fused_logprob_stats(hidden, weight, labels)  # the differentiable call does save (the probe works)
    assert len(packed) > 0


class _PeakLiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Peak bytes of the storages that tensors created while active hold at once (freed tensors
    leave the count through weak references; views count their storage once, and views of the
    `inputs` count nothing)."""

    def __init__(self, *inputs):
        super().__init__()
        self.live, self.peak = {}, 0
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage().data_ptr()
                if key in self.inputs:
                    continue
                refs, nbytes = self.live.get(key, ([], t.untyped_storage().nbytes()))
                refs.append(weakref.ref(t))
                self.live[key] = (refs, nbytes)
        for key in list(self.live):
            refs, _ = self.live[key]
            refs[:] = [r for r in refs if r() is not None]
            if not refs:
                del self.live[key]
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self.live.values()))
        return out


def test_no_grad_memory_is_one_chunk_within_the_scratch_budget():
    n, h, v = 64, 16, 1000
    budget = 2 * 4 * 8 * v  # two fp32 [8, V] buffers: 8 tokens per chunk
    assert torch_chunk_tokens(v, None, budget) == 8
    hidden, weight, labels, _, _ = make_inputs(n, h, v)
    with torch.no_grad(), _PeakLiveBytes(hidden, weight, labels) as probe:
        fused_logprob_stats(hidden, weight, labels, compute_sum_sq=True, scratch_bytes=budget, backend="torch")
    # the budget plus [N]-sized outputs and statistics (a few floats per token); full logits: 256000
    assert probe.peak <= budget + 64 * n, probe.peak
    with torch.no_grad(), _PeakLiveBytes(hidden, weight, labels) as probe:
        fused_logprob_stats_reference(hidden, weight, labels)
    assert probe.peak >= 4 * n * v  # the probe sees full logits when they exist


def test_scratch_bytes_changes_only_the_chunking():
    hidden, weight, labels, g_lp, g_ent = make_inputs(37, 48, 1003)
    small = stats_with_grads(fused_logprob_stats, hidden, weight, labels, g_lp, g_ent, backend="torch",
                             scratch_bytes=2 * 4 * 5 * 1003)
    default = stats_with_grads(fused_logprob_stats, hidden, weight, labels, g_lp, g_ent, backend="torch")
    assert_stats_close(small, default, **FP32_TOL)
    with pytest.raises(ValueError, match="scratch_bytes must be None or a positive int"):
        fused_logprob_stats(hidden, weight, labels, scratch_bytes=0)


@pytest.mark.parametrize("tile", [64, 100, 1003])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_vocabulary_tiles_give_the_reference_stats_and_grads(tile, temperature, monkeypatch):
    """The torch path's online log-sum-exp over vocabulary tiles (a running max that rescales s, t and q
    from tile to tile), with labels in every tile and a last tile narrower than the others."""
    from megatron_dapo.kernels import logprob_entropy

    monkeypatch.setattr(logprob_entropy, "_TORCH_VOCAB_TILE", tile)
    hidden, weight, labels, g_lp, g_ent = make_inputs(37, 48, 1003, seed=11)
    weight[::97] *= 2.0  # larger logits in some tiles only: the running max moves across tiles
    labels[:16] = torch.arange(0, 1003, 63)[:16]
    want = stats_with_grads(fused_logprob_stats_reference, hidden, weight, labels, g_lp, g_ent,
                            temperature=temperature)
    got = stats_with_grads(fused_logprob_stats, hidden, weight, labels, g_lp, g_ent, temperature=temperature,
                           chunk_size=10, backend="torch")
    assert_stats_close(got, want, **FP32_TOL)
    with torch.no_grad():  # log-probs alone: bit for bit those of the pass with entropy and sum p^2
        lp_only = fused_logprob_stats(hidden, weight, labels, compute_entropy=False, temperature=temperature,
                                      chunk_size=10, backend="torch")[0]
        full = fused_logprob_stats(hidden, weight, labels, compute_sum_sq=True, temperature=temperature,
                                   chunk_size=10, backend="torch")[0]
    assert torch.equal(lp_only, full)
