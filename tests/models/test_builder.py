"""builder: TransformerConfig for every preset, layer specs, and tiny models built on CPU."""

import dataclasses

import pytest
import torch

from megatron_dapo.models.arch import count_parameters, get_arch
from megatron_dapo.models.builder import (
    TorchNorm,
    build_gpt_model,
    build_transformer_config,
    layer_spec,
)
from megatron_dapo.models.forward import logits_forward

from .conftest import sample_tokens


def test_qwen25_32b_config_builds_without_weights():
    cfg = build_transformer_config(get_arch("qwen2.5-32b"), params_dtype=torch.bfloat16, tp=8, pp=4)
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (64, 5120, 27648)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (40, 8, 128)
    assert cfg.add_qkv_bias and not cfg.add_bias_linear and cfg.gated_linear_unit
    assert cfg.normalization == "RMSNorm" and cfg.layernorm_epsilon == 1e-5
    assert cfg.sequence_parallel and cfg.bf16 and cfg.pipeline_dtype == torch.bfloat16
    assert cfg.hidden_dropout == 0.0 and cfg.attention_dropout == 0.0


def test_qwen3_30b_a3b_config_and_stage_spec_build_without_weights():
    arch = get_arch("qwen3-30b-a3b", mtp_num_layers=1)
    cfg = build_transformer_config(arch, params_dtype=torch.bfloat16, tp=2, pp=4, ep=8, etp=1)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (128, 8, 768)
    assert cfg.qk_layernorm and cfg.kv_channels == 128 and not cfg.add_qkv_bias
    assert cfg.moe_router_pre_softmax is False          # norm_topk_prob: renormalised top-k
    assert cfg.moe_grouped_gemm is False and cfg.moe_token_dispatcher_type == "alltoall"
    assert cfg.sequence_parallel and cfg.mtp_num_layers == 1 and cfg.moe_aux_loss_coeff == 1e-3
    specs = layer_spec(arch, "local", config=cfg, pp_rank=1)
    assert len(specs.decoder.layer_specs) == 12 and specs.mtp is None   # 48 layers / 4 stages


def test_moe_with_tp_requires_sequence_parallel_and_bias_free_linears():
    arch = get_arch("tiny_moe")
    with pytest.raises(ValueError, match="requires sequence_parallel=True"):
        build_transformer_config(arch, tp=2, sequence_parallel=False)
    with pytest.raises(ValueError, match="MoE models need add_bias_linear=False"):
        build_transformer_config(dataclasses.replace(arch, add_bias_linear=True))
    with pytest.raises(ValueError, match="num_moe_experts=4 is not divisible by ep=3"):
        build_transformer_config(arch, ep=3)


def test_interleaved_pipeline_config_disables_batched_p2p():
    # Batched p2p with VPP silently corrupts gradients on gloo (notes, PP section).
    assert build_transformer_config(get_arch("tiny"), pp=2, vpp=2).batch_p2p_comm is False
    assert build_transformer_config(get_arch("tiny"), pp=2).batch_p2p_comm is True


def _spec_classes(spec, seen=None):
    seen = set() if seen is None else seen
    if isinstance(spec, type):
        seen.add(spec)
    elif isinstance(spec, (list, tuple)):
        for s in spec:
            _spec_classes(s, seen)
    elif dataclasses.is_dataclass(spec):
        for f in dataclasses.fields(spec):
            _spec_classes(getattr(spec, f.name), seen)
    return seen


def test_local_spec_replaces_every_norm_with_torchnorm(pgs):   # MTP spec reads parallel_state
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    arch = get_arch("tiny_moe", mtp_num_layers=1)
    cfg = build_transformer_config(arch, tp=2)           # sequence parallel on
    specs = layer_spec(arch, "local", config=cfg)
    classes = _spec_classes(specs.decoder) | _spec_classes(specs.mtp)
    assert TorchNorm in classes and WrappedTorchNorm not in classes
    norm = TorchNorm(cfg, 16, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True


@pytest.mark.parametrize("name,mtp", [("tiny", 0), ("tiny_moe", 0), ("tiny", 1), ("tiny_moe", 1)])
def test_tiny_models_build_forward_and_match_analytical_size(pgs, name, mtp):
    arch = get_arch(name, mtp_num_layers=mtp)
    model = build_gpt_model(arch, pgs=pgs, seed=7)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(arch)["total"]
    ids, pos = sample_tokens(2, 16, vocab=arch.vocab_size)
    logits = logits_forward(model, ids, pos)
    assert logits.shape == (2, 16, arch.vocab_size) and logits.dtype == torch.float32
    loss = model(ids, pos, labels=ids.roll(-1, 1))          # per-token CE
    assert loss.shape == (2, 16) and torch.isfinite(loss).all()
    loss.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_same_seed_gives_same_weights(pgs):
    arch = get_arch("tiny")
    a, b, c = (build_gpt_model(arch, pgs=pgs, seed=s) for s in (3, 3, 4))
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name


def test_default_attention_mask_is_causal(pgs):
    arch = get_arch("tiny")
    model = build_gpt_model(arch, pgs=pgs, seed=1).eval()
    ids, pos = sample_tokens(2, 12, vocab=arch.vocab_size)
    causal = torch.triu(torch.ones(12, 12, dtype=torch.bool), diagonal=1)[None, None]
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % arch.vocab_size
    with torch.no_grad():
        default = model(ids, pos)
        explicit = model(ids, pos, causal)
        future_changed = model(changed, pos)
    torch.testing.assert_close(default, explicit, rtol=0, atol=0)
    torch.testing.assert_close(future_changed[:, :8], default[:, :8], rtol=0, atol=1e-6)
    assert (future_changed[:, 8:] - default[:, 8:]).abs().max() > 1e-3
