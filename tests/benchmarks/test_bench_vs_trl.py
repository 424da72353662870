"""The compute figures of benchmarks/bench_vs_trl.py: the FLOP count per token must be the model's."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_vs_trl", ROOT / "benchmarks" / "bench_vs_trl.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("workload, dims", [
    ("toy", (4, 256, 768, 4, 2)),
    ("long", (8, 512, 1536, 8, 2)),
])
def test_linear_params_count_every_matmul_weight_of_the_benchmark_model(workload, dims):
    """_linear_params (the FLOP count's base) and the floor's GEMM shapes == the 2-D weights of the
    Megatron model the bench trains, embedding excluded (a lookup, no FLOPs)."""
    from megatron_dapo.config import load_config
    from megatron_dapo.models.builder import build_gpt_model
    from megatron_dapo.models.config_arch import model_arch
    from megatron_dapo.parallel import init_parallel

    bench = _bench()
    cfg = load_config(str(ROOT / "configs" / "tiny_cpu.yaml"), bench.WORKLOADS[workload])
    vocab = 18
    arch = model_arch(cfg, vocab_size=vocab)
    model = build_gpt_model(arch, pgs=init_parallel())
    weights = sum(p.numel() for name, p in model.named_parameters()
                  if p.dim() == 2 and "embedding" not in name)
    m = {k: getattr(arch, k) for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                       "num_query_groups")}
    assert tuple(m.values()) == dims
    assert bench._linear_params(m, vocab) == weights
    assert sum(k * n * c for k, n, c in bench._linear_shapes(m, vocab)) == weights
    if workload == "long":  # the "about 25M parameters", and responses of exactly 128 tokens
        assert 24e6 < weights < 26e6
        assert cfg.rollout.min_new_tokens == cfg.data.max_response_length == 128
