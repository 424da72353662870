"""bench_weight_sync.py's server-free parts: arguments, the recipe structures' tensor counts (closed form against
the product's own name mapping and a built Megatron model), the fixed-bytes width scaling, the log parsing."""

import importlib.util
import pathlib

import pytest

from megatron_dapo.models.hf import canonical_param_names, hf_sources

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_weight_sync", ROOT / "benchmarks" / "bench_weight_sync.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
VOCAB = 20


def arch(model="qwen3_moe", layers=48, experts=128, moe_ffn=32, dense_ffn=64):
    return bench.bench_arch(model=model, layers=layers, experts=experts, topk=min(8, experts or 8), hidden=64,
                            moe_ffn=moe_ffn, dense_ffn=dense_ffn, vocab_size=VOCAB)


def product_hf_names(a) -> list[str]:
    """The HF names the sync sends, from the product's mapping (models/hf.py)."""
    return [n for name in canonical_param_names(a, include_mtp=False) for n in hf_sources(name)[1]]


def test_recipe_structures_have_the_recipes_tensor_counts():
    moe, dense = arch(), arch("qwen2", layers=64, experts=0, dense_ffn=256)
    assert bench.expert_tensor_count(moe) == 48 * 128 * 3 == 18_432
    assert bench.tensor_count(moe) == 18_867  # + 48 x 9 per-layer tensors + embed, final norm, lm_head
    assert bench.tensor_count(dense) == 771  # 64 x 12 + 3
    for a in (moe, dense, arch(layers=3, experts=8)):
        names = product_hf_names(a)
        assert len(names) == bench.tensor_count(a)
        assert sorted(names) == sorted(n for n, _ in bench.hf_tensor_shapes(a))


def test_closed_form_bytes_equal_the_built_megatron_models_bytes():
    """Sync bytes from the closed form == numel x 4 of the project's Megatron model (no tied weights)."""
    import torch

    from megatron_dapo.models.builder import build_gpt_model_chunks
    from megatron_dapo.parallel import init_parallel

    pgs = init_parallel()
    for a in (arch(layers=2, experts=4, moe_ffn=8), arch("qwen2", layers=2, experts=0, dense_ffn=24)):
        model = build_gpt_model_chunks(a, pgs=pgs, seed=1, params_dtype=torch.float32)[0]
        assert bench.sync_bytes(a) == 4 * sum(p.numel() for p in model.parameters())


def test_expert_sweep_keeps_expert_bytes_and_layer_sweep_keeps_total_bytes():
    args = bench.parse_args(["--sweep"])
    structs = bench.sweep_structures(args)
    moe = [s for s in structs if s["model"] == "qwen3_moe"]
    assert [(s["experts"], s["moe_ffn"]) for s in moe] == [(8, 512), (32, 128), (128, 32)]
    expert_bytes = {s["experts"] * 3 * s["hidden"] * s["moe_ffn"] * 4 * s["layers"] for s in moe}
    assert expert_bytes == {48 * 128 * 3 * 64 * 32 * 4}  # 151 MB of experts at every count
    dense = [bench.bench_arch(**s, vocab_size=bench._vocab_size()) for s in structs if s["model"] == "qwen2"]
    assert [a.num_layers for a in dense] == [16, 32, 64]
    sizes = [bench.sync_bytes(a) for a in dense]
    row = 3 * 64 * 4 * 16  # one unit of ffn width at the fewest layers
    assert max(sizes) - min(sizes) <= row and dense[-1].ffn_hidden_size == 256
    assert [bench.tensor_count(a) for a in dense] == [195, 387, 771]
    with pytest.raises(ValueError):
        bench.expert_ffn_at_fixed_bytes(base_experts=128, base_ffn=32, experts=48 * 7)


def test_arguments_default_to_the_recipe_structure_and_refuse_bad_values():
    a = bench.parse_args([])
    assert (a.model, a.layers, a.experts, a.topk, a.bucket_mb, a.transport) == (
        "qwen3_moe", 48, 128, 8, [512.0, 16.0], ["distributed", "ipc"])
    q = bench.parse_args(["--model", "qwen2"])
    assert (q.layers, q.experts, q.dense_ffn) == (64, 0, 256)
    for bad in (["--syncs", "0"], ["--bucket-mb", "0"], ["--experts", "4", "--topk", "8"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_load_timer_lines_are_read_back():
    text = ("INFO x\nBENCH_LOAD_WEIGHTS cls=Qwen3MoeForCausalLM tensors=393 seconds=0.125000\n"
            "BENCH_LOAD_WEIGHTS cls=Qwen2ForCausalLM tensors=-1 seconds=2.5\n")
    assert bench.load_lines(text) == [(393, 0.125), (-1, 2.5)]
    assert bench.fit_line([1, 2, 3], [3, 5, 7]) == pytest.approx((1.0, 2.0))
