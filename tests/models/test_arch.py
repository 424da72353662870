"""ModelArch presets, validation and analytical parameter counts (no Megatron import)."""

import dataclasses

import pytest

from megatron_dapo.models.arch import PRESETS, ModelArch, check_layout, count_parameters, get_arch


def test_qwen25_32b_parameter_count_matches_published_total():
    # Qwen2.5-32B: embed + 64 layers + final norm + untied lm_head = 32,763,876,352 (~32.8B).
    counts = count_parameters(get_arch("qwen2.5-32b"))
    assert counts["total"] == 32_763_876_352
    assert abs(counts["total"] - 32.8e9) / 32.8e9 < 0.01
    assert counts["active"] == counts["total"]


def test_qwen3_30b_a3b_total_and_active_match_model_card():
    # Model card: 30.5B total, 3.3B activated, 29.9B non-embedding.
    counts = count_parameters(get_arch("qwen3-30b-a3b"))
    assert abs(counts["total"] - 30.5e9) / 30.5e9 < 0.01
    assert abs(counts["active"] - 3.3e9) / 3.3e9 < 0.02
    assert abs(counts["total"] - counts["embedding"] - 29.9e9) / 29.9e9 < 0.01


def test_tiny_dense_count_by_hand():
    a = get_arch("tiny")   # h=128, 4 heads x 32, 2 groups, ffn 256, vocab 512, qkv bias, untied
    attn = 128 * (128 + 2 * 64) + (128 + 2 * 64) + 128 * 128
    mlp = 128 * 512 + 256 * 128
    per_layer = attn + mlp + 2 * 128
    assert count_parameters(a)["total"] == 4 * per_layer + 2 * 512 * 128 + 128


def test_moe_active_count_uses_topk_experts_only():
    a = get_arch("tiny_moe")
    full = count_parameters(a)
    expert = 128 * 256 + 128 * 128
    assert full["total"] - full["active"] == 4 * (a.num_moe_experts - a.moe_router_topk) * expert


def test_get_arch_overrides_and_rejects_unknown_names():
    assert get_arch("tiny", mtp_num_layers=2).mtp_num_layers == 2
    with pytest.raises(ValueError, match="unknown model preset 'tiny2'"):
        get_arch("tiny2")
    with pytest.raises(ValueError, match=r"unknown ModelArch override\(s\) \['hidden'\]"):
        get_arch("tiny", hidden=3)


@pytest.mark.parametrize("field,value,message", [
    ("num_query_groups", 3, "num_attention_heads=4 is not a multiple of num_query_groups=3"),
    ("hidden_size", 130, "hidden_size=130 is not divisible by num_attention_heads=4"),
    ("num_layers", 0, "num_layers must be a positive int"),
    ("normalization", "BatchNorm", "normalization must be"),
    ("moe_router_topk", 5, "moe_router_topk=5 must be in"),
    ("moe_layer_freq", (1, 0), "moe_layer_freq must hold one 0/1 per layer"),
])
def test_invalid_arch_fields_raise_naming_the_field(field, value, message):
    base = PRESETS["tiny_moe"]
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(base, **{field: value})


def test_to_dict_from_dict_round_trip_and_unknown_keys():
    a = get_arch("tiny_moe", moe_layer_freq=(1, 0, 1, 1))
    assert ModelArch.from_dict(a.to_dict()) == a
    with pytest.raises(ValueError, match=r"unknown ModelArch fields \['bogus'\]"):
        ModelArch.from_dict({**a.to_dict(), "bogus": 1})


def test_moe_layer_pattern_from_frequency():
    assert get_arch("tiny_moe", moe_layer_freq=2).moe_layer_pattern() == (1, 0, 1, 0)
    assert get_arch("tiny").moe_layer_pattern() == (0, 0, 0, 0)


@pytest.mark.parametrize("kwargs,message", [
    ({"tp": 3}, "num_attention_heads=40 is not divisible by tp=3"),
    ({"tp": 16}, "num_attention_heads=40 is not divisible by tp=16"),
    ({"pp": 3}, "num_layers=64 is not divisible by pp\\*vpp=3"),
])
def test_check_layout_names_the_dimension_that_does_not_split(kwargs, message):
    check_layout(get_arch("qwen2.5-32b"), tp=8, pp=4)
    with pytest.raises(ValueError, match=message):
        check_layout(get_arch("qwen2.5-32b"), **kwargs)
    with pytest.raises(ValueError, match="num_moe_experts=128 is not divisible by ep=3"):
        check_layout(get_arch("qwen3-30b-a3b"), ep=3)
