"""The generation's replacements for two pieces of Megatron's attention, installed by the local rollout
engine (rollout/local_engine.py, `LocalEngine._generation_mode`) for one generate call and removed after
it, so the actor's training forward always runs Megatron's own modules.

- `_SdpaCoreAttention`: the local spec's core attention without its K/V copies (each group's K/V read in
  place), for a decode step and for a forward from position 0.
- `_RotatedKeyCache`: the static KV cache holds the keys after their rotary embedding, so a decode step
  rotates its own key only, not the whole cache again.

Each class says why, with the measurements; the engine's docstring (step 2) says when they apply.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor


class _SdpaCoreAttention(torch.nn.Module):
    """Megatron's local DotProductAttention computed without its K/V copies, for the generation only
    (the actor's forward keeps Megatron's module, so training numerics are untouched).

    Why: the local module expands the grouped K/V cache to every head (repeat_interleave, a copy of
    the whole cache per layer and decode step) and runs baddbmm + masked softmax + bmm. Here the
    groups are read in place: by two batched matmuls over [b, groups] with the group's heads as the
    rows of one product for a decode step and for a forward over at most SMALL_KEYS positions, else by
    torch's scaled_dot_product_attention (enable_gqa) in one fused call. The fused CPU kernel's
    per-(row, head) blocks cost more than the arithmetic of a decode step at any context length
    (128 rows, 8 heads / 2 groups of 64, 2 threads: 0.75 / 1.8 / 9.5 / 40.6 ms against 0.30 / 0.88 /
    7.0 / 24.0 ms at 40 / 140 / 500 / 2,000 keys) and of short forwards (1.3-3.6 ms against 0.6-1.0 ms
    for 384 rows, 4 heads / 2 groups, 8-19 keys); a longer forward's [g * sq, sk] scores would grow
    with the square of its length, so it keeps the fused kernel. Only the two shapes the engine
    produces are handled: a decode step (sq = 1 query against every cached key: nothing to mask) and
    a forward from position 0 (sq = sk: causal). Any other call goes to the wrapped module. Local spec
    only (TE's attention is already fused); softmax_type vanilla, no sliding window, dropout off (eval).
    Shapes: query [sq, b, np, hn], key / value [sk, b, ng, hn] -> [sq, b, np * hn].
    """

    SMALL_KEYS = 32

    def __init__(self, core: torch.nn.Module):
        super().__init__()
        self.core = core
        coeff = core.scale_mask_softmax.scale  # apply_query_key_layer_scaling: softmax_scale / coeff
        self.scale = core.softmax_scale * (coeff if coeff is not None else 1.0)

    @staticmethod
    def can_replace(core: Any) -> bool:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        return (type(core) is DotProductAttention and core.config.softmax_type == "vanilla"
                and core.scale_mask_softmax.window_size is None)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: Any = None, attention_bias: Tensor | None = None,
                packed_seq_params: Any = None) -> Tensor:
        sq, sk = query.shape[0], key.shape[0]
        if attention_bias is not None or packed_seq_params is not None or not (sq == 1 or sq == sk):
            return self.core(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                             attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        b, heads, hn = query.shape[1], query.shape[2], query.shape[3]
        if sq == 1 or sk <= self.SMALL_KEYS:
            return self._small(query, key, value)
        out = torch.nn.functional.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
            is_causal=sq > 1, scale=self.scale, enable_gqa=key.shape[2] != heads)  # [b, np, sq, hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)

    def _small(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """The same attention as two matmuls per group: [g * sq, hn] x [hn, sk] scores, where the g heads
        of a group share its keys (no copy of K/V per head), a causal mask when sq = sk > 1."""
        sq, b, heads, hn = query.shape
        sk, groups = key.shape[0], key.shape[2]
        g = heads // groups
        q = query.reshape(sq, b, groups, g, hn).permute(1, 2, 3, 0, 4).reshape(b, groups, g * sq, hn)
        scores = torch.matmul(q, key.permute(1, 2, 3, 0)) * self.scale       # [b, ng, g * sq, sk]
        if sq > 1:
            future = torch.ones(sq, sk, dtype=torch.bool, device=query.device).triu(1)
            scores = scores.view(b, groups, g, sq, sk).masked_fill(future, float("-inf")).view(b, groups, g * sq, sk)
        out = torch.matmul(torch.softmax(scores, dim=-1), value.permute(1, 2, 0, 3))  # [b, ng, g * sq, hn]
        return out.view(b, groups, g, sq, hn).permute(3, 0, 1, 2, 4).reshape(sq, b, heads * hn)


class _RotatedKeyCache:
    """Megatron's `Attention._adjust_key_value_for_inference` for the generation, with the keys cached
    after their rotary embedding instead of before.

    Why: with a static inference context Megatron caches the un-rotated keys and rotates the whole
    cache [0, offset + 1) again in every decode step and layer (attention.py: `k_pos_emb[:sequence_end]`
    then `apply_rotary_pos_emb(key, ...)`), so a decode step's cost grew with the context: at 8
    layers x 128 rows x 2 groups of 64, 8 + 128 tokens, the rotation of the cache took about a third
    of the generation on CPU. Here the new positions' keys are rotated once, by the same Megatron
    function with the same frequencies, mscale and group, before the original method stores them;
    the key rotary it returns is None, so the forward rotates only the query. RoPE acts on each
    position alone, so the cached keys hold what the forward's rotation of the whole cache gives.
    Self-attention with static batching only (the engine's context); anything else passes through.
    """

    def __init__(self, attention: torch.nn.Module):
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
        from megatron.core.transformer.attention import _yarn_get_concentration_factor_from_config

        self.attention, self.original = attention, type(attention)._adjust_key_value_for_inference
        self.rotate = functools.partial(  # the forward's own key rotation (attention.py), fixed per module
            apply_rotary_pos_emb, config=attention.config, cp_group=attention.pg_collection.cp,
            mscale=_yarn_get_concentration_factor_from_config(attention.config))

    @staticmethod
    def can_wrap(attention: Any) -> bool:
        from megatron.core.transformer.attention import SelfAttention

        return (isinstance(attention, SelfAttention) and type(attention)._adjust_key_value_for_inference
                is SelfAttention._adjust_key_value_for_inference and not attention.config.flash_decode)

    def __call__(self, inference_context: Any, query: Tensor, key: Tensor, value: Tensor, rotary_pos_emb: Any,
                 *args: Any, **kwargs: Any) -> tuple:
        a = self.attention
        if (inference_context is None or not inference_context.is_static_batching() or rotary_pos_emb is None
                or rotary_pos_emb[1] is None):
            return self.original(a, inference_context, query, key, value, rotary_pos_emb, *args, **kwargs)
        start = inference_context.sequence_len_offset
        key = self.rotate(key, rotary_pos_emb[1][start:start + key.shape[0]])
        query, key, value, rotary_pos_emb, mask_type, block_table = self.original(
            a, inference_context, query, key, value, rotary_pos_emb, *args, **kwargs)
        return query, key, value, (rotary_pos_emb[0], None), mask_type, block_table
