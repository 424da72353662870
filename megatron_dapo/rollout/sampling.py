"""Sampling math of the local rollout engine (rollout/local_engine.py): one token per row from its
logits, as pure functions on tensors.

Sampling (the pure function `sample_next_tokens`): logits in fp32 divided by the temperature, then
the stop tokens (EOS and stop_token_ids) masked while a row has fewer than
`SamplingParams.min_new_tokens` response tokens (SGLang's min_new_tokens penalty), then top-k, then
top-p filtering, then one uniform draw per row turned into a token by inverse CDF (with
`SamplingParams.seed` set the engine draws row (prompt_id, j)'s uniforms from a generator of its own).
Temperature 0 is greedy (argmax, first index on ties).

What `rollout_log_probs` hold: log softmax(logits / temperature)[token] of the UNFILTERED
tempered distribution, i.e. what the actor recomputes (it applies no top-k / top-p / stop-token mask).
With top_p < 1, top_k > 0 or min_new_tokens > 0 that is not the probability the token was actually drawn with (the same convention as
SGLang and vLLM). Greedy rows (temperature 0) report log softmax(logits)[token], temperature 1.

Shapes: logits [b, V] fp32 (b rows, V the vocabulary, gathered over TP); tokens, log_probs [b].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["filter_logits", "sample_next_tokens"]


def filter_logits(z: Tensor, *, top_k: int, top_p: float) -> Tensor:
    """z [b, V] -> z with the tokens outside top-k, then outside the top-p nucleus, set to -inf.

    top_k = -1 keeps all (ties with the k-th value are kept). top_p keeps the smallest set of most
    likely tokens whose probability reaches top_p: a token is removed when the probability of the
    tokens before it (sorted descending) already exceeds top_p, so the most likely one always stays.
    """
    V = z.shape[-1]
    if top_k != -1 and top_k < V:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = sorted_z.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs
        remove = torch.zeros_like(z, dtype=torch.bool).scatter(-1, order, before > top_p)
        z = z.masked_fill(remove, float("-inf"))
    return z


def sample_next_tokens(logits: Tensor, *, temperature: float, top_k: int = -1, top_p: float = 1.0,
                       generators: Sequence[torch.Generator] | None = None,
                       uniforms: Tensor | None = None, banned_ids: Tensor | None = None,
                       banned_rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One token per row: logits [b, V] -> (tokens [b] int64, log_probs [b] fp32).

    temperature 0: argmax, log-prob under softmax(logits). Otherwise a draw from
    softmax(filter_logits(logits / temperature)) by inverse CDF on one uniform per row: uniforms[i]
    when given ([b], drawn by the caller), else the next draw of generators[i] for row i, else
    torch's default generator; the log-prob is that of the unfiltered softmax(logits / temperature)
    (module docstring).

    banned_ids [k] int64: tokens that cannot be drawn (argmax included) in the rows where
    banned_rows [b] bool is set (None: every row), masked before top-k / top-p as SGLang's
    min_new_tokens penalty does; like those filters the mask leaves the reported log-prob alone.
    """
    logits = logits.float()
    if temperature == 0:
        tokens = _ban(logits, banned_ids, banned_rows).argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    z = logits / temperature
    log_probs = torch.log_softmax(z, dim=-1)
    probs = filter_logits(_ban(z, banned_ids, banned_rows), top_k=top_k, top_p=top_p).softmax(dim=-1)
    b, V = probs.shape
    if uniforms is not None:
        if uniforms.shape != (b,):
            raise ValueError(f"sample_next_tokens: uniforms of shape {tuple(uniforms.shape)} for {b} rows")
        u = uniforms.to(probs.device, torch.float32)
    elif generators is None:
        u = torch.rand(b, device=probs.device)
    else:
        if len(generators) != b:
            raise ValueError(f"sample_next_tokens: {len(generators)} generators for {b} rows")
        u = torch.stack([torch.rand((), generator=g, device=probs.device) for g in generators])
    cdf = probs.cumsum(dim=-1)
    # right=True: the first index whose cdf exceeds the draw, so zero-probability (filtered)
    # tokens, whose cdf step is flat, can never be chosen; scaling by cdf[-1] absorbs round-off.
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    tokens = tokens.clamp(max=V - 1)
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)


def _ban(z: Tensor, ids: Tensor | None, rows: Tensor | None) -> Tensor:
    """z [b, V] with z[i, ids] = -inf for the rows i set in rows [b] bool (None: all); z itself when
    nothing is banned."""
    if ids is None or not len(ids):
        return z
    out = z.clone()
    out[:, ids] = float("-inf") if rows is None else out[:, ids].masked_fill(rows[:, None], float("-inf"))
    return out
