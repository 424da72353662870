"""weights: canonical names (incl. Transformer-Engine spellings), TP split rules, file IO."""

from types import SimpleNamespace

import pytest
import torch

from megatron_dapo.models.weights import (
    SafetensorsDir,
    ShardedSafetensorsWriter,
    _shard,
    _unshard,
    canonical_name,
    partition_dims,
)


def _fake_model(layer_number: int, experts: int, ep: int):
    config = SimpleNamespace(num_moe_experts=experts, expert_model_parallel_size=ep)
    return SimpleNamespace(config=config, decoder=SimpleNamespace(layers=[SimpleNamespace(layer_number=layer_number)]))


@pytest.mark.parametrize("local,ep_rank,expected", [
    ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", 0, "decoder.layers.4.input_layernorm.weight"),
    ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", 0, "decoder.layers.4.pre_mlp_layernorm.weight"),
    ("decoder.layers.0.mlp.experts.linear_fc1.weight3", 1, "decoder.layers.4.mlp.experts.local_experts.7.linear_fc1.weight"),
    ("decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight", 1,
     "decoder.layers.4.mlp.experts.local_experts.6.linear_fc2.weight"),
    ("embedding.word_embeddings.weight", 1, "embedding.word_embeddings.weight"),
    ("mtp.layers.0.transformer_layer.mlp.experts.local_experts.1.linear_fc1.weight", 1,
     "mtp.layers.0.transformer_layer.mlp.experts.local_experts.5.linear_fc1.weight"),
])
def test_canonical_name_uses_global_layer_and_expert_indices(local, ep_rank, expected):
    # layer 0 of this stage is global layer 5 (1-based), 8 experts over EP=2: 4 per rank
    assert canonical_name(_fake_model(5, 8, 2), local, ep_rank=ep_rank) == expected


def test_partition_dims_follow_module_classes_including_te_names():
    def module(cls_name, **params):
        m = type(cls_name, (torch.nn.Module,), {})()
        for name, shape in params.items():
            m.register_parameter(name, torch.nn.Parameter(torch.zeros(shape)))
        return m

    root = torch.nn.Module()
    root.qkv = module("TELayerNormColumnParallelLinear", weight=(4, 2), bias=(4,), layer_norm_weight=(2,))
    root.proj = module("RowParallelLinear", weight=(2, 4), bias=(2,))
    root.experts = module("TERowParallelGroupedLinear", weight0=(2, 4), weight1=(2, 4))
    root.emb = module("VocabParallelEmbedding", weight=(8, 2))
    root.norm = module("RMSNorm", weight=(2,))
    assert partition_dims(root) == {"qkv.weight": 0, "qkv.bias": 0, "proj.weight": 1,
                                    "experts.weight0": 1, "experts.weight1": 1, "emb.weight": 0}


def test_swiglu_fc1_shards_hold_their_gate_and_up_halves():
    full = torch.arange(8.0)[:, None]                  # rows: gate 0..3, up 4..7
    shards = [_shard(full, dim=0, rank=r, size=2, glu=True, name="fc1") for r in range(2)]
    assert shards[0].flatten().tolist() == [0, 1, 4, 5] and shards[1].flatten().tolist() == [2, 3, 6, 7]
    assert torch.equal(_unshard(shards, dim=0, glu=True), full)
    plain = [_shard(full, dim=0, rank=r, size=2, glu=False, name="w") for r in range(2)]
    assert plain[1].flatten().tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="does not split into 3 shards"):
        _shard(full, dim=0, rank=0, size=3, glu=False, name="w")


def test_sharded_writer_splits_files_and_reader_finds_every_tensor(tmp_path):
    writer = ShardedSafetensorsWriter(str(tmp_path), max_shard_bytes=64)
    tensors = {f"t{i}": torch.full((8,), float(i)) for i in range(5)}    # 32 bytes each
    for name, t in tensors.items():
        writer.add(name, t)
    with pytest.raises(ValueError, match="written twice"):
        writer.add("t0", tensors["t0"])
    weight_map = writer.close()
    assert sorted(set(weight_map.values())) == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    reader = SafetensorsDir(str(tmp_path))
    assert all(torch.equal(reader.get(n), t) for n, t in tensors.items())
    with pytest.raises(KeyError, match="'t9' not found"):
        reader.get("t9")
    assert ShardedSafetensorsWriter(str(tmp_path / "empty")).close() == {}
