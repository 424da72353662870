"""A tiny Qwen2 checkpoint and its tokenizer, made locally (no hub), for the real SGLang server tests.

The same directories serve the actor (`model.hf_path`, `data.tokenizer`) and the server (`--model-path`,
`--tokenizer-path`). The tokenizer lives in its own directory, `tokenizer/` under the model's: beside a
Qwen2 config.json, transformers' AutoTokenizer would load the model type's class (Qwen2Tokenizer, with
its byte-level pre-tokenizer and an extra <|endoftext|> token) instead of the file as written. It is
the synthetic arithmetic task's character vocabulary (`data.tokenizer.CharTokenizer`: the same ids,
one token per character) as an HF fast tokenizer, so `data.task=arithmetic` trains on it and the
server detokenizes what it generates. Weights are redrawn with a larger spread than the default init
(std 0.08) so that logits and log-probs are far from uniform: a tensor that did not arrive shows up in
the generations.
"""

from __future__ import annotations

import json
import os

import torch

from megatron_dapo.data.tokenizer import CharTokenizer

QWEN2 = dict(vocab_size=CharTokenizer().vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
             tie_word_embeddings=False)


def write_char_tokenizer(directory: str) -> None:
    """The CharTokenizer's vocabulary as an HF fast tokenizer (one token per character, <eos> = 2)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    char = CharTokenizer()
    vocab = {char.decode([i], skip_special_tokens=False): i for i in range(char.vocab_size)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    tok.save_pretrained(directory)


QWEN3_MOE = dict(QWEN2, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0)
"""Qwen3-MoE at the same size: 4 experts, top-2 routing in both layers, QK-norm, no QKV bias."""


def write_tiny_qwen2(directory: str, *, seed: int = 1, **overrides) -> tuple[str, str]:
    """Build, randomize and save a tiny Qwen2ForCausalLM (fp32 safetensors) and the char tokenizer;
    returns (model directory, tokenizer directory)."""
    import transformers

    config = transformers.Qwen2Config(**{**QWEN2, **overrides}, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return _write(directory, transformers.Qwen2ForCausalLM, config, seed)


def write_tiny_qwen3_moe(directory: str, *, seed: int = 1) -> tuple[str, str]:
    """The same for a tiny Qwen3MoeForCausalLM (QWEN3_MOE)."""
    import transformers

    config = transformers.Qwen3MoeConfig(**QWEN3_MOE, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return _write(directory, transformers.Qwen3MoeForCausalLM, config, seed)


def _write(directory: str, model_class, config, seed: int) -> tuple[str, str]:
    os.makedirs(directory, exist_ok=True)
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.08 * torch.randn(p.shape, generator=g))
    model.save_pretrained(directory)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, f)  # no sampling defaults
    tokenizer = os.path.join(directory, "tokenizer")
    write_char_tokenizer(tokenizer)
    return directory, tokenizer
