"""Per-token log-prob, entropy and sum of squared probabilities from vocab-parallel logits.

Shape legend: N tokens, Vp = V / tp the local vocabulary shard, starting at global id `vocab_start`.

Under tensor parallelism every TP rank holds logits for its vocabulary shard; the max, the
sum-exp, the target logit and sum(p * z) are reduced across `tp_group`. The reductions use a sum
whose backward is the identity (Megatron's reduce-from-TP-region semantics): every TP rank computes
the same loss from the reduced values, so summing the gradients again would scale them by tp.

Everything is computed in float32 whatever the logits' dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


class _AllReduceSumIdentityGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _tp_sum(x: Tensor, group) -> Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllReduceSumIdentityGrad.apply(x, group)


def logprob_entropy_from_logits(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    tp_group=None,
    vocab_start: int = 0,
    compute_entropy: bool = False,
    compute_sum_sq: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(log p(label), entropy or None, sum_v p_v^2 or None), each [N] float32, differentiable."""
    z = logits.float() / temperature
    with torch.no_grad():
        m = z.max(dim=-1).values
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    z = z - m.unsqueeze(-1)  # a constant shift: log-probs, entropy and probabilities are unchanged
    e = z.exp()
    sum_exp = _tp_sum(e.sum(dim=-1), tp_group)
    lse = sum_exp.log()
    local = labels - vocab_start
    in_shard = (local >= 0) & (local < z.shape[-1])
    target = z.gather(-1, local.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * in_shard
    logp = _tp_sum(target, tp_group) - lse
    entropy = sum_sq = None
    if compute_entropy or compute_sum_sq:
        p = e / sum_exp.unsqueeze(-1)
        if compute_entropy:
            entropy = lse - _tp_sum((p * z).sum(dim=-1), tp_group)
        if compute_sum_sq:
            sum_sq = _tp_sum((p * p).sum(dim=-1), tp_group)
    return logp, entropy, sum_sq
