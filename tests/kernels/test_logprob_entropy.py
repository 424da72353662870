"""fused_logprob_entropy: the torch and triton paths against the full-logits reference.

Shape legend: hidden [N, H], weight [V, H], labels [N]; logprobs, entropy and their upstream
gradients g_lp, g_ent [N].

Tolerances. fp32: atol 1e-5, rtol 1e-4; the paths differ from the reference only in summation
order (chunks, tiles, the online log-sum-exp). bf16 inputs: the forward keeps the same tight
bound (bf16 x bf16 products are exact in fp32 and every path accumulates in fp32); the gradients
are bf16 tensors, and the triton path rounds dz to bf16 before its two GEMMs (Triton's
interpreter truncates there, compiled Triton rounds to nearest) and accumulates grad_weight in
bf16 once per token chunk, so entries may differ by a few bf16 ulps (2^-8 relative each):
1% normwise, and elementwise rtol 2e-2 with atol 1% of the largest entry (small entries carry
the absolute error of the large ones they are summed with).
"""

import subprocess
import sys

import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_dapo.kernels import fused_logprob_entropy, fused_logprob_entropy_reference

FP32_TOL = dict(atol=1e-5, rtol=1e-4)


def make_inputs(n, h, v, *, dtype=torch.float32, device="cpu", seed=0):
    """Logits with a spread of a few units (like a trained LM head); labels hit both vocab edges."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * (2.0 / h**0.5)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[0] = 0
    labels[-1] = v - 1
    g_lp = torch.randn(n, generator=gen)
    g_ent = torch.randn(n, generator=gen)
    return [x.to(device) for x in (hidden.to(dtype), weight.to(dtype), labels, g_lp, g_ent)]


def run(fn, hidden, weight, labels, g_lp=None, g_ent=None, **kwargs):
    """Forward, then backward of sum(g_lp * logprobs) + sum(g_ent * entropy); returns
    (logprobs, entropy, grad_hidden, grad_weight), gradients None when nothing was backpropagated."""
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    logprobs, entropy = fn(hidden, weight, labels, **kwargs)
    objective = 0.0
    if g_lp is not None:
        objective = objective + (logprobs * g_lp).sum()
    if g_ent is not None:
        objective = objective + (entropy * g_ent).sum()
    if torch.is_tensor(objective):
        objective.backward()
    return (logprobs.detach(), None if entropy is None else entropy.detach(), hidden.grad, weight.grad)


def assert_all_close(got, want, **tol):
    for name, a, b in zip(("logprobs", "entropy", "grad_hidden", "grad_weight"), got, want):
        assert (a is None) == (b is None), name
        if a is not None:
            assert_close(a, b, **tol, msg=lambda m, name=name: f"{name}: {m}")


def assert_bf16_grads_close(got, want):
    for name, a, b in zip(("grad_hidden", "grad_weight"), got[2:], want[2:]):
        assert a.dtype == b.dtype == torch.bfloat16, name
        a, b = a.float(), b.float()
        # observed (triton, interpreter): 0.4% normwise, at most 0.4% of the largest entry
        assert (a - b).norm() <= 1e-2 * b.norm(), name
        atol = 1e-2 * b.abs().max().item()
        assert_close(a, b, atol=atol, rtol=2e-2, msg=lambda m, name=name: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------
# the reference itself, and the gradient formulas the kernels implement
# ---------------------------------------------------------------------------------------------


def test_reference_on_zero_weight_is_uniform_with_closed_form_gradients():
    n, h, v, temp = 4, 8, 10, 0.5
    hidden, _, labels, g_lp, g_ent = make_inputs(n, h, v)
    weight = torch.zeros(v, h)
    lp, ent, grad_h, grad_w = run(fused_logprob_entropy_reference, hidden, weight, labels, g_lp, g_ent,
                                  temperature=temp)
    assert_close(lp, torch.full((n,), -torch.log(torch.tensor(10.0)).item()))
    assert_close(ent, torch.full((n,), torch.log(torch.tensor(10.0)).item()))
    # z = 0 everywhere: p = 1/V and z - Ez = 0, so dz = g_lp ([j == y] - 1/V) and no entropy term
    dz = g_lp[:, None] * (torch.nn.functional.one_hot(labels, v).float() - 1.0 / v)
    assert_close(grad_h, torch.zeros(n, h))  # dz @ weight with weight = 0
    assert_close(grad_w, dz.t() @ hidden / temp)


def test_logit_gradient_formulas_match_autograd():
    # The kernels' dz = g_lp ([j == y] - p) - g_ent p (z - Ez), checked on raw logits.
    gen = torch.Generator().manual_seed(1)
    z = (torch.randn(6, 50, generator=gen) * 3).requires_grad_()
    labels = torch.randint(0, 50, (6,), generator=gen)
    g_lp, g_ent = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    log_p = torch.log_softmax(z, dim=-1)
    p = log_p.exp()
    entropy = -(p * log_p).sum(-1)
    ((log_p.gather(1, labels[:, None]).squeeze(1) * g_lp).sum() + (entropy * g_ent).sum()).backward()
    zd, pd = z.detach(), p.detach()
    ez = (pd * zd).sum(-1, keepdim=True)
    dz = g_lp[:, None] * (torch.nn.functional.one_hot(labels, 50) - pd) - g_ent[:, None] * pd * (zd - ez)
    assert_close(z.grad, dz, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# chunked torch path
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,h,v", [(37, 48, 1003), (1, 16, 17), (64, 33, 256)])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_torch_path_matches_reference_fp32(n, h, v, temperature):
    hidden, weight, labels, g_lp, g_ent = make_inputs(n, h, v, seed=n + v)
    want = run(fused_logprob_entropy_reference, hidden, weight, labels, g_lp, g_ent, temperature=temperature)
    got = run(fused_logprob_entropy, hidden, weight, labels, g_lp, g_ent, temperature=temperature,
              backend="torch", chunk_size=10)
    assert_all_close(got, want, **FP32_TOL)


@pytest.mark.parametrize("chunk_size", [1, 7, 37, 1000])
def test_torch_path_result_does_not_depend_on_chunk_size(chunk_size):
    hidden, weight, labels, g_lp, g_ent = make_inputs(37, 48, 1003)
    whole = run(fused_logprob_entropy, hidden, weight, labels, g_lp, g_ent, backend="torch", chunk_size=37)
    got = run(fused_logprob_entropy, hidden, weight, labels, g_lp, g_ent, backend="torch", chunk_size=chunk_size)
    assert_all_close(got, whole, **FP32_TOL)  # summation order differs with the chunking


def test_torch_path_bf16_forward_is_fp32_exact_and_grads_within_bf16_ulps():
    hidden, weight, labels, g_lp, g_ent = make_inputs(37, 48, 1003, dtype=torch.bfloat16)
    want = run(fused_logprob_entropy_reference, hidden, weight, labels, g_lp, g_ent, temperature=0.7)
    got = run(fused_logprob_entropy, hidden, weight, labels, g_lp, g_ent, temperature=0.7, backend="torch")
    assert_all_close(got[:2], want[:2], **FP32_TOL)
    assert_bf16_grads_close(got, want)


class _LargestOutput(TorchDispatchMode):
    """Records the size in bytes of the largest tensor any torch op produces while active (bytes:
    Triton's interpreter copies kernel arguments back through byte views of their storage)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_tensor_of_full_logits_size_is_ever_allocated(backend, request):
    n, h, v, chunk = 64, 16, 1000, 8  # fp32 bytes: full logits 256000; a chunk 32000; weight 64000
    device = request.getfixturevalue("triton_device") if backend == "triton" else "cpu"
    hidden, weight, labels, g_lp, g_ent = make_inputs(n, h, v, device=device)
    with _LargestOutput() as probe:
        run(fused_logprob_entropy, hidden, weight, labels, g_lp, g_ent, backend=backend, chunk_size=chunk)
    assert probe.largest <= 4 * max(chunk * v, v * h), probe.largest
    with _LargestOutput() as probe:  # the probe does see logits when they exist
        run(fused_logprob_entropy_reference, hidden, weight, labels, g_lp, g_ent)
    assert probe.largest >= 4 * n * v


# ---------------------------------------------------------------------------------------------
# triton kernels (interpreter on CPU, compiled on CUDA)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n,h,v,temperature,chunk_size",
    [
        (37, 48, 1003, 1.0, None),
        (37, 48, 1003, 0.7, 16),  # three backward chunks, the last one partial
        (37, 48, 1003, 1.3, None),
        (5, 16, 130, 1.0, None),  # one partial row block; the last vocab tile holds 2 columns
        (70, 40, 300, 0.9, 32),
    ],
)
def test_triton_matches_reference_fp32(n, h, v, temperature, chunk_size, triton_device):
    hidden, weight, labels, g_lp, g_ent = make_inputs(n, h, v, device=triton_device, seed=n * v)
    want = run(fused_logprob_entropy_reference, hidden, weight, labels, g_lp, g_ent, temperature=temperature)
    got = run(fused_logprob_entropy, hidden, weight, labels, g_lp, g_ent, temperature=temperature,
              backend="triton", chunk_size=chunk_size)
    assert_all_close(got, want, **FP32_TOL)


def test_triton_bf16_forward_is_fp32_exact_and_grads_within_bf16_ulps(triton_device):
    hidden, weight, labels, g_lp, g_ent = make_inputs(37, 48, 1003, dtype=torch.bfloat16, device=triton_device)
    want = run(fused_logprob_entropy_reference, hidden, weight, labels, g_lp, g_ent, temperature=1.3)
    got = run(fused_logprob_entropy, hidden, weight, labels, g_lp, g_ent, temperature=1.3,
              backend="triton", chunk_size=16)
    assert_all_close(got[:2], want[:2], **FP32_TOL)
    assert_bf16_grads_close(got, want)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_logprob_only_and_entropy_only_gradients(backend, request):
    device = request.getfixturevalue("triton_device") if backend == "triton" else "cpu"
    hidden, weight, labels, g_lp, g_ent = make_inputs(37, 48, 1003, device=device)
    for grads in ((g_lp, None), (None, g_ent)):
        want = run(fused_logprob_entropy_reference, hidden, weight, labels, *grads)
        got = run(fused_logprob_entropy, hidden, weight, labels, *grads, backend=backend)
        assert_all_close(got, want, **FP32_TOL)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compute_entropy_false_returns_none_and_same_logprob_grads(backend, request):
    device = request.getfixturevalue("triton_device") if backend == "triton" else "cpu"
    hidden, weight, labels, g_lp, _ = make_inputs(37, 48, 1003, device=device)
    want = run(fused_logprob_entropy_reference, hidden, weight, labels, g_lp, compute_entropy=False)
    got = run(fused_logprob_entropy, hidden, weight, labels, g_lp, compute_entropy=False, backend=backend)
    assert got[1] is None and want[1] is None
    assert_all_close(got, want, **FP32_TOL)


@pytest.mark.parametrize("label", [0, 1002])
def test_every_label_at_a_vocab_edge(label, triton_device):
    hidden, weight, _, g_lp, g_ent = make_inputs(37, 48, 1003, device=triton_device)
    labels = torch.full((37,), label, device=triton_device)
    want = run(fused_logprob_entropy_reference, hidden, weight, labels, g_lp, g_ent)
    for backend in ("torch", "triton"):
        got = run(fused_logprob_entropy, hidden, weight, labels, g_lp, g_ent, backend=backend)
        assert_all_close(got, want, **FP32_TOL)


def test_zero_tokens_give_empty_outputs_and_zero_weight_grad(triton_device):
    hidden, weight, labels, g_lp, g_ent = make_inputs(1, 16, 50, device=triton_device)
    for backend in ("torch", "triton"):
        got = run(fused_logprob_entropy, hidden[:0], weight, labels[:0], g_lp[:0], g_ent[:0], backend=backend)
        assert got[0].shape == got[1].shape == (0,)
        assert got[2].shape == (0, 16)
        assert_close(got[3], torch.zeros_like(weight))


def test_auto_backend_on_cpu_is_the_torch_path():
    hidden, weight, labels, g_lp, g_ent = make_inputs(9, 16, 40)
    auto = run(fused_logprob_entropy, hidden, weight, labels, g_lp, g_ent, chunk_size=4)
    torch_path = run(fused_logprob_entropy, hidden, weight, labels, g_lp, g_ent, backend="torch", chunk_size=4)
    assert_all_close(auto, torch_path, atol=0.0, rtol=0.0)


# ---------------------------------------------------------------------------------------------
# errors and environments
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(weight=torch.zeros(10, 7)), "hidden size mismatch"),
        (dict(labels=torch.tensor([0, 10, 1])), r"labels\[1\] = 10 is outside the vocabulary \[0, 10\)"),
        (dict(labels=torch.tensor([0, -1, 1])), r"labels\[1\] = -1"),
        (dict(labels=torch.zeros(3)), "integer ids"),
        (dict(hidden=torch.zeros(3, 8, dtype=torch.float64)), "same floating dtype"),
        (dict(temperature=0.0), "temperature must be a positive number"),
        (dict(chunk_size=0), "chunk_size must be None or a positive int"),
        (dict(backend="cuda"), "backend must be one of"),
    ],
)
def test_bad_inputs_raise_naming_the_problem(change, match):
    args = dict(hidden=torch.zeros(3, 8), weight=torch.zeros(10, 8), labels=torch.tensor([0, 9, 1]))
    args.update(change)
    kwargs = {k: args.pop(k) for k in ("temperature", "chunk_size", "backend") if k in args}
    for fn in (fused_logprob_entropy, fused_logprob_entropy_reference):
        with pytest.raises(ValueError, match=match):
            fn(args["hidden"], args["weight"], args["labels"], **kwargs)


_SCRIPT = """
import sys, torch
{prelude}
from megatron_dapo.kernels import fused_logprob_entropy, fused_clipped_token_loss
h, w, y = torch.randn(4, 16), torch.randn(20, 16), torch.tensor([0, 3, 19, 7])
lp, ent = fused_logprob_entropy(h, w, y)  # auto on CPU: the torch path
assert lp.shape == (4,) and torch.isfinite(ent).all()
for fn, args in ((fused_logprob_entropy, (h, w, y)),
                 (fused_clipped_token_loss, (torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, 3)))):
    try:
        fn(*args, backend="triton")
    except RuntimeError as err:
        print("RuntimeError:", err)
    else:
        sys.exit("backend='triton' should have raised")
"""


@pytest.mark.parametrize(
    "prelude,message",
    [
        ("sys.modules['triton'] = None  # import triton now raises ImportError", "needs triton, which failed to import"),
        ("import os; os.environ.pop('TRITON_INTERPRET', None)", "needs Triton's interpreter"),
    ],
)
def test_without_usable_triton_the_torch_paths_work_and_triton_backend_explains(prelude, message):
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT.format(prelude=prelude)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(message) == 2, proc.stdout
