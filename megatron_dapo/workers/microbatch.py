"""Micro-batches packed by a token budget, and the prompt+response <-> response-aligned mapping.

Shape legend:
    B  rows of the batch          P  prompt width       T  response width (max_response_length)
    b  rows of one micro-batch    S  longest prompt+response in the micro-batch

Row r's sequence is prompt_ids[r, :pl] + responses[r, :rl]. The model reads `input_ids[:, :S]` and
predicts `labels[:, s] = input_ids[:, s + 1]`; the log-prob of response token j is therefore at
position pl - 1 + j. Sequences are right-padded inside a micro-batch: with a causal mask padding
at the end never influences earlier positions, so padded rows give exactly the unpadded values.

Packing: rows are taken in order (deterministic), a micro-batch closes when adding the next row
would make `b * S` exceed `max_tokens` (the padded token count bounds activation memory). Rows
sorted by length first reduce padding; the caller decides (`sort_by_length`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class MicroBatch:
    rows: Tensor  # [b] int64, row indices into the batch
    input_ids: Tensor  # [b, S] int64
    position_ids: Tensor  # [b, S] int64
    labels: Tensor  # [b, S] int64 (the next token; pad_id past the end)
    resp_start: Tensor  # [b] int64, position whose logits predict response token 0 (= prompt_length - 1)
    seq_len: Tensor  # [b] int64, prompt_length + response_length

    @property
    def num_padded_tokens(self) -> int:
        return self.input_ids.numel()


def plan_microbatches(lengths: list[int], max_tokens: int, *, sort_by_length: bool = False) -> list[list[int]]:
    """Split row indices into groups whose padded size (rows x longest) stays within max_tokens."""
    if any(n > max_tokens for n in lengths):
        worst = max(range(len(lengths)), key=lambda i: lengths[i])
        raise ValueError(f"row {worst} has {lengths[worst]} tokens > actor.max_tokens_per_microbatch={max_tokens}")
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


def build_microbatch(rows: list[int], prompt_ids: Tensor, prompt_length: Tensor, responses: Tensor,
                     response_length: Tensor, *, pad_id: int, seq_multiple: int = 1) -> MicroBatch:
    """seq_multiple: S is rounded up to it (sequence parallelism splits S over the TP ranks)."""
    rows_t = torch.tensor(rows, dtype=torch.long)
    pl, rl = prompt_length[rows_t], response_length[rows_t]
    seq_len = pl + rl
    S = -(-int(seq_len.max()) // seq_multiple) * seq_multiple
    ids = torch.full((len(rows), S + 1), pad_id, dtype=torch.long)
    for k, r in enumerate(rows):
        p, n = int(pl[k]), int(rl[k])
        ids[k, :p] = prompt_ids[r, :p]
        ids[k, p:p + n] = responses[r, :n]
    position_ids = torch.arange(S, dtype=torch.long).unsqueeze(0).expand(len(rows), S).contiguous()
    return MicroBatch(rows=rows_t, input_ids=ids[:, :S].contiguous(), position_ids=position_ids,
                      labels=ids[:, 1:].contiguous(), resp_start=(pl - 1).clamp(min=0), seq_len=seq_len)


def make_microbatches(prompt_ids: Tensor, prompt_length: Tensor, responses: Tensor, response_length: Tensor,
                      *, rows: list[int] | None = None, max_tokens: int, pad_id: int,
                      sort_by_length: bool = False, seq_multiple: int = 1) -> list[MicroBatch]:
    """Micro-batches over `rows` (default: all rows) of a batch."""
    rows = list(range(responses.shape[0])) if rows is None else list(rows)
    lengths = [int(prompt_length[r] + response_length[r]) for r in rows]
    plan = plan_microbatches(lengths, max_tokens, sort_by_length=sort_by_length)
    return [build_microbatch([rows[i] for i in g], prompt_ids, prompt_length, responses, response_length,
                             pad_id=pad_id, seq_multiple=seq_multiple) for g in plan]


def to_response_aligned(values: Tensor, mb: MicroBatch, width: int) -> Tensor:
    """[b, S] per-position values -> [b, T] per response token (positions past S are clamped; mask them)."""
    S = values.shape[1]
    idx = (mb.resp_start.unsqueeze(1) + torch.arange(width, device=values.device).unsqueeze(0)).clamp(max=S - 1)
    return values.gather(1, idx.to(values.device))


def scatter_rows(out: Tensor, mb: MicroBatch, values: Tensor) -> None:
    """Write a micro-batch's [b, T] result into the batch-level [B, T] tensor."""
    out.index_copy_(0, mb.rows.to(out.device), values.to(out.dtype))
