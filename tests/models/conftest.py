"""Fixtures for the model tests: a world-1 parallel setup and tiny random HF checkpoints.

The HF models are built from a config with transformers (no hub access), their weights are
redrawn with a larger spread than the default init (std 0.08, norms around 1) so that logits,
routing and log-probs are far from uniform and a wrong mapping shows up.
"""

from __future__ import annotations

import pytest
import torch

VOCAB = 128


def randomize_(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


def hf_configs() -> dict:
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    return {
        "qwen2": transformers.Qwen2Config(num_hidden_layers=2, rope_theta=10000.0,
                                          tie_word_embeddings=False, **common),
        "qwen2_4l": transformers.Qwen2Config(num_hidden_layers=4, rope_theta=10000.0,
                                             tie_word_embeddings=False, **common),
        "qwen2_tied": transformers.Qwen2Config(num_hidden_layers=2, rope_theta=1e6,
                                               tie_word_embeddings=True, **common),
        # head_dim 24 != hidden/heads, layer 1 dense (mlp_only_layers), renormalised top-k.
        "qwen3_moe": transformers.Qwen3MoeConfig(
            num_hidden_layers=3, head_dim=24, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True,
            tie_word_embeddings=False, **common),
        "qwen3_moe_nonorm": transformers.Qwen3MoeConfig(
            num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=False, tie_word_embeddings=False, **common),
    }


def make_hf_model(name: str, out_dir, seed: int = 1):
    """Build, randomize and save the tiny HF model `name`; returns the (fp32, eval) model."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_configs()[name], dtype=torch.float32)
    randomize_(model, seed)
    model.eval()
    model.save_pretrained(out_dir)
    return model


@pytest.fixture(scope="session")
def pgs():
    """World-1 parallel groups (gloo, CPU layer installed) shared by the in-process tests."""
    from megatron_dapo.parallel import init_parallel

    return init_parallel(backend="gloo")


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """name -> (directory, transformers model) for every tiny HF config."""
    out = {}
    for name in hf_configs():
        d = tmp_path_factory.mktemp(f"hf_{name}")
        out[name] = (str(d), make_hf_model(name, d))
    return out


def sample_tokens(batch: int, seq: int, seed: int = 3, vocab: int = VOCAB):
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(seq).expand(batch, seq)
    return ids, pos
