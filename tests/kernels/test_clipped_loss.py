"""fused_clipped_token_loss against algos.policy_loss.compute_policy_loss_vanilla (the spec).

Shape legend: log_prob, old_log_prob, advantages, response_mask, rollout_is_weights [B, T];
loss and metrics [].

Both fused paths run every numerical test: "triton" (the kernels; Triton's interpreter on CPU)
and "torch" (the chunked closed form, CPU).

Tolerances (fp32): the kernel sums per response, then over responses; agg_loss sums all tokens at
once. Only that order differs, so the loss gets rtol 1e-5 (atol 1e-6 for losses near 0) and the
gradient, a per-token product of the same factors in another order, rtol 1e-5 / atol 1e-9.
"""

import pytest
import torch
from torch.testing import assert_close

from megatron_dapo.algos.policy_loss import AGG_MODES, compute_policy_loss_vanilla
from megatron_dapo.kernels import (
    METRIC_NAMES,
    clipped_loss,
    fused_clipped_token_loss,
    fused_clipped_token_loss_reference,
)

LOSS_TOL = dict(atol=1e-6, rtol=1e-5)
GRAD_TOL = dict(atol=1e-9, rtol=1e-5)


def make_batch(b, t, *, device="cpu", seed=0):
    """Every branch appears: ratios inside and outside [0.8, 1.28], A of both signs and A = 0,
    ratio exactly 1 (a max tie), huge ratios with A < 0 (dual clip), |log ratio| > 20 (the clamp),
    an empty response, and a ragged mask."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=gen) * 3
    log_prob = old + torch.randn(b, t, generator=gen) * 0.4
    advantages = torch.randn(b, 1, generator=gen).expand(b, t) + 0.3 * torch.randn(b, t, generator=gen)
    advantages = advantages.contiguous()
    flat_lp, flat_adv, flat_old = log_prob.view(-1), advantages.view(-1), old.view(-1)
    flat_lp[::7] = flat_old[::7]  # ratio == 1: l1 == l2
    flat_adv[3::11] = 0.0
    flat_lp[5::13] = flat_old[5::13] + 2.5  # ratio ~12 > c = 3
    flat_adv[5::13] = -1.0
    flat_lp[-1] = flat_old[-1] + 25.0  # clamped: zero gradient
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    if b > 1:
        mask[1] = False  # a response with no valid token
    return [x.to(device) for x in (log_prob, old, advantages, mask)]


def loss_and_grad(fn, log_prob, old, advantages, mask, **kwargs):
    log_prob = log_prob.detach().clone().requires_grad_()
    loss, metrics = fn(log_prob, old, advantages, mask, **kwargs) if fn is not compute_policy_loss_vanilla \
        else fn(old, log_prob, advantages, mask, **kwargs)
    loss.backward()
    return loss.detach(), {k: v.detach() for k, v in metrics.items()}, log_prob.grad


def assert_same(got, want, *, loss_tol=LOSS_TOL, grad_tol=GRAD_TOL):
    assert_close(got[0], want[0], **loss_tol)
    assert set(got[1]) == set(want[1]) == set(METRIC_NAMES)
    for name in METRIC_NAMES:
        assert_close(got[1][name], want[1][name], **loss_tol, msg=lambda m, name=name: f"{name}: {m}")
    assert_close(got[2], want[2], **grad_tol)


@pytest.fixture(params=["torch", "triton"])
def path(request):
    """(backend, device) of one fused path: the chunked torch path on CPU, or the triton kernels."""
    if request.param == "triton":
        return "triton", request.getfixturevalue("triton_device")
    return "torch", torch.device("cpu")


# (dp_size, batch_num_tokens, global_batch_size): local counts, and two ranks with global counts
DP_CASES = [(1, None, None), (2, torch.tensor(2700.0), 9), (2, 2700, torch.tensor(9))]


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("dp_size,batch_num_tokens,global_batch_size", DP_CASES)
def test_value_metrics_and_grad_equal_compute_policy_loss_vanilla(
    mode, dp_size, batch_num_tokens, global_batch_size, path
):
    backend, device = path
    batch = make_batch(6, 1500, device=device)  # T > BLOCK_T: two tiles per response
    kwargs = dict(loss_agg_mode=mode, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
                  global_batch_size=global_batch_size)
    want = loss_and_grad(compute_policy_loss_vanilla, *batch, **kwargs)
    got = loss_and_grad(fused_clipped_token_loss, *batch, **kwargs, backend=backend)
    assert_same(got, want)


@pytest.mark.parametrize("clip", [dict(clip_ratio_low=0.1, clip_ratio_high=0.1, clip_ratio_c=1.5),
                                  dict(clip_ratio_low=0.0, clip_ratio_high=0.0, clip_ratio_c=10.0)])
@pytest.mark.parametrize("b,t", [(1, 1), (3, 17), (4, 1024)])
def test_clip_settings_and_odd_shapes_equal_the_spec(clip, b, t, path):
    backend, device = path
    batch = make_batch(b, t, device=device, seed=b * t)
    weights = torch.rand(b, t, generator=torch.Generator().manual_seed(7)).to(device) * 2
    for extra in ({}, dict(rollout_is_weights=weights)):
        want = loss_and_grad(compute_policy_loss_vanilla, *batch, **clip, **extra)
        got = loss_and_grad(fused_clipped_token_loss, *batch, **clip, **extra, backend=backend)
        assert_same(got, want)


def test_hand_computed_tokens(path):
    # One response, five tokens, clip 0.2 / 0.28 / c = 3, token-sum (no normalisation).
    #  A = +1, r = 1.5: l1 = -1.5, l2 = -1.28 -> loss -1.28 (clipped above), gradient 0
    #  A = -1, r = 5.0: l1 = 5, l2 = 1.28, max 5 -> dual clip min(5, 3) = 3, gradient 0
    #  A = -1, r = 2.0: l1 = 2 -> max 2 < 3 -> loss 2, d/d lp (-A r) = r = 2
    #  A = +2, r = 1.0: inside the band -> loss -2, gradient -A r = -2
    #  A = +1, log r = -25: clamped to -20, l1 = -exp(-20) > l2 = -0.8 -> gradient exactly 0
    backend, device = path
    log_prob = torch.log(torch.tensor([[1.5, 5.0, 2.0, 1.0, 1.0]]))
    log_prob[0, 4] = -25.0
    adv = torch.tensor([[1.0, -1.0, -1.0, 2.0, 1.0]])
    old = torch.zeros(1, 5)
    mask = torch.ones(1, 5, dtype=torch.bool)
    args = [x.to(device) for x in (log_prob, old, adv, mask)]
    loss, metrics, grad = loss_and_grad(fused_clipped_token_loss, *args, loss_agg_mode="token-sum", backend=backend)
    assert_close(loss.cpu(), torch.tensor(-1.28 + 3.0 + 2.0 - 2.0 - torch.exp(torch.tensor(-20.0)).item()), **LOSS_TOL)
    assert_close(grad.cpu(), torch.tensor([[0.0, 0.0, 2.0, -2.0, 0.0]]), **LOSS_TOL)
    assert grad[0, 4].item() == 0.0  # torch.clamp's gradient, not -A exp(-20)
    assert_close(metrics["actor/pg_clipfrac"].cpu(), torch.tensor(1 / 5))  # only the first token
    assert_close(metrics["actor/pg_clipfrac_lower"].cpu(), torch.tensor(1 / 5))  # only the second
    assert_close(metrics["actor/ppo_kl"].cpu(), -log_prob.clamp(min=-20).mean(), **LOSS_TOL)


def test_token_mean_with_global_count_is_invariant_to_the_micro_batch_split(path):
    backend, device = path
    log_prob, old, adv, mask = make_batch(6, 300, device=device)
    count = mask.sum()
    full = loss_and_grad(fused_clipped_token_loss, log_prob, old, adv, mask, batch_num_tokens=count,
                         backend=backend)
    parts = [loss_and_grad(fused_clipped_token_loss, log_prob[s], old[s], adv[s], mask[s],
                           batch_num_tokens=count, backend=backend) for s in (slice(0, 2), slice(2, 6))]
    assert_close(parts[0][0] + parts[1][0], full[0], **LOSS_TOL)
    assert_close(torch.cat([parts[0][2], parts[1][2]]), full[2], **GRAD_TOL)


def test_all_masked_batch_gives_zero_loss_metrics_and_grad(path):
    backend, device = path
    log_prob, old, adv, mask = make_batch(3, 40, device=device)
    for mode in AGG_MODES:
        got = loss_and_grad(fused_clipped_token_loss, log_prob, old, adv, torch.zeros_like(mask),
                            loss_agg_mode=mode, backend=backend)
        assert got[0].item() == 0.0 and all(v.item() == 0.0 for v in got[1].values())
        assert torch.count_nonzero(got[2]) == 0


def test_float_mask_equals_bool_mask_and_padding_garbage_is_ignored(path):
    backend, device = path
    log_prob, old, adv, mask = make_batch(4, 50, device=device)
    want = loss_and_grad(fused_clipped_token_loss, log_prob, old, adv, mask, backend=backend)
    dirty = log_prob.masked_fill(~mask, float("inf"))  # the reference would give nan here
    got = loss_and_grad(fused_clipped_token_loss, dirty, old, adv, mask.float(), backend=backend)
    assert_same(got, want)


def test_bf16_inputs_give_the_fp32_spec_rounded_to_bf16(path):
    # The kernel reads bf16 and computes in fp32; the spec run in bf16 would round every
    # intermediate (ratio, l1, l2) to bf16 and so flip the clip branch of tokens near 1 +- eps.
    # The right comparison is the spec in fp32 on the same bf16 values: then only the final
    # rounding of the loss and of each gradient entry to bf16 differs: 2^-8 relative when
    # compiled (round to nearest even), 2^-7 in Triton's interpreter (it truncates fp32 -> bf16).
    backend, device = path
    batch = make_batch(4, 300, device=device)
    batch = [x.to(torch.bfloat16) if x.is_floating_point() else x for x in batch]
    want = loss_and_grad(compute_policy_loss_vanilla, *[x.float() if x.is_floating_point() else x for x in batch])
    got = loss_and_grad(fused_clipped_token_loss, *batch, backend=backend)
    assert got[0].dtype == got[2].dtype == torch.bfloat16
    bf16_rounding = dict(atol=1e-9, rtol=2**-7)
    assert_close(got[0].float(), want[0], **bf16_rounding)
    assert_close(got[2].float(), want[2], **bf16_rounding)


EXACT = dict(atol=0.0, rtol=0.0)


def test_reference_is_the_spec_and_auto_on_cpu_is_the_torch_path():
    batch = make_batch(3, 20)
    want = loss_and_grad(compute_policy_loss_vanilla, *batch, loss_agg_mode="seq-mean-token-mean")
    got = loss_and_grad(fused_clipped_token_loss_reference, *batch, loss_agg_mode="seq-mean-token-mean")
    assert_same(got, want, loss_tol=EXACT, grad_tol=EXACT)
    auto = loss_and_grad(fused_clipped_token_loss, *batch, loss_agg_mode="seq-mean-token-mean")
    torch_path = loss_and_grad(fused_clipped_token_loss, *batch, loss_agg_mode="seq-mean-token-mean",
                               backend="torch")
    assert_same(auto, torch_path, loss_tol=EXACT, grad_tol=EXACT)


@pytest.mark.parametrize("chunk_elems,b,t", [(64, 9, 20), (100, 7, 33), (1, 5, 3), (4096, 40, 97)])
def test_torch_path_chunking_changes_nothing_but_summation_order(chunk_elems, b, t, monkeypatch):
    # chunks of 3, 3, 1 rows / one row per chunk / rows ragged against the chunk: the per-row
    # statistics and every gradient row must not depend on which chunk a row fell into
    monkeypatch.setattr(clipped_loss, "_TORCH_CHUNK_ELEMS", chunk_elems)
    batch = make_batch(b, t, seed=b + t)
    weights = torch.rand(b, t, generator=torch.Generator().manual_seed(3)) * 2
    for mode in AGG_MODES:
        want = loss_and_grad(compute_policy_loss_vanilla, *batch, loss_agg_mode=mode, rollout_is_weights=weights)
        got = loss_and_grad(fused_clipped_token_loss, *batch, loss_agg_mode=mode, rollout_is_weights=weights,
                            backend="torch")
        assert_same(got, want)


def test_exact_ties_at_the_clip_bounds_follow_torch(path):
    # r exactly 1 - low, 1, 1 + high for A of both signs (clamp passes the gradient on its closed
    # interval; the max of two equal terms splits it into two equal halves), and r exactly 1 + high
    # for A < 0 (inside the dual-clip band). The values are powers of two so that r = exp(log r)
    # is exact in fp32: low = 0.25, high = 0.25, c = 2.
    backend, device = path
    ratios = torch.tensor([0.75, 1.0, 1.25, 0.5, 2.0, 4.0])
    log_prob = torch.log(ratios).repeat(2)[None, :]
    adv = torch.tensor([1.0] * 6 + [-1.0] * 6)[None, :]
    assert torch.equal(torch.exp(log_prob), ratios.repeat(2)[None, :])
    old, mask = torch.zeros_like(log_prob), torch.ones_like(log_prob, dtype=torch.bool)
    clip = dict(clip_ratio_low=0.25, clip_ratio_high=0.25, clip_ratio_c=2.5, loss_agg_mode="token-sum")
    args = [x.to(device) for x in (log_prob, old, adv, mask)]
    want = loss_and_grad(compute_policy_loss_vanilla, *args, **clip)
    got = loss_and_grad(fused_clipped_token_loss, *args, **clip, backend=backend)
    assert_same(got, want)
    # A = +1: -r below 1 + high, 0 above it; A = -1: 0 below 1 - low, r up to c, 0 above c
    assert_close(got[2].cpu(), torch.tensor([[-0.75, -1.0, -1.25, -0.5, 0.0, 0.0,
                                              0.0 + 0.75, 1.0, 1.25, 0.0, 2.0, 0.0]]))


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(clip_ratio_c=1.0), "clip_ratio_c must be > 1"),
        (dict(clip_ratio_low=1.0), "clip_ratio_low must be in"),
        (dict(loss_agg_mode="seq-mean"), "loss_agg_mode must be one of"),
        (dict(dp_size=2), "batch_num_tokens is required when dp_size > 1"),
        (dict(loss_agg_mode="seq-mean-token-sum", dp_size=2), "global_batch_size is required"),
        (dict(batch_num_tokens=0), "batch_num_tokens must be a positive number"),
        (dict(backend="cuda"), "backend must be one of"),
        (dict(advantages=torch.zeros(2, 4)), r"advantages has shape \(2, 4\), expected \(2, 3\)"),
        (dict(old_log_prob=torch.zeros(2, 3, requires_grad=True)), "old_log_prob requires grad"),
    ],
)
def test_bad_arguments_raise_naming_the_problem(change, match, path):
    backend, device = path
    args = dict(log_prob=torch.zeros(2, 3), old_log_prob=torch.zeros(2, 3), advantages=torch.ones(2, 3),
                response_mask=torch.ones(2, 3))
    args.update(change)
    args = {k: v.to(device) if torch.is_tensor(v) else v for k, v in args.items()}
    with pytest.raises(ValueError, match=match):
        fused_clipped_token_loss(args.pop("log_prob"), args.pop("old_log_prob"), args.pop("advantages"),
                                 args.pop("response_mask"), backend=args.pop("backend", backend), **args)
