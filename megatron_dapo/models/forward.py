"""Forward helpers shared by the actor, the reference model and the rollout.

Shapes: B batch, S sequence, V vocabulary, V/tp the vocab shard of one TP rank, H hidden.
Megatron runs [S, B, H] internally; GPTModel takes input_ids / position_ids [B, S] and returns
logits [B, S, V/tp] (parallel_output=True), or the CE loss [B, S] when labels are given.

- `token_logprobs(model, input_ids, position_ids, labels, *, temperature, attention_mask, pgs)`
  -> [B, S] fp32: log softmax(logits / temperature)[labels], computed vocab-parallel over pgs.tp
  (nothing gathers the [B, S, V] logits). Differentiable. On a pipeline stage that does not
  hold the output layer it returns the stage's output activations (what Megatron's schedules
  send to the next stage), so it can be called as-is from a forward_step function.
- `token_logprobs_and_entropy(...)` -> (logprobs [B, S], entropy [B, S]).
- `logits_forward(model, input_ids, position_ids=None, attention_mask=None)` -> logits
  gathered over TP, [B, S, V]; for tests and sampling.
- `forward_only_logprobs(model_chunks, microbatches, *, pgs, ...)`: the same log-probs through
  Megatron's pipeline schedule (any PP / VPP), broadcast to every pipeline rank.

Masks and positions: attention_mask=None means causal. Megatron's RoPE ignores position_ids
(positions are 0..S-1), so pad sequences on the right; an explicit attention_mask is a bool
[B, 1, S, S] with True = masked (local spec only; the TE spec applies its causal mask).

MTP models: GPTModel.forward fails without labels when mtp_num_layers is set (gpt_model.py:612,
labels.clone() on None), so these helpers pass labels and capture the main head's logits with a
forward hook on the output layer. The MTP losses still reach the gradient through Megatron's
MTPLossAutoScaler on the hidden states.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

__all__ = ["token_logprobs", "token_logprobs_and_entropy", "logits_forward", "main_logits",
           "vocab_parallel_log_probs", "vocab_parallel_entropy", "forward_only_logprobs",
           "Microbatch", "unwrap_model"]


def unwrap_model(model):
    """The GPTModel inside DDP / Float16Module wrappers (they all hold it as `.module`)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _check_tokens(input_ids, position_ids, labels=None) -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
    if position_ids is not None and position_ids.shape[-1] != input_ids.shape[1]:
        raise ValueError(f"position_ids shape {tuple(position_ids.shape)} does not match "
                         f"input_ids [B, S] = {tuple(input_ids.shape)}")
    if labels is not None and labels.shape != input_ids.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal input_ids shape "
                         f"{tuple(input_ids.shape)}")


def main_logits(model, input_ids, position_ids, attention_mask, labels, *, gather: bool,
                mtp_loss_mask=None):
    """Logits of the main LM head, [B, S, V/tp] ([B, S, V] if gather), or the stage output
    [S, B, H] on a pipeline stage without the output layer.

    labels [B, S] are only used by MTP models: Megatron needs them to run the MTP heads, whose
    losses then flow into the gradient through the hidden states; mtp_loss_mask [B, S] picks
    the tokens those losses count (Megatron's default: all). Other models ignore both.
    """
    inner = unwrap_model(model)
    extra = {"runtime_gather_output": True} if gather else {}
    if not inner.post_process:
        return model(input_ids, position_ids, attention_mask)
    if not inner.config.mtp_num_layers:
        return model(input_ids, position_ids, attention_mask, **extra)
    if labels is None:
        raise ValueError("an MTP model needs labels [B, S] to run its forward (gpt_model.py:612)")
    # GPTModel._postprocess runs the output layer once per MTP layer, then once for the main
    # head, so the main logits are call number mtp_num_layers (0-based).
    main_call, calls, captured = inner.config.mtp_num_layers, [0], []

    def hook(module, args, output):
        index, calls[0] = calls[0], calls[0] + 1
        if index == main_call:
            logits, bias = output
            captured.append(logits)
            # Megatron's CE on these logits works in place when they are fp32: hand it a copy.
            return logits.clone(), bias

    handle = inner.output_layer.register_forward_hook(hook)
    try:
        model(input_ids, position_ids, attention_mask, labels=labels, loss_mask=mtp_loss_mask, **extra)
    finally:
        handle.remove()
    if len(captured) != 1 or calls[0] != main_call + 1:
        raise RuntimeError(f"expected {main_call + 1} output-layer calls in an MTP forward, "
                           f"saw {calls[0]}: Megatron's GPTModel._postprocess changed")
    return captured[0].transpose(0, 1)          # [S, B, V/tp] -> [B, S, V/tp]


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def token_logprobs(model, input_ids, position_ids, labels, *, temperature: float = 1.0,
                   attention_mask=None, pgs):
    """Per-token log-probs of `labels` under softmax(logits / temperature): [B, S] fp32."""
    _check_tokens(input_ids, position_ids, labels)
    _check_temperature(temperature)
    logits = main_logits(model, input_ids, position_ids, attention_mask, labels, gather=False)
    if not unwrap_model(model).post_process:
        return logits
    return vocab_parallel_log_probs(logits.float() / temperature, labels, tp_group=pgs.tp)


def token_logprobs_and_entropy(model, input_ids, position_ids, labels, *,
                               temperature: float = 1.0, attention_mask=None, pgs):
    """(log-probs [B, S], entropy of softmax(logits / temperature) [B, S]), both fp32."""
    _check_tokens(input_ids, position_ids, labels)
    _check_temperature(temperature)
    logits = main_logits(model, input_ids, position_ids, attention_mask, labels, gather=False)
    if not unwrap_model(model).post_process:
        raise ValueError("token_logprobs_and_entropy needs the last pipeline stage")
    scaled = logits.float() / temperature
    return (vocab_parallel_log_probs(scaled, labels, tp_group=pgs.tp),
            vocab_parallel_entropy(scaled, tp_group=pgs.tp))


def logits_forward(model, input_ids, position_ids=None, attention_mask=None):
    """Logits gathered over tensor parallelism: [B, S, V] (the model's dtype)."""
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    _check_tokens(input_ids, position_ids)
    if not unwrap_model(model).post_process:
        raise ValueError("logits_forward needs a model that holds the output layer")
    # MTP heads need labels to run; their values do not affect the main logits.
    return main_logits(model, input_ids, position_ids, attention_mask, labels=input_ids,
                        gather=True)


_main_logits = main_logits      # earlier private name, kept for callers that imported it


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _VocabParallelLogProb(torch.autograd.Function):
    """log softmax(logits)[label] with the vocabulary split over `group` (rank r holds ids
    [r * V/tp, (r + 1) * V/tp)). Saves only the softmax for backward, as Megatron's
    vocab_parallel_cross_entropy does, but takes its group as an argument."""

    @staticmethod
    def forward(ctx, logits, labels, group):
        v_local = logits.shape[-1]
        multi = _group_size(group) > 1
        start = dist.get_rank(group) * v_local if multi else 0
        shifted_max = logits.detach().max(dim=-1).values
        if multi:
            dist.all_reduce(shifted_max, op=dist.ReduceOp.MAX, group=group)
        z = logits.float() - shifted_max.unsqueeze(-1)                  # new tensor [.., V/tp]
        local = labels - start
        in_range = (local >= 0) & (local < v_local)
        index = local.clamp(0, v_local - 1).unsqueeze(-1)
        target = z.gather(-1, index).squeeze(-1) * in_range
        z.exp_()
        sum_exp = z.sum(dim=-1)
        if multi:
            dist.all_reduce(target, group=group)
            dist.all_reduce(sum_exp, group=group)
        logp = target - sum_exp.log()
        z.div_(sum_exp.unsqueeze(-1))                                  # softmax, in place
        ctx.save_for_backward(z, index, in_range)
        ctx.in_dtype = logits.dtype
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        # d logp / d z_j = 1[j == label] - softmax_j; reuses the saved softmax buffer.
        softmax, index, in_range = ctx.saved_tensors
        grad = softmax.mul_(-grad_logp.unsqueeze(-1))
        grad.scatter_add_(-1, index, (grad_logp * in_range).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None


def vocab_parallel_log_probs(logits, labels, *, tp_group):
    """logits [..., V/tp] (this rank's vocab shard), labels [...] int64 -> log-probs [...] fp32.

    Backward may run once (it reuses the saved softmax in place, like Megatron's CE).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} differ "
                         "outside the vocab dimension")
    return _VocabParallelLogProb.apply(logits, labels, tp_group)


def vocab_parallel_entropy(logits, *, tp_group):
    """Entropy of softmax(logits) with the vocab split over tp_group: [..., V/tp] -> [...] fp32.

    Plain autograd (keeps a few [..., V/tp] temporaries); megatron_dapo.kernels has the fused one.
    """
    logits = logits.float()
    shifted_max = logits.detach().max(dim=-1).values
    if _group_size(tp_group) > 1:
        dist.all_reduce(shifted_max, op=dist.ReduceOp.MAX, group=tp_group)
    z = logits - shifted_max.unsqueeze(-1)
    e = z.exp()
    # reduce_from_...: all-reduce forward, identity backward (every TP rank holds the same loss).
    sum_exp = reduce_from_tensor_model_parallel_region(e.sum(dim=-1), group=tp_group)
    p = e / sum_exp.unsqueeze(-1)
    expected_z = reduce_from_tensor_model_parallel_region((p * z).sum(dim=-1), group=tp_group)
    return sum_exp.log() - expected_z


class Microbatch(NamedTuple):
    """One microbatch for forward_only_logprobs; tensors [b, S] on the model's device."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None = None


def forward_only_logprobs(model_chunks, microbatches: Sequence[Microbatch], *, pgs,
                          temperature: float = 1.0) -> list[torch.Tensor]:
    """token_logprobs for every microbatch through Megatron's pipeline schedule (no grad).

    model_chunks: a model or the list of this rank's virtual-stage chunks. All microbatches
    must share one [b, S] shape. Returns one [b, S] fp32 tensor per microbatch on every rank
    (broadcast from the last pipeline stage).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.utils import get_model_config

    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    if not microbatches:
        raise ValueError("forward_only_logprobs needs at least one microbatch")
    shape = tuple(microbatches[0].input_ids.shape)
    for i, mb in enumerate(microbatches):
        _check_tokens(mb.input_ids, mb.position_ids, mb.labels)
        if tuple(mb.input_ids.shape) != shape:
            raise ValueError(f"microbatch {i} has shape {tuple(mb.input_ids.shape)}, expected {shape}")
    config = get_model_config(chunks[0])

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        out = token_logprobs(model, mb.input_ids, mb.position_ids, mb.labels,
                             temperature=temperature, attention_mask=mb.attention_mask, pgs=pgs)
        return out, lambda output, non_loss_data=True: output.float()

    iterators = [iter(microbatches) for _ in chunks]
    schedule = get_forward_backward_func(pp_size=pgs.pp_size, vp_size=pgs.vpp_size)
    with torch.no_grad():
        collected = schedule(
            forward_step_func=forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(microbatches),
            seq_length=shape[1], micro_batch_size=shape[0], forward_only=True,
            collect_non_loss_data=True, pg_collection=pgs.collection,
            p2p_communicator=P2PCommunicator(pp_group=pgs.pp, config=config))
    if pgs.pp_size == 1:
        return list(collected)
    device = microbatches[0].input_ids.device
    results = list(collected) if pgs.is_last_pp_stage else \
        [torch.empty(shape, dtype=torch.float32, device=device) for _ in microbatches]
    src = dist.get_global_rank(pgs.pp, pgs.pp_size - 1)
    for t in results:
        dist.broadcast(t, src=src, group=pgs.pp)
    return results
