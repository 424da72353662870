"""Log-probabilities, entropy and sum_v p_v^2 of the output layer without materialising the [N, V] logits.

Shape legend:
    N  tokens (rows of `hidden`)     H  hidden size     V  vocabulary (the local shard under TP)
    C  tokens per chunk (torch path, and the backward scratch of the triton path)
    P  partial results per row (vocabulary splits of the forward kernel)
    hidden [N, H], weight [V, H], labels [N] int64 (global ids); logprobs, entropy [N] fp32
    z = hidden @ weight.T / temperature: the logits, fp32, never held whole

Math, per row over the full vocabulary, with p = softmax(z) and Ez = sum_j p_j z_j:
    logprob = z_y - lse,   entropy = lse - Ez
    d logprob / d z_j = [j == y] - p_j,   d entropy / d z_j = -p_j (z_j - Ez)
so with upstream gradients g_lp and g_ent:
    dz_j = g_lp [j == y] - p_j (g_lp + g_ent (z_j - Ez))
    d hidden = dz @ weight / temperature,   d weight = dz.T @ hidden / temperature

Per-row statistics relative to a running maximum m (the online log-sum-exp):
    s = sum_j exp(z_j - m),   t = sum_j exp(z_j - m) (z_j - m),   zy = z_y (0 off this shard)
    q = sum_j exp(2 (z_j - m))                                  (only when sum_sq is asked for)
    lse = m + log s,   Ez = m + t / s,   entropy = log s - t / s,   sum_v p_v^2 = q / s^2
Partial statistics merge exactly (`_merge_partials`); vocabulary tiles inside a kernel, the
vocabulary splits of the forward grid and tensor-parallel vocabulary shards all combine this way.
Keeping t relative to m (not sum p z) avoids cancelling two numbers of the size of the logits.

Implementations (all three agree to fp32 round-off; tests/kernels checks it):
    triton     `_lse_entropy_fwd_kernel` writes only [4, P, N] statistics; the backward kernel
               recomputes the logits tile by tile and writes dz for C tokens at a time, then two
               GEMMs give the weight and hidden gradients (see `_triton_grads` for why).
    torch      the same statistics and gradients for C tokens at a time in plain torch (CPU runs).
    reference  `fused_logprob_stats_reference`: full logits and autograd; the specification.

No-grad calls (old and reference log-probs) run the same forward code as the differentiable one
and save nothing, so at equal weights the two give bitwise equal log-probs on one machine.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

try:  # a missing or broken triton must not break `import megatron_dapo.kernels`: torch paths remain
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    TRITON_IMPORT_ERROR: Exception | None = None
except Exception as err:  # noqa: BLE001 (ImportError, or a RuntimeError from a broken install)
    triton = tl = InterpretedFunction = None
    TRITON_IMPORT_ERROR = err

__all__ = ["fused_logprob_entropy", "fused_logprob_entropy_reference", "fused_logprob_stats",
           "fused_logprob_stats_reference"]

BACKENDS = ("auto", "triton", "torch")
# Default scratch budgets (the `scratch_bytes` keyword). The torch path works on tiles of C tokens x B
# vocabulary columns (B = _TORCH_VOCAB_TILE, or V when smaller), at most two fp32 [C, B] buffers at a
# time (the tile's logits, and exp beside them for the entropy or p beside the coefficient in the
# backward), so C = scratch_bytes // (8 B): 32 MiB gives C = 2,048 tokens at B = 2,048. The forward keeps
# a running max and rescales its sums from tile to tile (an online log-sum-exp). Tiles keep the GEMMs
# large in both dimensions and the buffers near the cache. Measured on this 2-core CPU (2 threads,
# H = 1,024, V = 32,000, 8,192 tokens, log-probs then the clipped loss, fwd + bwd): 11.8 s with
# [2,048 x 2,048] tiles, 12.0 s with [1,024 x 2,048], 12.1 s with [4,096 x 2,048], 12.5 s with
# [8,192 x 2,048], 12.2 s with [2,048 x 4,096], 12.6 s with [8,192 x 1,024]; 14.2 s for whole-vocabulary
# chunks of 262 tokens in two [262, V] buffers (the layout this replaced). GEMMs are 94 % of a step.
# The peak memory of a fwd+bwd is about grad_weight + grad_hidden + the scratch (benchmarks/bench_kernels.py).
# The triton backward holds one [C, V] buffer in the input dtype: 256 MiB keeps its two GEMMs
# large enough to run near peak on a GPU. The triton forward needs no scratch.
TORCH_SCRATCH_BYTES = 32 << 20
TRITON_SCRATCH_BYTES = 256 << 20
_TORCH_VOCAB_TILE = 2048  # vocabulary columns per tile of the torch path


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _lse_entropy_fwd_kernel(
        h_ptr, w_ptr, labels_ptr, stats_ptr,  # stats [4 or 5, P, N] fp32: m, s, t, zy (, q)
        N, V, H, stride_h, stride_w, vocab_start, temperature, n_splits, tiles_per_split,
        COMPUTE_SUM_SQ: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
        UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """Program (i, j): rows [i*BLOCK_N, +BLOCK_N) over vocabulary split j (tiles_per_split tiles)."""
        pid_n = tl.program_id(0)
        pid_v = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        target = tl.load(labels_ptr + rows, mask=row_ok, other=-1) - vocab_start  # local column
        # running max starts below any real logit yet finite: (m_i - m_new) * s_i is then 0 on the
        # first tile, where -inf would give -inf * 0 = nan
        m_i = tl.full([BLOCK_N], -1.0e30, tl.float32)
        s_i = tl.zeros([BLOCK_N], tl.float32)
        t_i = tl.zeros([BLOCK_N], tl.float32)
        zy_i = tl.zeros([BLOCK_N], tl.float32)
        q_i = tl.zeros([BLOCK_N], tl.float32)
        for tile in range(0, tiles_per_split):
            cols = (pid_v * tiles_per_split + tile) * BLOCK_V + tl.arange(0, BLOCK_V)
            col_ok = cols < V
            acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
            for k0 in range(0, H, BLOCK_H):
                ks = k0 + tl.arange(0, BLOCK_H)
                k_ok = ks < H
                h = tl.load(h_ptr + rows.to(tl.int64)[:, None] * stride_h + ks[None, :],
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w_t = tl.load(w_ptr + cols.to(tl.int64)[None, :] * stride_w + ks[:, None],
                              mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_H, BLOCK_V]
                if UPCAST_DOT:  # interpreter only: its bf16 tl.dot multiplies bit patterns
                    h = h.to(tl.float32)
                    w_t = w_t.to(tl.float32)
                acc = tl.dot(h, w_t, acc, input_precision=DOT_PRECISION)
            z = tl.where(col_ok[None, :], acc / temperature, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(z, axis=1))
            alpha = tl.exp(m_i - m_new)
            zs = z - m_new[:, None]
            e = tl.exp(zs)  # 0 on padding columns
            zs = tl.where(col_ok[None, :], zs, 0.0)  # there e * zs would be 0 * -inf = nan
            # t is relative to m: moving it from m_i to m_new adds (m_i - m_new) * s_i
            t_i = alpha * (t_i + (m_i - m_new) * s_i) + tl.sum(e * zs, axis=1)
            s_i = alpha * s_i + tl.sum(e, axis=1)
            if COMPUTE_SUM_SQ:  # q is relative to m squared: rescale by alpha^2
                q_i = alpha * alpha * q_i + tl.sum(e * e, axis=1)
            m_i = m_new
            hit = (cols[None, :] == target[:, None]) & col_ok[None, :]
            zy_i += tl.sum(tl.where(hit, z, 0.0), axis=1)
        out = stats_ptr + pid_v * N + rows
        plane = n_splits * N
        tl.store(out, m_i, mask=row_ok)
        tl.store(out + plane, s_i, mask=row_ok)
        tl.store(out + 2 * plane, t_i, mask=row_ok)
        tl.store(out + 3 * plane, zy_i, mask=row_ok)
        if COMPUTE_SUM_SQ:
            tl.store(out + 4 * plane, q_i, mask=row_ok)

    @triton.jit
    def _logits_grad_kernel(
        h_ptr, w_ptr, labels_ptr, lse_ptr, ez_ptr, g_lp_ptr, g_ent_ptr, dz_ptr,  # dz [C, V]
        N, V, H, stride_h, stride_w, stride_dz, vocab_start, temperature,
        HAS_GRAD_ENT: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
        UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """dz / temperature (the gradient of the raw product hidden @ weight.T) for one [BLOCK_N, BLOCK_V] tile."""
        pid_n = tl.program_id(0)
        pid_v = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        row_ok = rows < N
        col_ok = cols < V
        acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
        for k0 in range(0, H, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)
            k_ok = ks < H
            h = tl.load(h_ptr + rows.to(tl.int64)[:, None] * stride_h + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_t = tl.load(w_ptr + cols.to(tl.int64)[None, :] * stride_w + ks[:, None],
                          mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            if UPCAST_DOT:
                h = h.to(tl.float32)
                w_t = w_t.to(tl.float32)
            acc = tl.dot(h, w_t, acc, input_precision=DOT_PRECISION)
        z = acc / temperature
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        g_lp = tl.load(g_lp_ptr + rows, mask=row_ok, other=0.0)
        p = tl.exp(z - lse[:, None])
        if HAS_GRAD_ENT:
            ez = tl.load(ez_ptr + rows, mask=row_ok, other=0.0)
            g_ent = tl.load(g_ent_ptr + rows, mask=row_ok, other=0.0)
            dz = -p * (g_lp[:, None] + g_ent[:, None] * (z - ez[:, None]))
        else:
            dz = -p * g_lp[:, None]
        target = tl.load(labels_ptr + rows, mask=row_ok, other=-1) - vocab_start
        dz = tl.where(cols[None, :] == target[:, None], dz + g_lp[:, None], dz)
        dz = dz / temperature
        ptrs = dz_ptr + rows.to(tl.int64)[:, None] * stride_dz + cols[None, :]
        tl.store(ptrs, dz.to(dz_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _interpreting() -> bool:
    """Whether the kernels run in Triton's interpreter: ours and triton's own jit helpers (tl.sum,
    tl.zeros, ...) must both have been built with TRITON_INTERPRET=1, i.e. it was set before the
    first `import triton` anywhere in the process."""
    return isinstance(_lse_entropy_fwd_kernel, InterpretedFunction) and isinstance(tl.sum, InterpretedFunction)


def _launch_config(dtype: torch.dtype) -> dict:
    """Block sizes and dot settings: compiled CUDA, or Triton's interpreter (TRITON_INTERPRET=1)."""
    interpreted = _interpreting()
    # fp32 operands: "ieee" keeps fp32 products (tf32 would round the logits to ~1e-3);
    # 16-bit operands take the tensor cores, whose products are exact with fp32 accumulation.
    precision = "ieee" if (dtype == torch.float32 or interpreted) else "tf32"
    if interpreted:
        # numpy does each tile op; few large tiles keep the interpreter fast. UPCAST_DOT works around
        # triton-lang/triton#11584 (the interpreter's bf16 tl.dot multiplies the raw uint16 bits):
        # bf16 x bf16 products are exact in fp32, so the result is what the tensor cores compute.
        return dict(BLOCK_N=32, BLOCK_V=128, BLOCK_H=32, UPCAST_DOT=True, DOT_PRECISION=precision)
    # Chosen from cuobjdump -res-usage of the cubins for sm_80 and sm_90 (triton 3.9, compiled on a
    # CPU machine): 8 warps keep the [64, 128] fp32 logit tile and its softmax temporaries in
    # registers (4 warps spill 450-1300 bytes of stack); fp32 operands take BLOCK_H 32 for the same
    # reason. bf16 on sm_90 lowers tl.dot to wgmma.
    block_h = 32 if dtype == torch.float32 else 64
    return dict(BLOCK_N=64, BLOCK_V=128, BLOCK_H=block_h, UPCAST_DOT=False, DOT_PRECISION=precision,
                num_warps=8, num_stages=3)


def _triton_local_stats(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float,
                        vocab_start: int, sum_sq: bool) -> tuple[Tensor, ...]:
    """(m, s, t, zy) and, when `sum_sq`, q: [P, N] each, for this rank's vocabulary shard."""
    (n, h_size), v = hidden.shape, weight.shape[0]
    cfg = _launch_config(hidden.dtype)
    row_blocks = triton.cdiv(n, cfg["BLOCK_N"])
    v_tiles = triton.cdiv(v, cfg["BLOCK_V"])
    # Split the vocabulary so that a small N still fills the GPU (about 4 programs per SM); the
    # interpreter gets a few splits too, so the CPU tests exercise the merge of partial results.
    if hidden.is_cuda:
        target_programs = 4 * torch.cuda.get_device_properties(hidden.device).multi_processor_count
    else:
        target_programs = 8
    splits = max(1, min(v_tiles, triton.cdiv(target_programs, max(row_blocks, 1))))
    tiles_per_split = triton.cdiv(v_tiles, splits)
    splits = triton.cdiv(v_tiles, tiles_per_split)  # every split owns at least one real tile
    stats = torch.empty(5 if sum_sq else 4, splits, n, dtype=torch.float32, device=hidden.device)
    if n > 0:
        _lse_entropy_fwd_kernel[(row_blocks, splits)](
            hidden, weight, labels, stats, n, v, h_size, hidden.stride(0), weight.stride(0),
            vocab_start, float(temperature), splits, tiles_per_split, COMPUTE_SUM_SQ=sum_sq, **cfg,
        )
    return tuple(stats.unbind(0))


def _triton_grads(hidden, weight, labels, lse, ez, g_lp, g_ent, temperature, vocab_start,
                  chunk_size, scratch_bytes, need_hidden, need_weight):
    """Gradients for this rank's shard (grad_hidden before the TP all-reduce).

    Why a [C, V] scratch and two GEMMs rather than accumulating both gradients inside the kernel:
    with H in the thousands a [BLOCK_N, H] accumulator does not fit in registers, so a fused kernel
    must either add into grad_hidden with about V / BLOCK_V fp32 atomics per element (~5e10 at
    N=8192, H=5120, V=152064, and non-deterministic) or recompute the logits once per H block.
    The scratch costs one recompute (tl.dot, fp32 accumulation, consistent with the forward) plus
    the two gradient GEMMs on the tensor cores: the minimum work, deterministic, memory bounded.
    grad_weight accumulates in the weight's dtype over N / C chunks (one rounding per chunk, as
    Liger-Kernel's fused linear cross-entropy does by default).
    """
    (n, h_size), v = hidden.shape, weight.shape[0]
    cfg = _launch_config(hidden.dtype)
    if chunk_size is None:
        budget = TRITON_SCRATCH_BYTES if scratch_bytes is None else scratch_bytes
        chunk_size = max(cfg["BLOCK_N"], budget // (v * hidden.element_size()))
    chunk = min(n, chunk_size)
    grad_hidden = hidden.new_empty(n, h_size) if need_hidden else None  # contiguous, for mm(out=)
    grad_weight = torch.zeros_like(weight) if need_weight else None
    scratch = torch.empty(chunk, v, dtype=hidden.dtype, device=hidden.device)
    has_ent = g_ent is not None
    for c0 in range(0, n, max(chunk, 1)):
        c1 = min(n, c0 + chunk)
        dz = scratch[: c1 - c0]
        grid = (triton.cdiv(c1 - c0, cfg["BLOCK_N"]), triton.cdiv(v, cfg["BLOCK_V"]))
        _logits_grad_kernel[grid](
            hidden[c0:c1], weight, labels[c0:c1], lse[c0:c1], ez[c0:c1], g_lp[c0:c1],
            g_ent[c0:c1] if has_ent else g_lp[c0:c1], dz,
            c1 - c0, v, h_size, hidden.stride(0), weight.stride(0), dz.stride(0), vocab_start,
            float(temperature), HAS_GRAD_ENT=has_ent, **cfg,
        )
        if need_hidden:
            torch.mm(dz, weight, out=grad_hidden[c0:c1])
        if need_weight:
            grad_weight.addmm_(dz.t(), hidden[c0:c1])
    return grad_hidden, grad_weight


# ---------------------------------------------------------------------------------------------
# Chunked torch path (CPU runs; also the CUDA fallback when triton is unavailable)
# ---------------------------------------------------------------------------------------------


def torch_vocab_tile(v: int) -> int:
    """Vocabulary columns per tile of the torch path."""
    return min(max(v, 1), _TORCH_VOCAB_TILE)


def torch_chunk_tokens(v: int, chunk_size: int | None, scratch_bytes: int | None) -> int:
    """Tokens per tile of the torch path: as asked, or as many as keep two fp32 [C, B] buffers
    (B = torch_vocab_tile(v)) within `scratch_bytes` (default TORCH_SCRATCH_BYTES); at least 1. The same
    for every flag (entropy, sum p^2, a backward), so every pass tiles the logits alike."""
    if chunk_size is not None:
        return chunk_size
    budget = TORCH_SCRATCH_BYTES if scratch_bytes is None else scratch_bytes
    return max(1, budget // (2 * 4 * torch_vocab_tile(v)))


def _local_target(labels: Tensor, vocab_start: int, v: int) -> tuple[Tensor, Tensor]:
    """Column of each label in this shard (clamped into range) and whether the shard owns it."""
    local = labels - vocab_start
    owned = (local >= 0) & (local < v)
    return local.clamp(0, v - 1), owned


def tile_stats(z: Tensor, first: bool, col: Tensor, owned: Tensor, out: Tensor, entropy: bool,
               sum_sq: bool) -> None:
    """Fold the fp32 logits z [C, B] of one vocabulary tile into out[:, k] = m, s, t, zy (, q) of its C
    tokens (`first`: z is the first tile, out holds nothing yet; t only when `entropy`); consumes z's buffer.

    m is the running max, s = sum exp(z - m), t = sum exp(z - m) (z - m), q = sum exp(2 (z - m)): a new
    max m' rescales them by r = exp(m - m'), t by r (t + s log r), q by r^2. col / owned: the label's
    column within this tile and whether the tile holds it. Row dot products go through bmm ([C, 1, B] x
    [C, B, 1]), which needs no temporary. z, m, s and zy (so the log-probs) come out of the same
    operations whatever the flags: bit for bit the same values."""
    zy = torch.where(owned, z.gather(1, col[:, None]).squeeze(1), 0.0)
    tile_max = z.max(dim=1).values
    m = tile_max if first else torch.maximum(out[:, 0], tile_max)
    zs = z.sub_(m[:, None])
    e = zs.exp() if entropy or sum_sq else zs.exp_()
    s = e.sum(dim=1)
    t = torch.bmm(e.unsqueeze(1), zs.unsqueeze(2)).view(-1) if entropy else None
    q = torch.bmm(e.unsqueeze(1), e.unsqueeze(2)).view(-1) if sum_sq else None
    if not first:
        log_r = out[:, 0] - m
        r = log_r.exp()
        if entropy:
            t += r * (out[:, 2] + out[:, 1] * log_r)
        if sum_sq:
            q += r * r * out[:, 4]
        s += r * out[:, 1]
        zy += out[:, 3]
    out[:, 0], out[:, 1], out[:, 3] = m, s, zy
    if entropy:
        out[:, 2] = t
    if sum_sq:
        out[:, 4] = q


def chunk_logits(h32: Tensor, w32: Tensor, temperature: float) -> Tensor:
    """z = h32 @ w32.T / temperature [C, B] fp32, in one new buffer."""
    z = h32 @ w32.t()
    return z.div_(temperature) if temperature != 1.0 else z


def _torch_local_stats(hidden, weight, labels, temperature, vocab_start, chunk_size, scratch_bytes, entropy,
                       sum_sq):
    """(m, s, t, zy) and, when `sum_sq`, q: [1, N] each (t is 0 unless `entropy`); at most two fp32
    [C, B] tile buffers live at a time."""
    (n, _), v = hidden.shape, weight.shape[0]
    # no copy for fp32 inputs; 16-bit ones are upcast once (CPU torch has no bf16 GEMM with an fp32
    # result), so their products are exact and accumulate in fp32, as in the triton kernel
    h32, w32 = hidden.float(), weight.float()
    col, owned = _local_target(labels, vocab_start, v)
    stats = torch.zeros(n, 5 if sum_sq else 4, dtype=torch.float32, device=hidden.device)
    chunk, tile = torch_chunk_tokens(v, chunk_size, scratch_bytes), torch_vocab_tile(v)
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        for b0 in range(0, v, tile):
            b1 = min(v, b0 + tile)
            z = chunk_logits(h32[c0:c1], w32[b0:b1], temperature)  # [C, B]
            here = owned[c0:c1] & (col[c0:c1] >= b0) & (col[c0:c1] < b1)
            tile_stats(z, b0 == 0, (col[c0:c1] - b0).clamp(0, b1 - b0 - 1), here,
                       stats[c0:c1], entropy, sum_sq)
            del z  # the tile's buffers go before the next one is allocated
    return tuple(stats.t()[:, None, :].unbind(0))


def _torch_grads(hidden, weight, labels, lse, ez, g_lp, g_ent, temperature, vocab_start,
                 chunk_size, scratch_bytes, need_hidden, need_weight):
    """Gradients for this rank's shard, tile by tile: recompute z for C tokens x B columns, form dz, two
    matmuls accumulating into the hidden and weight gradients."""
    (n, _), v = hidden.shape, weight.shape[0]
    h32, w32 = hidden.float(), weight.float()
    col, owned = _local_target(labels, vocab_start, v)
    grad_hidden = torch.zeros_like(h32) if need_hidden else None
    grad_weight = torch.zeros_like(w32) if need_weight else None
    chunk, tile = torch_chunk_tokens(v, chunk_size, scratch_bytes), torch_vocab_tile(v)
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        lse_c, gl_c = lse[c0:c1, None], g_lp[c0:c1, None]
        hit = torch.where(owned[c0:c1], g_lp[c0:c1], 0.0)
        for b0 in range(0, v, tile):
            b1 = min(v, b0 + tile)
            z = chunk_logits(h32[c0:c1], w32[b0:b1], temperature)
            if g_ent is not None:  # -p (g_lp + g_ent (z - Ez)): p in a second buffer, the coefficient in z's
                p = (z - lse_c).exp_()
                dz = z.sub_(ez[c0:c1, None]).mul_(g_ent[c0:c1, None]).add_(gl_c).mul_(p).neg_()
                del p
            else:  # -g_lp p, in z's buffer
                dz = z.sub_(lse_c).exp_().mul_(gl_c.neg())
            rows = torch.nonzero((col[c0:c1] >= b0) & (col[c0:c1] < b1)).squeeze(1)
            dz.index_put_((rows, col[c0:c1][rows] - b0), hit[rows], accumulate=True)
            if temperature != 1.0:
                dz.div_(temperature)
            if need_hidden:
                grad_hidden[c0:c1].addmm_(dz, w32[b0:b1])
            if need_weight:
                grad_weight[b0:b1].addmm_(dz.t(), h32[c0:c1])
            del z, dz
    return (grad_hidden.to(hidden.dtype) if need_hidden else None,
            grad_weight.to(weight.dtype) if need_weight else None)


# ---------------------------------------------------------------------------------------------
# Statistics: merge partials, reduce across tensor parallelism, finish
# ---------------------------------------------------------------------------------------------


def _merge_partials(m: Tensor, s: Tensor, t: Tensor, zy: Tensor, q: Tensor | None = None) -> tuple:
    """Merge [P, N] partial statistics over P into [N] (exact, in any order); q is None when not
    computed."""
    m_all = m.max(dim=0).values
    scale = torch.exp(m - m_all)
    s_all = (scale * s).sum(dim=0)
    t_all = (scale * (t + (m - m_all) * s)).sum(dim=0)
    q_all = None if q is None else (scale * scale * q).sum(dim=0)
    return m_all, s_all, t_all, zy.sum(dim=0), q_all


def _reduce_across_tp(m, s, t, zy, q, tp_group):
    """Merge the per-shard statistics of every tensor-parallel rank (two all-reduces)."""
    m_all = m.clone()
    dist.all_reduce(m_all, op=dist.ReduceOp.MAX, group=tp_group)
    scale = torch.exp(m - m_all)
    parts = [scale * s, scale * (t + (m - m_all) * s), zy]
    if q is not None:
        parts.append(scale * scale * q)
    packed = torch.stack(parts)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=tp_group)
    return m_all, packed[0], packed[1], packed[2], (packed[3] if q is not None else None)


def _tp_size(tp_group) -> int:
    return 1 if tp_group is None else dist.get_world_size(tp_group)


def _vocab_start(weight: Tensor, tp_group) -> int:
    """Megatron's vocabulary layout: rank r holds rows [r * V_local, (r + 1) * V_local)."""
    return dist.get_rank(tp_group) * weight.shape[0] if _tp_size(tp_group) > 1 else 0


def _forward_stats(hidden, weight, labels, temperature, chunk_size, scratch_bytes, tp_group, use_triton,
                   entropy, sum_sq):
    """(logprobs, entropy, sum_sq or None, lse, ez) [N] fp32: the one forward every caller runs.
    Without `entropy` the torch path skips t, and entropy and ez are then meaningless."""
    vocab_start = _vocab_start(weight, tp_group)
    local = (_triton_local_stats(hidden, weight, labels, temperature, vocab_start, sum_sq) if use_triton
             else _torch_local_stats(hidden, weight, labels, temperature, vocab_start, chunk_size,
                                     scratch_bytes, entropy, sum_sq))
    m, s, t, zy, q = _merge_partials(*local)
    if _tp_size(tp_group) > 1:
        m, s, t, zy, q = _reduce_across_tp(m, s, t, zy, q, tp_group)
    log_s, t_over_s = torch.log(s), t / s
    lse = m + log_s
    return zy - lse, log_s - t_over_s, (None if q is None else q / (s * s)), lse, m + t_over_s


class _LogprobStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk_size, scratch_bytes, tp_group, use_triton,
                entropy, sum_sq):
        logprobs, ent, sq, lse, ez = _forward_stats(hidden, weight, labels, temperature, chunk_size,
                                                    scratch_bytes, tp_group, use_triton, entropy, sum_sq)
        ctx.save_for_backward(hidden, weight, labels, lse, ez)
        ctx.cfg = (temperature, chunk_size, scratch_bytes, tp_group, use_triton, _vocab_start(weight, tp_group))
        ctx.set_materialize_grads(False)
        if not entropy:  # the caller returns None for it, so no gradient can reach it
            ctx.mark_non_differentiable(ent)
        if sq is None:
            return logprobs, ent
        ctx.mark_non_differentiable(sq)
        return logprobs, ent, sq

    @staticmethod
    def backward(ctx, g_lp, g_ent, *unused_sum_sq_grad):
        hidden, weight, labels, lse, ez = ctx.saved_tensors
        temperature, chunk_size, scratch_bytes, tp_group, use_triton, vocab_start = ctx.cfg
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_lp is None and g_ent is None) or not (need_hidden or need_weight):
            return (None,) * 10
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float().contiguous()
        g_ent = None if g_ent is None else g_ent.float().contiguous()
        grads = _triton_grads if use_triton else _torch_grads
        grad_hidden, grad_weight = grads(hidden, weight, labels, lse, ez, g_lp, g_ent, temperature,
                                         vocab_start, chunk_size, scratch_bytes, need_hidden, need_weight)
        if need_hidden and _tp_size(tp_group) > 1:
            # every shard contributes dz_shard @ weight_shard to the replicated hidden
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=tp_group)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def _check_inputs(hidden, weight, labels, temperature, chunk_size, backend, tp_group, scratch_bytes) -> None:
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"hidden must be [N, H] and weight [V, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden size mismatch: hidden is {tuple(hidden.shape)}, weight is "
                         f"{tuple(weight.shape)} (both need H as their last dimension)")
    if labels.shape != hidden.shape[:1] or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be integer ids of shape [{hidden.shape[0]}], got "
                         f"{labels.dtype} {tuple(labels.shape)}")
    if not hidden.dtype.is_floating_point or hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight need the same floating dtype, got {hidden.dtype} and {weight.dtype}")
    if not (hidden.device == weight.device == labels.device):
        raise ValueError(f"hidden, weight and labels must share a device, got {hidden.device}, "
                         f"{weight.device}, {labels.device}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size!r}")
    if scratch_bytes is not None and (isinstance(scratch_bytes, bool) or not isinstance(scratch_bytes, int)
                                      or scratch_bytes < 1):
        raise ValueError(f"scratch_bytes must be None or a positive int, got {scratch_bytes!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if not labels.is_cuda and labels.numel() > 0:  # on CUDA the check would synchronise the stream
        v_total = weight.shape[0] * _tp_size(tp_group)
        bad = ((labels < 0) | (labels >= v_total)).nonzero()
        if bad.numel() > 0:
            row = int(bad[0, 0])
            raise ValueError(f"labels[{row}] = {int(labels[row])} is outside the vocabulary [0, {v_total})")


def _use_triton(backend: str, device: torch.device) -> bool:
    """Resolve `backend`: "auto" is triton for CUDA tensors, the torch path otherwise."""
    if backend == "torch" or (backend == "auto" and (device.type != "cuda" or triton is None)):
        return False
    if triton is None:
        raise RuntimeError(f"backend='triton' needs triton, which failed to import: {TRITON_IMPORT_ERROR!r}")
    if device.type != "cuda" and not _interpreting():
        raise RuntimeError(
            f"backend='triton' on {device.type} tensors needs Triton's interpreter: set "
            "TRITON_INTERPRET=1 before anything imports triton (megatron.core does), or use backend='torch'"
        )
    return True


def fused_logprob_stats(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    compute_entropy: bool = True,
    compute_sum_sq: bool = False,
    tp_group=None,
    backend: str = "auto",
    scratch_bytes: int | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Per-token statistics of softmax(hidden @ weight.T / temperature) at `labels`:
    (logprobs [N], entropy [N] or None, sum_sq [N] or None), all fp32.

    logprobs[i] = log p_i[labels[i]], entropy[i] = -sum_v p_iv log p_iv (None unless
    `compute_entropy`), sum_sq[i] = sum_v p_iv^2 (None unless `compute_sum_sq`).
    hidden [N, H] and weight [V, H] share a floating dtype; products accumulate in fp32 whatever
    it is. labels [N] are global token ids.

    Gradients: logprobs and entropy are differentiable with respect to hidden and weight; sum_sq
    is not (it comes back non-differentiable: a metric). When no input requires grad or grad mode
    is off (old and reference log-probs), nothing is saved for backward. Either way the forward is
    the same code, so at equal weights the no-grad and the differentiable log-probs are bitwise
    equal on one machine.

    Memory: never the [N, V] logits. The torch path (CPU) works on tiles of `chunk_size` tokens x 2,048
    vocabulary columns, by default as many tokens as keep two fp32 tile buffers within `scratch_bytes` (default
    TORCH_SCRATCH_BYTES = 32 MiB; each tile's buffers are freed before the next tile, and the
    backward recomputes the logits instead of keeping them). The triton forward needs no scratch;
    its backward holds one [C, V] buffer in the input dtype (default TRITON_SCRATCH_BYTES = 256 MiB).

    Tensor parallelism: with `tp_group` of size tp, `weight` is this rank's shard of the vocabulary,
    rows [rank * V, (rank + 1) * V) (Megatron's layout, equal shards), and `hidden` is replicated.
    Max, sum-exp, target logit, sum(p z) and sum(p^2) statistics are all-reduced over the group
    (labels outside this rank's shard contribute no target logit here); the hidden gradient is
    summed over it, the weight gradient stays local. Labels are range-checked on CPU only (on
    CUDA the check would synchronise).

    backend: "auto" (triton for CUDA tensors, else the chunked torch path), "triton" (CPU tensors
    need TRITON_INTERPRET=1 set before triton is imported), or "torch".
    """
    _check_inputs(hidden, weight, labels, temperature, chunk_size, backend, tp_group, scratch_bytes)
    use_triton = _use_triton(backend, hidden.device)
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    args = (hidden, weight, labels.long().contiguous(), float(temperature), chunk_size, scratch_bytes,
            tp_group, use_triton, bool(compute_entropy), bool(compute_sum_sq))
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        logprobs, entropy, *sq = _LogprobStats.apply(*args)
        sum_sq = sq[0] if sq else None
    else:
        with torch.no_grad():
            logprobs, entropy, sum_sq, _, _ = _forward_stats(*args)
    return logprobs, (entropy if compute_entropy else None), sum_sq


def fused_logprob_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    compute_entropy: bool = True,
    tp_group=None,
    backend: str = "auto",
    scratch_bytes: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(logprobs [N], entropy [N] or None): `fused_logprob_stats` without the squared-probability sum.

    Differentiable with respect to hidden and weight; see `fused_logprob_stats` for memory,
    tensor parallelism and backends.
    """
    logprobs, entropy, _ = fused_logprob_stats(
        hidden, weight, labels, temperature=temperature, chunk_size=chunk_size,
        compute_entropy=compute_entropy, tp_group=tp_group, backend=backend, scratch_bytes=scratch_bytes)
    return logprobs, entropy


def fused_logprob_stats_reference(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    compute_entropy: bool = True,
    compute_sum_sq: bool = False,
    tp_group=None,
    backend: str = "auto",
    scratch_bytes: int | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The specification: full fp32 logits, log_softmax, autograd.

    `chunk_size`, `backend` and `scratch_bytes` exist only so the signature matches
    `fused_logprob_stats`; they change nothing here. The reference is unsharded: compare a TP run
    against it with the full weight.
    """
    _check_inputs(hidden, weight, labels, temperature, chunk_size, backend, None, scratch_bytes)
    if _tp_size(tp_group) > 1:
        raise ValueError("the reference is unsharded: pass the full weight and tp_group=None")
    logits = (hidden.float() @ weight.float().t()) / temperature  # [N, V]
    log_p = torch.log_softmax(logits, dim=-1)
    logprobs = log_p.gather(-1, labels.long()[:, None]).squeeze(-1)
    entropy = sum_sq = None
    if compute_entropy:
        entropy = torch.logsumexp(logits, dim=-1) - (log_p.exp() * logits).sum(dim=-1)
    if compute_sum_sq:
        sum_sq = log_p.exp().square().sum(dim=-1)
    return logprobs, entropy, sum_sq


def fused_logprob_entropy_reference(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    compute_entropy: bool = True,
    tp_group=None,
    backend: str = "auto",
    scratch_bytes: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The specification of `fused_logprob_entropy`: `fused_logprob_stats_reference` without sum_sq."""
    logprobs, entropy, _ = fused_logprob_stats_reference(
        hidden, weight, labels, temperature=temperature, chunk_size=chunk_size,
        compute_entropy=compute_entropy, tp_group=tp_group, backend=backend, scratch_bytes=scratch_bytes)
    return logprobs, entropy
