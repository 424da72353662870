"""DAPO's token-level clipped policy loss in one forward and one backward kernel.

Shape legend:
    B  responses       T  padded response length
    log_prob, old_log_prob, advantages, response_mask, rollout_is_weights, grad: [B, T]
    row_stats [B, 5] fp32 (per response: loss sum, valid tokens, clipped, kl sum, dual-clipped)
    row_scale [B] fp32 (d loss / d masked per-token loss of each response)
    loss and every metric: [] (0-dim)

Per token (the same math as `algos.policy_loss.compute_policy_loss_vanilla`, which is the spec):
    d = log_prob - old_log_prob,  r = exp(clamp(d, -20, 20))
    l1 = -A r,  l2 = -A clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high),  ppo = max(l1, l2)
    loss = min(ppo, -A clip_ratio_c) where A < 0, else ppo     (times rollout_is_weights if given)
The forward kernel reduces each response to `row_stats` without writing any [B, T] intermediate;
the aggregation mode then needs only those B rows. The backward kernel recomputes the branch
taken by each token and writes d loss / d log_prob, following torch's gradient conventions
exactly: clamp passes the gradient on its closed interval, maximum/minimum split it on ties.

backend "torch" (and "auto" on CPU): the same two passes in plain torch over chunks of R rows
(R x T about _TORCH_CHUNK_ELEMS tokens, so a chunk's few fp32 buffers stay in cache), with the
per-token loss in closed form. Since -A > 0 when A < 0 and fp32 rounding is monotone,
    A >= 0:  max(-A r, -A clip(r, lo, hi)) = -A min(r, hi)
    A <  0:  min(max(-A r, -A clip(r, lo, hi)), -A c) = -A clamp(r, lo, c)
bit for bit, i.e. loss = -A clamp(r, L, U) with (L, U) = (0, hi) for A >= 0 and (lo, c) for A < 0.
With f = clamp(r, L, U), sign(A (r - f)) is +1 where the clip engaged (pg_clipfrac), -1 where the
dual clip did (pg_clipfrac_lower), 0 elsewhere; the gradient is -A r where f == r (and the log
ratio was not clamped at -20), else 0. About 20 elementwise passes forward and 25 backward, each
over a cache-sized chunk and none through torch's slower bool ops, against about 50 full-size
ones for the eager reference. At kinks it takes clamp's closed-interval convention:
it differs from the reference's tie split only where -A r equals -A c exactly (r = c, A < 0) or
rounds to -A times a clip bound from outside it (r within an ulp of the bound): there the
reference gives half the gradient of one side, this path all of it or none.
"""

from __future__ import annotations

from numbers import Real

import torch
from torch import Tensor

from megatron_dapo.algos.policy_loss import AGG_MODES, check_clip_ratios, compute_policy_loss_vanilla

try:  # a missing or broken triton must not break `import megatron_dapo.kernels`
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    TRITON_IMPORT_ERROR: Exception | None = None
except Exception as err:  # noqa: BLE001 (ImportError, or a RuntimeError from a broken install)
    triton = tl = InterpretedFunction = None
    TRITON_IMPORT_ERROR = err

__all__ = ["METRIC_NAMES", "fused_clipped_token_loss", "fused_clipped_token_loss_reference"]

METRIC_NAMES = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")
BACKENDS = ("auto", "triton", "torch")
_SEQ_MODES = ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
_BLOCK_T = 1024  # one response row is a few thousand tokens: a handful of tiles per program
# Tokens per chunk of the torch path: 512K fp32 tokens = 2 MiB per buffer, about 6 buffers live
# (12 MiB, inside the L3 cache) while its ~45 elementwise ops run. Measured at B 256 x T 4096:
# with 1 thread, 32K- to 256K-token chunks all take 12-24 ms (the reference: 53-62 ms); with 2
# threads on a machine loaded 2-10x past its cores, every op is an OpenMP region that waits for a
# descheduled thread, so time grows with the number of regions: 512K-token chunks (2 here, ~90
# regions, as many as the eager reference has) ran 1.2 s median against 3.1 s for 128K ones.
_TORCH_CHUNK_ELEMS = 1 << 19


if triton is not None:

    @triton.jit
    def _clipped_loss_fwd_kernel(
        lp_ptr, old_ptr, adv_ptr, mask_ptr, isw_ptr, stats_ptr,  # stats [B, 5] fp32
        T, ratio_low, ratio_high, clip_c,
        HAS_ISW: tl.constexpr, BLOCK_T: tl.constexpr,
    ):
        """One program per response: the five row sums of `row_stats`."""
        row = tl.program_id(0).to(tl.int64)
        acc_loss = tl.zeros([BLOCK_T], tl.float32)
        acc_tokens = tl.zeros([BLOCK_T], tl.float32)
        acc_clip = tl.zeros([BLOCK_T], tl.float32)
        acc_kl = tl.zeros([BLOCK_T], tl.float32)
        acc_lower = tl.zeros([BLOCK_T], tl.float32)
        for t0 in range(0, T, BLOCK_T):
            offs = row * T + t0 + tl.arange(0, BLOCK_T)
            inb = t0 + tl.arange(0, BLOCK_T) < T
            m = tl.load(mask_ptr + offs, mask=inb, other=0).to(tl.float32)
            valid = m != 0.0  # padding may hold garbage (even inf): keep it out of every sum
            lp = tl.load(lp_ptr + offs, mask=inb, other=0.0).to(tl.float32)
            old = tl.load(old_ptr + offs, mask=inb, other=0.0).to(tl.float32)
            adv = tl.load(adv_ptr + offs, mask=inb, other=0.0).to(tl.float32)
            log_ratio = tl.minimum(tl.maximum(lp - old, -20.0), 20.0)
            ratio = tl.exp(log_ratio)
            neg_adv = -adv
            l1 = neg_adv * ratio
            l2 = neg_adv * tl.minimum(tl.maximum(ratio, ratio_low), ratio_high)
            ppo = tl.maximum(l1, l2)
            bound = neg_adv * clip_c
            is_neg = adv < 0.0
            loss = tl.where(is_neg, tl.minimum(ppo, bound), ppo)
            if HAS_ISW:
                loss = loss * tl.load(isw_ptr + offs, mask=inb, other=0.0).to(tl.float32)
            acc_loss += tl.where(valid, loss * m, 0.0)
            acc_tokens += m
            acc_clip += tl.where(valid & (l2 > l1), m, 0.0)
            acc_kl += tl.where(valid, -log_ratio * m, 0.0)
            acc_lower += tl.where(valid & is_neg & (ppo > bound), m, 0.0)
        out = stats_ptr + row * 5
        tl.store(out, tl.sum(acc_loss, axis=0))
        tl.store(out + 1, tl.sum(acc_tokens, axis=0))
        tl.store(out + 2, tl.sum(acc_clip, axis=0))
        tl.store(out + 3, tl.sum(acc_kl, axis=0))
        tl.store(out + 4, tl.sum(acc_lower, axis=0))

    @triton.jit
    def _clipped_loss_bwd_kernel(
        lp_ptr, old_ptr, adv_ptr, mask_ptr, isw_ptr, row_scale_ptr, grad_ptr,
        T, ratio_low, ratio_high, clip_c,
        HAS_ISW: tl.constexpr, BLOCK_T: tl.constexpr,
    ):
        """One program per response: grad[b, t] = row_scale[b] * mask * w * d loss[b, t] / d log_prob."""
        row = tl.program_id(0).to(tl.int64)
        scale = tl.load(row_scale_ptr + row)
        for t0 in range(0, T, BLOCK_T):
            offs = row * T + t0 + tl.arange(0, BLOCK_T)
            inb = t0 + tl.arange(0, BLOCK_T) < T
            m = tl.load(mask_ptr + offs, mask=inb, other=0).to(tl.float32)
            lp = tl.load(lp_ptr + offs, mask=inb, other=0.0).to(tl.float32)
            old = tl.load(old_ptr + offs, mask=inb, other=0.0).to(tl.float32)
            adv = tl.load(adv_ptr + offs, mask=inb, other=0.0).to(tl.float32)
            diff = lp - old
            ratio = tl.exp(tl.minimum(tl.maximum(diff, -20.0), 20.0))
            d_ratio = tl.where((diff >= -20.0) & (diff <= 20.0), ratio, 0.0)  # d r / d log_prob
            neg_adv = -adv
            l1 = neg_adv * ratio
            l2 = neg_adv * tl.minimum(tl.maximum(ratio, ratio_low), ratio_high)
            g1 = neg_adv * d_ratio
            g2 = tl.where((ratio >= ratio_low) & (ratio <= ratio_high), g1, 0.0)
            g_ppo = tl.where(l1 > l2, g1, tl.where(l2 > l1, g2, 0.5 * (g1 + g2)))
            ppo = tl.maximum(l1, l2)
            bound = neg_adv * clip_c
            g_dual = tl.where(ppo < bound, g_ppo, tl.where(ppo > bound, 0.0, 0.5 * g_ppo))
            g = tl.where(adv < 0.0, g_dual, g_ppo)
            if HAS_ISW:
                g = g * tl.load(isw_ptr + offs, mask=inb, other=0.0).to(tl.float32)
            g = tl.where(m != 0.0, g * m * scale, 0.0)
            tl.store(grad_ptr + offs, g.to(grad_ptr.dtype.element_ty), mask=inb)


def _chunk_rows(b: int, t: int) -> int:
    return max(1, min(b, _TORCH_CHUNK_ELEMS // max(t, 1)))


def _rowdot(x: Tensor, m: Tensor) -> Tensor:
    """sum_t x[r, t] m[r, t] for each row r of [R, T] tensors (vecdot: 5x faster than bmm here)."""
    return torch.linalg.vecdot(x, m)


def _chunk_ratio_and_bounds(lp, old, adv, clip):
    """(raw log ratio, log ratio clamped to [-20, 20], L, U) of one chunk, each [R, T] fp32.

    The bounds come from float arithmetic on sign(A): torch's bool ops (lt, where) cost 3-5x a
    float op on CPU. neg = 1 where A < 0 else 0 (sign(A) is -1, 0 or 1), then L = neg lo and
    U = hi + neg (c - hi), exact for neg in {0, 1}."""
    ratio_low, ratio_high, clip_c = clip
    d_raw = lp.float() - old.float()
    d = d_raw.clamp(-20.0, 20.0)
    neg = adv.sign().neg_().clamp_(min=0.0)
    lower = neg * ratio_low
    upper = neg.mul_(clip_c - ratio_high).add_(ratio_high)
    return d_raw, d, lower, upper


def _torch_row_stats(log_prob, old_log_prob, advantages, mask, is_weights, clip) -> Tensor:
    """row_stats [B, 5] fp32 (loss sum, tokens, clipped, kl sum, dual-clipped), chunk by chunk."""
    b, t = log_prob.shape
    stats = torch.zeros(b, 5, dtype=torch.float32, device=log_prob.device)
    rows = _chunk_rows(b, t)
    for r0 in range(0, b if t > 0 else 0, rows):
        sl = slice(r0, min(b, r0 + rows))
        adv = advantages[sl].float()
        m = mask[sl].float()
        d_raw, d, lower, upper = _chunk_ratio_and_bounds(log_prob[sl], old_log_prob[sl], adv, clip)
        del d_raw
        out = stats[sl]
        out[:, 1] = m.sum(dim=1)
        out[:, 3] = -_rowdot(d, m)
        r = d.exp_()
        neg_loss = torch.clamp(r, lower, upper).mul_(adv)  # A f = -(per-token loss)
        del lower, upper
        sign = r.mul_(adv).sub_(neg_loss).sign_()  # sign(A r - A f): +1 clipped, -1 dual-clipped
        both = _rowdot(sign, m)  # clipped - dual
        total = _rowdot(sign.abs_(), m)  # clipped + dual
        out[:, 2] = 0.5 * (total + both)
        out[:, 4] = 0.5 * (total - both)
        if is_weights is not None:
            neg_loss.mul_(is_weights[sl].float())
        out[:, 0] = -_rowdot(neg_loss, m)
    return stats


def _torch_grad(log_prob, old_log_prob, advantages, mask, is_weights, row_scale, clip) -> Tensor:
    """d loss / d log_prob [B, T] in log_prob's dtype: row_scale[b] * mask * w * (-A r) where the
    closed form's clamp and the log-ratio clamp at -20 pass the gradient, recomputed chunk by chunk."""
    b, t = log_prob.shape
    grad = torch.empty_like(log_prob)
    rows = _chunk_rows(b, t)
    for r0 in range(0, b if t > 0 else 0, rows):
        sl = slice(r0, min(b, r0 + rows))
        adv = advantages[sl].float()
        d_raw, d, lower, upper = _chunk_ratio_and_bounds(log_prob[sl], old_log_prob[sl], adv, clip)
        r = d.exp_()
        # blocked = |f - r| + max(0, -20 - d_raw): 0 exactly where both clamps pass the gradient
        blocked = torch.clamp(r, lower, upper).sub_(r).abs_()
        del lower, upper
        blocked.sub_(d_raw.add_(20.0).clamp_(max=0.0))
        passes = blocked.sign_().neg_().add_(1.0)  # 1 - sign(blocked): 1 or 0
        g = r.mul_(adv).mul_(passes).mul_(mask[sl].float())
        if is_weights is not None:
            g.mul_(is_weights[sl].float())
        # d (-A r) / d log_prob = -A r, times d loss / d per-token loss = row_scale
        if grad.dtype == torch.float32:
            torch.mul(g, row_scale[sl, None].neg(), out=grad[sl])
        else:
            grad[sl] = g.mul_(row_scale[sl, None].neg())
    return grad


def _resolve_count(value, default: Tensor, name: str, dp_size: int) -> Tensor | float:
    """A global count as given (tensor or positive number), or the local one (at least 1)."""
    if value is None:
        if dp_size > 1:
            raise ValueError(f"{name} is required when dp_size > 1 (got dp_size={dp_size}): pass the "
                             "count summed over every micro-batch and data-parallel rank")
        return default.clamp(min=1)
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        return value.reshape(()).to(torch.float32)
    if isinstance(value, bool) or not isinstance(value, Real) or value <= 0:
        raise ValueError(f"{name} must be a positive number or a scalar tensor, got {value!r}")
    return float(value)


def _aggregate(stats: Tensor, mode: str, dp_size: int, batch_num_tokens, global_batch_size,
               seq_len: int) -> tuple[Tensor, Tensor]:
    """(loss [], row_scale [B]) from row_stats, in the same order of operations as agg_loss."""
    loss_sum, tokens = stats[:, 0], stats[:, 1]
    if mode == "token-mean":
        denom = _resolve_count(batch_num_tokens, tokens.sum(), "batch_num_tokens", dp_size)
        return loss_sum.sum() / denom * dp_size, (torch.ones_like(tokens) / denom) * dp_size
    if mode == "token-sum":
        return loss_sum.sum() * dp_size, torch.full_like(tokens, float(dp_size))
    seq_valid = (tokens > 0).to(torch.float32)
    denom = _resolve_count(global_batch_size, seq_valid.sum(), "global_batch_size", dp_size)
    per_seq = seq_valid
    if mode == "seq-mean-token-mean":
        loss_sum = loss_sum / (tokens + 1e-8)
        per_seq = seq_valid / (tokens + 1e-8)
    loss = (loss_sum * seq_valid).sum() / denom * dp_size
    row_scale = per_seq / denom * dp_size
    if mode == "seq-mean-token-sum-norm":
        loss, row_scale = loss / seq_len, row_scale / seq_len
    return loss, row_scale


class _ClippedTokenLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, log_prob, old_log_prob, advantages, mask, is_weights, clip, agg, use_triton):
        ratio_low, ratio_high, clip_c = clip
        mode, dp_size, batch_num_tokens, global_batch_size = agg
        b, t = log_prob.shape
        has_isw = is_weights is not None
        if not use_triton:
            stats = _torch_row_stats(log_prob, old_log_prob, advantages, mask, is_weights, clip)
        else:
            stats = torch.empty(b, 5, dtype=torch.float32, device=log_prob.device)
        if use_triton and b > 0:
            _clipped_loss_fwd_kernel[(b,)](
                log_prob, old_log_prob, advantages, mask, is_weights if has_isw else log_prob, stats,
                t, ratio_low, ratio_high, clip_c, HAS_ISW=has_isw, BLOCK_T=_BLOCK_T,
            )
        loss, row_scale = _aggregate(stats, mode, dp_size, batch_num_tokens, global_batch_size, t)
        count = stats[:, 1].sum().clamp(min=1)
        metrics = tuple((stats[:, k].sum() / count).to(log_prob.dtype) for k in (2, 3, 4))
        ctx.save_for_backward(log_prob, old_log_prob, advantages, mask, is_weights, row_scale)
        ctx.clip, ctx.use_triton = clip, use_triton
        ctx.mark_non_differentiable(*metrics)
        return (loss.to(log_prob.dtype), *metrics)

    @staticmethod
    def backward(ctx, grad_loss, *unused_metric_grads):
        log_prob, old_log_prob, advantages, mask, is_weights, row_scale = ctx.saved_tensors
        if not ctx.use_triton:
            scale = (row_scale * grad_loss.float()).contiguous()
            return (_torch_grad(log_prob, old_log_prob, advantages, mask, is_weights, scale, ctx.clip),
                    None, None, None, None, None, None, None)
        grad = torch.empty_like(log_prob)
        b, t = log_prob.shape
        if b > 0:
            has_isw = is_weights is not None
            _clipped_loss_bwd_kernel[(b,)](
                log_prob, old_log_prob, advantages, mask, is_weights if has_isw else log_prob,
                (row_scale * grad_loss.float()).contiguous(), grad, t, *ctx.clip,
                HAS_ISW=has_isw, BLOCK_T=_BLOCK_T,
            )
        return grad, None, None, None, None, None, None, None


def _check_args(log_prob, old_log_prob, advantages, response_mask, rollout_is_weights,
                clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode, dp_size, backend):
    if log_prob.dim() != 2:
        raise ValueError(f"log_prob must be a [B, T] tensor, got shape {tuple(log_prob.shape)}")
    for name, x in (("old_log_prob", old_log_prob), ("advantages", advantages),
                    ("response_mask", response_mask), ("rollout_is_weights", rollout_is_weights)):
        if x is not None and x.shape != log_prob.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(log_prob.shape)} "
                             "(the shape of log_prob)")
        if x is not None and x.device != log_prob.device:
            raise ValueError(f"{name} is on {x.device}, log_prob on {log_prob.device}")
    check_clip_ratios(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {list(AGG_MODES)}, got {loss_agg_mode!r}")
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be an int >= 1, got {dp_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")


def _use_triton(backend: str, device: torch.device) -> bool:
    """Resolve `backend`: "auto" is triton for CUDA tensors, the chunked torch path otherwise."""
    if backend == "torch" or (backend == "auto" and (device.type != "cuda" or triton is None)):
        return False
    if triton is None:
        raise RuntimeError(f"backend='triton' needs triton, which failed to import: {TRITON_IMPORT_ERROR!r}")
    # Triton's interpreter, when it is on, built both our kernels and triton's jit helpers (tl.sum)
    interpreting = all(isinstance(k, InterpretedFunction) for k in (_clipped_loss_fwd_kernel, tl.sum))
    if device.type != "cuda" and not interpreting:
        raise RuntimeError(
            f"backend='triton' on {device.type} tensors needs Triton's interpreter: set "
            "TRITON_INTERPRET=1 before anything imports triton (megatron.core does), or use backend='torch'"
        )
    return True


def fused_clipped_token_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    batch_num_tokens: Tensor | Real | None = None,
    dp_size: int = 1,
    global_batch_size: Tensor | Real | None = None,
    rollout_is_weights: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped token loss and its metrics; value and d/d log_prob equal to
    `compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, ...)`.

    Computed in fp32 whatever the input dtype; the loss and metrics (detached 0-dim tensors named
    in METRIC_NAMES) come back in log_prob's dtype. Only log_prob is differentiated: old_log_prob,
    advantages and rollout_is_weights must not require gradients. Masked positions may hold any
    value on the triton path (the kernel never lets them into a sum); on the torch path any finite
    value, or an infinite log_prob or old_log_prob (the +-20 clamp absorbs it), where the
    reference would turn inf into nan.
    backend: "auto" (triton for CUDA tensors, else the chunked torch path), "triton" or "torch".
    Both keep no [B, T] intermediate between forward and backward (the backward recomputes).
    """
    _check_args(log_prob, old_log_prob, advantages, response_mask, rollout_is_weights,
                clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode, dp_size, backend)
    use_triton = _use_triton(backend, log_prob.device)
    for name, x in (("old_log_prob", old_log_prob), ("advantages", advantages),
                    ("rollout_is_weights", rollout_is_weights)):
        if x is not None and x.requires_grad:
            raise ValueError(f"{name} requires grad, but the fused loss differentiates only log_prob: detach it")
    # a bool mask is read as its bytes (no [B, T] copy); a float mask is a per-token weight
    mask = response_mask.contiguous()
    mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    weights = None if rollout_is_weights is None else rollout_is_weights.detach().contiguous()
    # the clip bounds as the reference forms them (1 - low in double, then fp32 in the kernel)
    clip = (1.0 - clip_ratio_low, 1.0 + clip_ratio_high, float(clip_ratio_c))
    agg = (loss_agg_mode, dp_size, batch_num_tokens, global_batch_size)
    loss, *metrics = _ClippedTokenLoss.apply(log_prob.contiguous(), old_log_prob.contiguous(),
                                             advantages.contiguous(), mask, weights, clip, agg, use_triton)
    return loss, dict(zip(METRIC_NAMES, metrics, strict=True))


def fused_clipped_token_loss_reference(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    batch_num_tokens: Tensor | Real | None = None,
    dp_size: int = 1,
    global_batch_size: Tensor | Real | None = None,
    rollout_is_weights: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, dict[str, Tensor]]:
    """The specification: `compute_policy_loss_vanilla` with the same keywords (plain torch,
    autograd). `backend` exists only so the signature matches `fused_clipped_token_loss`."""
    return compute_policy_loss_vanilla(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode,
        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
        rollout_is_weights=rollout_is_weights, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
    )
