"""Micro-batches: the rows of one rank's shard sorted and packed by a token budget, split or padded
with fillers to a count every data-parallel rank shares, and the real response tokens of each
micro-batch as a flat index (the LM head never sees a padded position).

Shape legend:
    B  rows of the batch          P  prompt width       T  response width (max_response_length)
    b  rows of one micro-batch    L  = prompt_length + response_length, one row's sequence
    [R, C] the model input of one micro-batch: bshd [b, S] (S the longest L, right-padded),
           thd [1, Stot] (the b sequences concatenated, Stot their total rounded to `seq_multiple`)
    N  real response tokens of a micro-batch (sum of its rows' response lengths)
    W  the micro-batch's response width (its longest response), for the per-row loss tensors

Row r's sequence is prompt_ids[r, :pl] + responses[r, :rl] (dense tensors, or the ragged rows of the
trainer's training batch, read in place: `_gather`). The model predicts
`labels[s] = input[s + 1]` within each sequence; the log-prob of response token t is therefore read
at the output position pl - 1 + t of its sequence. Position (row k, s) of the micro-batch is at
`seq_start[k] + s` in the row-major flattening of the [R, C] input (bshd: k * S + s; thd:
cu_seqlens[k] + s), so the same index picks the hidden states out of the model's [R, C, H] output.

bshd (local layer spec, CPU): rows right-padded; with a causal mask the padding at the end never
influences earlier positions. thd (Transformer Engine): one packed row, `cu_seqlens` marking each
sequence (plus one padding segment when Stot exceeds the real tokens), position ids restarting
per sequence; attention stays within a sequence (Megatron's PackedSeqParams).

Packing (`plan_bins`): the rows are sorted longest first and taken greedily while the bin's cost
stays within `max_tokens` (bshd: rows x longest, the padded size that bounds activation memory;
thd: the sum of lengths). `split_bins` then splits the costliest bins until the agreed count is
reached; a rank with fewer rows than bins gets fillers (`filler_microbatch`): padding only, no row,
no token, but a forward and backward so expert all-to-alls and pipeline sends have partners.

Interleaved pipelines (VPP) run every micro-batch of a pass at one input shape (`pad_microbatch`):
Megatron exchanges p2p shapes with one batched isend/irecv, which with PP = 2 (both neighbours the
same rank) matches the forward and backward shapes crosswise; equal shapes make that harmless. The
bshd bins then count every row at the pass's longest length (`plan_bins(width=...)`), so the fixed
shape stays within the token budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class MicroBatch:
    rows: Tensor  # [b] int64, row indices into the batch (empty for a filler)
    input_ids: Tensor  # [R, C] int64
    position_ids: Tensor  # [R, C] int64, restarting at 0 for every sequence
    labels: Tensor  # [R, C] int64, the next token of the same sequence (pad_id where there is none)
    seq_start: Tensor  # [b] int64, flat index of each sequence's first token in the [R, C] input
    prompt_length: Tensor  # [b] int64
    response_length: Tensor  # [b] int64
    token_index: Tensor  # [N] int64, flat output index whose logits predict each real response token
    token_row: Tensor  # [N] int64, its row k in the micro-batch
    token_pos: Tensor  # [N] int64, its index t in the response
    cu_seqlens: Tensor | None = None  # [segments + 1] int32 (thd only)
    max_seqlen: int | None = None  # longest segment (thd only)

    @property
    def is_filler(self) -> bool:
        return self.rows.numel() == 0

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def seq_len(self) -> Tensor:
        return self.prompt_length + self.response_length

    @property
    def num_padded_tokens(self) -> int:
        """Token positions the transformer runs (R x C)."""
        return self.input_ids.numel()

    @property
    def num_tokens(self) -> int:
        """Real (prompt + response) tokens."""
        return int(self.seq_len.sum())

    @property
    def width(self) -> int:
        """W: the longest response of the micro-batch (0 for a filler)."""
        return int(self.response_length.max()) if not self.is_filler else 0

    def token_labels(self) -> Tensor:
        """[N] the response tokens, in (row, t) order."""
        return self.labels.reshape(-1)[self.token_index]

    def response_label_mask(self) -> Tensor:
        """[R, C] 1 where the label is a response token (the positions of `token_index`)."""
        mask = torch.zeros(self.labels.numel(), dtype=torch.long)
        mask[self.token_index] = 1
        return mask.view_as(self.labels)

    def response_input_mask(self) -> Tensor:
        """[R, C] 1 where the input token is a response token (what a router routes for the policy)."""
        mask = torch.zeros(self.labels.numel(), dtype=torch.long)
        mask[self.token_index + 1] = 1
        return mask.view_as(self.labels)

    def to_rows(self, values: Tensor) -> Tensor:
        """[N] per-token values -> [b, W] per row (zero past each row's response; differentiable)."""
        b, w = self.rows.numel(), self.width
        flat = values.new_zeros(b * w)
        idx = (self.token_row * w + self.token_pos).to(values.device)
        return flat.index_put((idx,), values).view(b, w)

    def packed_seq_params(self, device):
        """Megatron's PackedSeqParams for the thd layout (None for bshd)."""
        if not self.packed:
            return None
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens.to(device)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)


# --- planning --------------------------------------------------------------------------------------

def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bin_cost(lengths: list[int], *, packed: bool) -> int:
    """Token positions a bin of rows with these lengths occupies: thd the sum, bshd rows x longest."""
    if not lengths:
        return 0
    return sum(lengths) if packed else len(lengths) * max(lengths)


def _check_fits(lengths: list[int], max_tokens: int) -> None:
    if any(n > max_tokens for n in lengths):
        worst = max(range(len(lengths)), key=lambda i: lengths[i])
        raise ValueError(f"row {worst} has {lengths[worst]} tokens > actor.max_tokens_per_microbatch={max_tokens}")


def plan_microbatches(lengths: list[int], max_tokens: int, *, sort_by_length: bool = False) -> list[list[int]]:
    """Split row indices into groups whose padded size (rows x longest) stays within max_tokens,
    in row order (sort_by_length: longest first)."""
    _check_fits(lengths, max_tokens)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)) if sort_by_length else range(len(lengths))
    groups: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in order:
        new_longest = max(longest, lengths[i])
        if cur and new_longest * (len(cur) + 1) > max_tokens:
            groups.append(cur)
            cur, new_longest = [], lengths[i]
        cur.append(i)
        longest = new_longest
    if cur:
        groups.append(cur)
    return groups


def plan_bins(lengths: list[int], max_tokens: int, *, packed: bool = False,
              width: int | None = None) -> list[list[int]]:
    """Indices into `lengths`, sorted longest first, packed greedily into bins of cost <= max_tokens.
    width (bshd): every row counts as `width` tokens (micro-batches of one fixed [rows, width] shape).

    Sorting is free for the objective (the loss is normalised by global counts, so which rows share
    a micro-batch does not change it) and removes most padding: rows of similar length share a bin."""
    if width is not None and not packed:
        _check_fits(lengths, max_tokens)
        per = max(1, max_tokens // width)
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        return [order[i:i + per] for i in range(0, len(order), per)]
    if not packed:
        return plan_microbatches(lengths, max_tokens, sort_by_length=True)
    _check_fits(lengths, max_tokens)
    bins: list[list[int]] = []
    total = max_tokens + 1
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if total + lengths[i] > max_tokens:
            bins.append([])
            total = 0
        bins[-1].append(i)
        total += lengths[i]
    return bins


def split_bins(bins: list[list[int]], lengths: list[int], count: int, *, packed: bool = False) -> list[list[int]]:
    """Exactly `count` bins: split the costliest bin of two or more rows in two (contiguous parts, the
    split with the smaller larger half) until there are `count`; where every bin holds one row, add
    empty bins (fillers). The order stays longest first."""
    if count < len(bins):
        raise ValueError(f"cannot make {len(bins)} micro-batches into {count}")
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [k for k, b in enumerate(bins) if len(b) > 1]
        if not splittable:
            bins += [[] for _ in range(count - len(bins))]
            break
        k = max(splittable, key=lambda j: (bin_cost([lengths[i] for i in bins[j]], packed=packed), -j))
        rows = bins[k]
        cut = min(range(1, len(rows)), key=lambda c: (max(bin_cost([lengths[i] for i in rows[:c]], packed=packed),
                                                          bin_cost([lengths[i] for i in rows[c:]], packed=packed)), c))
        bins[k:k + 1] = [rows[:cut], rows[cut:]]
    return bins


def round_for_pipeline(count: int, *, pp: int, interleaved: bool) -> int:
    """Megatron's interleaved schedule needs a micro-batch count that is a multiple of PP and at
    least PP (schedules.py, microbatch_group_size_per_vp_stage = PP); the others need >= 1."""
    if interleaved:
        return max(pp, _round_up(count, pp))
    return max(1, count)


# --- building ---------------------------------------------------------------------------------------

def _response_tokens(rows: list[int], seq_start: Tensor, pl: Tensor, rl: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(token_index, token_row, token_pos) [N]: position pl - 1 + t of each row's sequence."""
    if not rows:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty, empty
    token_row = torch.repeat_interleave(torch.arange(len(rows)), rl)
    starts = torch.cumsum(rl, 0) - rl
    token_pos = torch.arange(int(rl.sum())) - torch.repeat_interleave(starts, rl)
    token_index = seq_start[token_row] + pl[token_row] - 1 + token_pos
    return token_index, token_row, token_pos


def _gather(src, row: Tensor, pos: Tensor, pad_id: int) -> Tensor:
    """src[row, pos] for flat index tensors, as int64; entries past a row's end are read but masked by the
    caller. src: a dense [B, W] tensor, or ragged rows (rollout/ragged.py `RaggedRows`: the training batch's
    ids on every rank, real tokens only), read through their `take` without a dense copy."""
    if not isinstance(src, Tensor):
        return src.take(row, pos).long()
    if not src.shape[1]:
        return torch.full_like(pos, pad_id)
    return src[row, pos.clamp(min=0, max=src.shape[1] - 1)].long()


def _sequence_tokens(rows_t: Tensor, k: Tensor, s: Tensor, pl: Tensor, rl: Tensor, prompt_ids,
                     responses, pad_id: int) -> Tensor:
    """Token s of micro-batch sequence k (prompt_ids[row, :pl] + responses[row, :rl]; pad_id past its
    end), for flat index tensors k and s: one gather per source instead of a copy per row. prompt_ids and
    responses are dense [B, P] / [B, T] tensors or ragged rows (`_gather`)."""
    row = rows_t[k]
    p, n = pl[k], rl[k]
    in_prompt = s < p
    from_prompt = _gather(prompt_ids, row, s, pad_id)
    from_response = _gather(responses, row, s - p, pad_id)
    out = torch.where(in_prompt, from_prompt, from_response)
    return torch.where(s < p + n, out, torch.full_like(out, pad_id))


def build_microbatch(rows: list[int], prompt_ids: Tensor, prompt_length: Tensor, responses: Tensor,
                     response_length: Tensor, *, pad_id: int, seq_multiple: int = 1,
                     packed: bool = False) -> MicroBatch:
    """One micro-batch of `rows` (bshd, or thd when `packed`). seq_multiple: S (bshd) or Stot (thd)
    is rounded up to it (sequence parallelism splits the sequence over the TP ranks)."""
    if not rows:
        raise ValueError("a micro-batch needs at least one row (fillers come from filler_microbatch)")
    rows_t = torch.tensor(rows, dtype=torch.long)
    pl, rl = prompt_length[rows_t].long(), response_length[rows_t].long()
    if bool((pl < 1).any()):
        k = int((pl < 1).nonzero()[0, 0])
        raise ValueError(f"row {rows[k]} has an empty prompt: its first response token has no position to predict it")
    seq_len = pl + rl
    lengths = seq_len.tolist()
    if packed:
        total = sum(lengths)
        stot = _round_up(total, seq_multiple)
        starts = torch.cumsum(seq_len, 0) - seq_len
        segments = lengths + ([stot - total] if stot > total else [])
        cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(segments), 0)
        # position s of the packed row: sequence k = the segment holding it, offset s - starts[k]
        seg = torch.repeat_interleave(torch.arange(len(rows)), seq_len)
        offset = torch.arange(total) - starts[seg]
        tokens = _sequence_tokens(rows_t, seg, offset, pl, rl, prompt_ids, responses, pad_id)
        next_ok = torch.ones(total, dtype=torch.bool)
        next_ok[(starts + seq_len - 1)] = False  # a sequence's last token has no next token in it
        ids = torch.full((1, stot), pad_id, dtype=torch.long)
        labels = torch.full((1, stot), pad_id, dtype=torch.long)
        ids[0, :total] = tokens
        labels[0, :total - 1] = torch.where(next_ok[:total - 1], tokens[1:], pad_id)
        pos = torch.zeros(1, stot, dtype=torch.long)
        pos[0, :total] = offset
        if stot > total:
            pos[0, total:] = torch.arange(stot - total)
        seq_start = starts
        extra = dict(cu_seqlens=cu, max_seqlen=max(segments))
    else:
        S = _round_up(max(lengths), seq_multiple)
        b = len(rows)
        k = torch.arange(b).repeat_interleave(S + 1)
        s = torch.arange(S + 1).repeat(b)
        full = _sequence_tokens(rows_t, k, s, pl, rl, prompt_ids, responses, pad_id).view(b, S + 1)
        ids, labels = full[:, :S].contiguous(), full[:, 1:].contiguous()
        pos = torch.arange(S, dtype=torch.long).unsqueeze(0).expand(b, S).contiguous()
        seq_start = torch.arange(b, dtype=torch.long) * S
        extra = {}
    token_index, token_row, token_pos = _response_tokens(rows, seq_start, pl, rl)
    return MicroBatch(rows=rows_t, input_ids=ids, position_ids=pos, labels=labels, seq_start=seq_start,
                      prompt_length=pl, response_length=rl, token_index=token_index, token_row=token_row,
                      token_pos=token_pos, **extra)


def filler_microbatch(*, pad_id: int, seq_multiple: int = 1, packed: bool = False, length: int = 2) -> MicroBatch:
    """A micro-batch of padding only (no row, no token) of `length` positions rounded to seq_multiple; at
    least two, so that Megatron's per-micro-batch MTP normalisation keeps a token after each shift
    (the policy passes mtp_num_layers + 1)."""
    n = _round_up(max(2, length), seq_multiple)
    empty = torch.zeros(0, dtype=torch.long)
    extra = dict(cu_seqlens=torch.tensor([0, n], dtype=torch.int32), max_seqlen=n) if packed else {}
    return MicroBatch(rows=empty, input_ids=torch.full((1, n), pad_id, dtype=torch.long),
                      position_ids=torch.arange(n).unsqueeze(0), labels=torch.full((1, n), pad_id, dtype=torch.long),
                      seq_start=empty, prompt_length=empty, response_length=empty, token_index=empty,
                      token_row=empty, token_pos=empty, **extra)


def pad_microbatch(mb: MicroBatch, rows: int, cols: int, *, pad_id: int) -> MicroBatch:
    """`mb` grown to the [rows, cols] input shape with padding (bshd: padding rows and columns; thd: the
    padding segment grows). Real tokens keep their values; their flat index follows the new width."""
    R, C = mb.input_ids.shape
    if (R, C) == (rows, cols):
        return mb
    if rows < R or cols < C or (mb.packed and rows != 1):
        raise ValueError(f"cannot pad a [{R}, {C}] micro-batch to [{rows}, {cols}]")
    ids = torch.full((rows, cols), pad_id, dtype=torch.long)
    labels = torch.full((rows, cols), pad_id, dtype=torch.long)
    ids[:R, :C], labels[:R, :C] = mb.input_ids, mb.labels
    extra = {}
    if mb.packed:
        pos = torch.zeros(1, cols, dtype=torch.long)
        pos[:, :C] = mb.position_ids
        cu = mb.cu_seqlens.tolist()
        has_pad_segment = len(cu) == mb.rows.numel() + 2
        start = cu[-2] if has_pad_segment else cu[-1]
        cu = (cu[:-1] if has_pad_segment else cu) + [cols]
        pos[0, start:] = torch.arange(cols - start)
        seq_start = mb.seq_start
        extra = dict(cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                     max_seqlen=max(b - a for a, b in zip(cu, cu[1:])))
    else:
        pos = torch.arange(cols, dtype=torch.long).unsqueeze(0).expand(rows, cols).contiguous()
        seq_start = torch.arange(mb.rows.numel(), dtype=torch.long) * cols
    token_index = seq_start[mb.token_row] + mb.prompt_length[mb.token_row] - 1 + mb.token_pos
    return MicroBatch(rows=mb.rows, input_ids=ids, position_ids=pos, labels=labels, seq_start=seq_start,
                      prompt_length=mb.prompt_length, response_length=mb.response_length, token_index=token_index,
                      token_row=mb.token_row, token_pos=mb.token_pos, **extra)


def make_microbatches(prompt_ids: Tensor, prompt_length: Tensor, responses: Tensor, response_length: Tensor,
                      *, rows: list[int] | None = None, max_tokens: int, pad_id: int, sort_by_length: bool = True,
                      seq_multiple: int = 1, packed: bool = False, count: int | None = None) -> list[MicroBatch]:
    """Micro-batches over `rows` (default: all rows) of a batch: sorted and packed (`plan_bins`), then
    split or filled to `count` when given. sort_by_length=False keeps the row order (bshd only)."""
    rows = list(range(responses.shape[0])) if rows is None else list(rows)
    lengths = [int(prompt_length[r] + response_length[r]) for r in rows]
    if sort_by_length or packed:
        bins = plan_bins(lengths, max_tokens, packed=packed)
    else:
        bins = plan_microbatches(lengths, max_tokens)
    if count is not None:
        bins = split_bins(bins, lengths, count, packed=packed)
    return [build_microbatch([rows[i] for i in g], prompt_ids, prompt_length, responses, response_length,
                             pad_id=pad_id, seq_multiple=seq_multiple, packed=packed) if g else
            filler_microbatch(pad_id=pad_id, seq_multiple=seq_multiple, packed=packed) for g in bins]
