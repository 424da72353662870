"""HF <-> Megatron: logits equal transformers', exact round trips, config mapping, the CLI."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_dapo.convert import main as convert_main
from megatron_dapo.models.arch import get_arch
from megatron_dapo.models.builder import build_gpt_model
from megatron_dapo.models.forward import token_logprobs
from megatron_dapo.models.hf import (
    arch_from_hf,
    arch_from_hf_config,
    canonical_param_names,
    hf_config_from_arch,
    load_hf_as_mcore,
    load_hf_weights_into,
    save_mcore_as_hf,
    to_hf,
    to_mcore,
)
from megatron_dapo.models.weights import SafetensorsDir, load_mcore_weights

from .conftest import VOCAB, sample_tokens

HF_NAMES = ["qwen2", "qwen2_tied", "qwen3_moe", "qwen3_moe_nonorm"]


def _hf_tensors(d) -> dict:
    src = SafetensorsDir(d)
    return {k: src.get(k) for k in src.keys()}


@pytest.mark.parametrize("name", HF_NAMES)
def test_megatron_logits_equal_transformers_logits(pgs, hf_models, name):
    hf_dir, hf_model = hf_models[name]
    model = load_hf_as_mcore(hf_dir, pgs=pgs)
    ids, pos = sample_tokens(2, 16)
    with torch.no_grad():
        ref = hf_model(ids).logits
        out = model(ids, pos)
        lp = token_logprobs(model, ids, pos, ids.roll(-1, 1), pgs=pgs)
    assert out.shape == (2, 16, VOCAB) and ref.abs().max() > 1.0     # far from uniform
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-4)
    ref_lp = torch.log_softmax(ref, -1).gather(-1, ids.roll(-1, 1).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", HF_NAMES)
def test_save_mcore_as_hf_reproduces_every_hf_tensor_exactly(pgs, hf_models, tmp_path, name):
    hf_dir, _ = hf_models[name]
    model = load_hf_as_mcore(hf_dir, pgs=pgs)
    arch = arch_from_hf(hf_dir)
    with open(os.path.join(hf_dir, "config.json")) as f:
        source_config = json.load(f)
    save_mcore_as_hf(model, str(tmp_path), pgs=pgs, arch=arch, hf_config=source_config)
    original, written = _hf_tensors(hf_dir), _hf_tensors(tmp_path)
    assert sorted(written) == sorted(original)
    for key, tensor in original.items():
        assert torch.equal(written[key], tensor), key
    assert dataclasses.replace(arch_from_hf(str(tmp_path)), name=arch.name) == arch


def test_round_trip_checkpoint_loads_in_transformers_with_equal_logits(pgs, hf_models, tmp_path):
    import transformers

    hf_dir, hf_model = hf_models["qwen3_moe"]
    model = load_hf_as_mcore(hf_dir, pgs=pgs)
    save_mcore_as_hf(model, str(tmp_path), pgs=pgs, arch=arch_from_hf(hf_dir))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids, _ = sample_tokens(1, 12)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf_model(ids).logits, rtol=0, atol=0)


# Published config.json values (Qwen/Qwen2.5-32B and Qwen/Qwen3-30B-A3B on huggingface.co).
QWEN25_32B = {"model_type": "qwen2", "hidden_act": "silu", "hidden_size": 5120,
              "intermediate_size": 27648, "max_position_embeddings": 131072, "num_attention_heads": 40,
              "num_hidden_layers": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
              "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
              "use_sliding_window": False, "vocab_size": 152064}
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "attention_bias": False, "decoder_sparse_step": 1,
                 "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
                 "max_position_embeddings": 40960, "mlp_only_layers": [], "moe_intermediate_size": 768,
                 "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
                 "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
                 "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
                 "router_aux_loss_coef": 0.001, "tie_word_embeddings": False, "vocab_size": 151936}


@pytest.mark.parametrize("config,preset", [(QWEN25_32B, "qwen2.5-32b"), (QWEN3_30B_A3B, "qwen3-30b-a3b")])
def test_published_configs_map_to_the_presets(config, preset):
    arch = arch_from_hf_config(config, name=preset)
    assert arch == get_arch(preset)
    assert arch_from_hf_config(hf_config_from_arch(arch), name=preset) == arch


@pytest.mark.parametrize("config,message", [
    ({**QWEN25_32B, "model_type": "llama"}, "model_type 'llama' is not supported"),
    ({**QWEN25_32B, "rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ({**QWEN25_32B, "use_sliding_window": True}, "use_sliding_window=true is not supported"),
    ({**QWEN25_32B, "hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_unsupported_configs_raise(config, message):
    with pytest.raises(ValueError, match=message):
        arch_from_hf_config(config)


def test_arch_without_a_qwen_counterpart_cannot_be_exported():
    with pytest.raises(ValueError, match="maps to Qwen2, which has QKV bias"):
        hf_config_from_arch(get_arch("tiny", add_qkv_bias=False))


@pytest.mark.parametrize("name,overrides", [("tiny", {}), ("tiny_moe", {"mtp_num_layers": 1}),
                                            ("tiny_moe", {"moe_layer_freq": (1, 0, 0, 1)})])
def test_canonical_names_are_the_world1_model_parameter_names(pgs, name, overrides):
    arch = get_arch(name, **overrides)
    model = build_gpt_model(arch, pgs=pgs, seed=1)
    assert canonical_param_names(arch) == [n for n, _ in model.named_parameters()]


def test_qkv_interleaving_is_per_query_group_and_inverts():
    arch = get_arch("tiny", hidden_size=8, num_attention_heads=4, num_query_groups=2, kv_channels=1,
                    ffn_hidden_size=4)
    q, k, v = torch.arange(4.0)[:, None], 10 + torch.arange(2.0)[:, None], 20 + torch.arange(2.0)[:, None]
    qkv = to_mcore("qkv", [q, k, v], arch)
    assert qkv.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]       # group g: q heads, k_g, v_g
    for got, want in zip(to_hf("qkv", qkv, arch), (q, k, v), strict=True):
        assert torch.equal(got, want)
    gate, up = torch.randn(3, 2), torch.randn(3, 2)
    assert torch.equal(to_mcore("glu", [gate, up], arch), torch.cat([gate, up]))


def test_mtp_model_loads_and_exports_hf_only_when_asked(pgs, hf_models, tmp_path):
    hf_dir, _ = hf_models["qwen3_moe"]
    arch = dataclasses.replace(arch_from_hf(hf_dir), mtp_num_layers=1)
    model = build_gpt_model(arch, pgs=pgs, seed=1)
    with pytest.raises(KeyError, match="no MTP layers .*keep_mtp_init=True"):
        load_hf_weights_into(model, hf_dir, pgs=pgs, arch=arch)
    loaded = load_hf_weights_into([model], hf_dir, pgs=pgs, arch=arch, keep_mtp_init=True)
    assert loaded == canonical_param_names(arch, include_mtp=False)
    with pytest.raises(ValueError, match="no MTP layers; pass drop_mtp=True"):
        save_mcore_as_hf(model, str(tmp_path), pgs=pgs, arch=arch)
    save_mcore_as_hf(model, str(tmp_path), pgs=pgs, arch=arch, drop_mtp=True)
    original, written = _hf_tensors(hf_dir), _hf_tensors(tmp_path)
    assert sorted(written) == sorted(original)
    assert all(torch.equal(written[k], t) for k, t in original.items())


def test_cli_hf_to_mcore_to_hf_round_trip_is_exact(pgs, hf_models, tmp_path):
    hf_dir, hf_model = hf_models["qwen3_moe"]
    mcore, back = str(tmp_path / "mcore"), str(tmp_path / "back")
    assert convert_main(["hf-to-mcore", "--hf", hf_dir, "--out", mcore, "--ep", "2"]) == 0
    assert convert_main(["mcore-to-hf", "--mcore", mcore, "--out", back]) == 0
    original, written = _hf_tensors(hf_dir), _hf_tensors(back)
    assert sorted(written) == sorted(original)
    assert all(torch.equal(written[k], t) for k, t in original.items())
    # the mcore checkpoint itself loads into a Megatron model with HF's logits
    model = build_gpt_model(arch_from_hf(hf_dir), pgs=pgs, init_weights=False, seed=None)
    load_mcore_weights(model, mcore, pgs=pgs)
    ids, pos = sample_tokens(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos), hf_model(ids).logits, rtol=0, atol=1e-4)


def test_cli_reports_bad_layouts_and_incomplete_checkpoints(hf_models, tmp_path, capsys):
    hf_dir, _ = hf_models["qwen2"]
    assert convert_main(["hf-to-mcore", "--hf", hf_dir, "--out", str(tmp_path / "a"), "--tp", "3"]) == 1
    assert "num_attention_heads=4 is not divisible by tp=3" in capsys.readouterr().err
    broken = tmp_path / "broken"
    shutil.copytree(hf_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    assert convert_main(["hf-to-mcore", "--hf", str(broken), "--out", str(tmp_path / "b")]) == 1
    assert "model.layers.1.mlp.up_proj.weight" in capsys.readouterr().err
    assert convert_main(["mcore-to-hf", "--mcore", hf_dir, "--out", str(tmp_path / "c")]) == 1
    assert "is not an mcore checkpoint" in capsys.readouterr().err


def test_load_hf_as_mcore_and_cli_work_in_a_plain_python_process(hf_models, tmp_path):
    hf_dir, hf_model = hf_models["qwen2"]
    ids, pos = sample_tokens(2, 8)
    with torch.no_grad():
        save_file({"ids": ids, "pos": pos.contiguous(), "logits": hf_model(ids).logits},
                  str(tmp_path / "ref.safetensors"))
    script = (
        "import sys, torch\n"
        "from safetensors.torch import load_file\n"
        "from megatron_dapo.models.hf import load_hf_as_mcore\n"
        "ref = load_file(sys.argv[2])\n"
        "model = load_hf_as_mcore(sys.argv[1])\n"
        "with torch.no_grad():\n"
        "    out = model(ref['ids'], ref['pos'])\n"
        "torch.testing.assert_close(out, ref['logits'], rtol=0, atol=1e-4)\n"
        "print('LOGITS_OK', tuple(out.shape))\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}   # the CPU path
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    run = subprocess.run([sys.executable, "-c", script, hf_dir, str(tmp_path / "ref.safetensors")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0 and "LOGITS_OK (2, 8, 128)" in run.stdout, run.stderr[-2000:]
    cli = subprocess.run([sys.executable, "-m", "megatron_dapo.convert", "hf-to-mcore", "--hf", hf_dir,
                          "--out", str(tmp_path / "m")], capture_output=True, text=True, timeout=120, env=env)
    assert cli.returncode == 0 and os.path.exists(tmp_path / "m" / "mcore_checkpoint.json"), cli.stderr
