"""weights: canonical names (incl. Transformer-Engine spellings), TP split rules, file IO."""

import os
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
from tests.standin import free_port


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
    umask = os.umask(0o022)  # the files follow the umask like any other (safetensors alone makes them 0600)
    try:
        assert {oct(os.stat(tmp_path / f).st_mode & 0o777) for f in set(weight_map.values())} == {"0o644"}
        os.umask(0o027)
        writer = ShardedSafetensorsWriter(str(tmp_path / "group"))
        writer.add("t", tensors["t0"])
        assert oct(os.stat(tmp_path / "group" / writer.close()["t"]).st_mode & 0o777) == "0o640"
    finally:
        os.umask(umask)


# ---- the weight sync's gathers on 4 gloo processes -----------------------------------------------------
STAGE_LAYOUTS = {"tp2_pp2": "tiny", "tp2_ep2_etp1": "tiny_moe", "pp2_ep2": "tiny_moe", "pp2_dp2_vpp2": "tiny"}


def _run_stage_state(tmp_path, layouts):
    import json
    import os
    import pathlib
    import subprocess
    import sys

    from megatron_dapo.models.arch import get_arch
    from megatron_dapo.models.builder import build_gpt_model
    from megatron_dapo.models.weights import gather_canonical_state
    from megatron_dapo.parallel import init_parallel

    root = pathlib.Path(__file__).resolve().parents[2]
    pgs = init_parallel()
    canon = {}
    for preset in sorted(set(STAGE_LAYOUTS[n] for n in layouts)):
        model = build_gpt_model(get_arch(preset), pgs=pgs, seed=11)
        canon[preset] = {n: t.clone() for n, t, _ in gather_canonical_state(model, pgs=pgs)}
        torch.save(canon[preset], tmp_path / f"canonical_{preset}.pt")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(root / "tests/models/_mp_stage_state.py"),
           str(tmp_path), *layouts]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name in layouts:
        ranks = [json.loads((tmp_path / f"{name}.rank{k}.json").read_text()) for k in range(4)]
        union = {}
        for stage in sorted({rk["stage"] for rk in ranks}):
            part = torch.load(tmp_path / f"{name}.stage{stage}.pt", weights_only=True)
            assert not set(part) & set(union), name  # each tensor comes from exactly one stage's sender
            union.update(part)
            # every rank of the stage saw the same names and sizes: they cut the same buckets
            seqs = [rk["seen"] for rk in ranks if rk["stage"] == stage]
            assert all(s == seqs[0] for s in seqs), (name, stage)
            assert [n for n, _ in seqs[0]] == list(part), (name, stage)
            assert [b for _, b in seqs[0]] == [part[n].numel() * part[n].element_size() for n in part], name
        want = canon[STAGE_LAYOUTS[name]]
        assert sorted(union) == sorted(want), (name, sorted(set(want) ^ set(union))[:5])
        for n, t in want.items():  # pure data movement: bit for bit
            assert torch.equal(union[n], t), (name, n)
        yield name, ranks


@pytest.mark.multiproc
def test_every_stage_sender_gets_every_tensor_of_its_stage_tp2_pp2_and_tp2_ep2(tmp_path):
    """TP2 x PP2 (dense) and TP2 x EP2 with expert-TP 1 (MoE): the senders' union is the whole model,
    all experts included, equal to the world-1 weights; only senders receive (TP / EP gathers)."""
    for name, ranks in _run_stage_state(tmp_path, ["tp2_pp2", "tp2_ep2_etp1"]):
        senders = [rk for rk in ranks if rk["sender"]]
        assert all(rk["traffic"].get("received", 0) > 0 for rk in senders), name
        assert all(rk["traffic"].get("received", 0) == 0 for rk in ranks if not rk["sender"]), name


@pytest.mark.slow
@pytest.mark.multiproc
def test_every_stage_sender_gets_every_tensor_pp2_ep2_and_pp2_dp2_vpp2(tmp_path):
    for name, ranks in _run_stage_state(tmp_path, ["pp2_ep2", "pp2_dp2_vpp2"]):
        if name == "pp2_dp2_vpp2":  # DP replicas take no part in the gathers
            assert all(not rk["traffic"] for rk in ranks), name
