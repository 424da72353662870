"""The MTP layer under the names SGLang's drafter loads (models/hf.py, module docstring).

The drafter side is tests/standin/draft.py, SGLang's Qwen3MoeForCausalLMMTP rebuilt from its source with
transformers layers: the names it expects are exactly the actor's MTP export, and on those weights it
computes the actor's MTP logits (so the mapping, the concatenation order and which norm is which are
right, not just the bytes). Checkpoints with MTP tensors load them; without, the layers start fresh
and the log names them; a partial MTP layer is an error."""

import dataclasses
import logging
import shutil

import pytest
import torch
from safetensors.torch import save_file

from megatron_dapo.models.builder import build_gpt_model
from megatron_dapo.models.hf import (
    arch_from_hf,
    canonical_param_names,
    hf_sources,
    iter_hf_tensors,
    load_hf_weights_into,
    mtp_hf_names,
)
from tests.standin.draft import DraftModel, drafter_for

from .conftest import sample_tokens

# fp32, the same process, different kernels (Megatron local spec vs transformers): round-off of the
# attention / MoE sums over 64-wide rows, ~1e-6; 1e-4 leaves room without hiding a wrong tensor
# (a swapped norm or concatenation order moves logits by ~1e-1 at these weight scales).
ATOL = 1e-4


def _mtp_model(hf_dir, pgs, seed=1):
    arch = dataclasses.replace(arch_from_hf(hf_dir), mtp_num_layers=1)
    model = build_gpt_model(arch, pgs=pgs, seed=seed)
    load_hf_weights_into(model, hf_dir, pgs=pgs, arch=arch, keep_mtp_init=True)
    g = torch.Generator().manual_seed(seed + 10)
    with torch.no_grad():  # far from Megatron's small init, so every MTP tensor matters to the logits
        for name, p in model.named_parameters():
            if name.startswith("mtp."):
                p.copy_((1.0 + 0.2 * torch.randn(p.shape, generator=g)) if "norm" in name
                        else 0.1 * torch.randn(p.shape, generator=g))
    return arch, model.eval()


def _mtp_export(model, pgs, arch) -> dict[str, torch.Tensor]:
    return {n: t for n, t in iter_hf_tensors(model, pgs=pgs, arch=arch, drop_mtp=False) if n.startswith("mtp.")}


def test_the_mtp_export_is_exactly_what_sglangs_qwen3_moe_drafter_loads(pgs, hf_models):
    hf_dir, hf_model = hf_models["qwen3_moe"]
    arch, model = _mtp_model(hf_dir, pgs)
    exported = _mtp_export(model, pgs, arch)
    draft = DraftModel(hf_model.config)
    assert sorted(exported) == sorted(mtp_hf_names(arch)) == sorted(draft.expected_names())
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
            "mtp.layers.0.mlp.experts.3.down_proj.weight", "mtp.layers.0.self_attn.qkv_proj.weight"} - set(exported) \
        == {"mtp.layers.0.self_attn.qkv_proj.weight"}  # SGLang fuses q/k/v itself: the checkpoint keeps q/k/v_proj
    assert draft.check(exported) is None  # every shape as the drafter builds it
    assert exported["mtp.fc.weight"].shape == (arch.hidden_size, 2 * arch.hidden_size)


def test_sglangs_drafter_on_the_exported_weights_computes_the_actors_mtp_logits(pgs, hf_models):
    hf_dir, hf_model = hf_models["qwen3_moe"]
    arch, model = _mtp_model(hf_dir, pgs)
    ids, pos = sample_tokens(1, 12)
    calls = []  # Megatron runs the output layer on the MTP hidden states first, then on the trunk's
    handle = model.output_layer.register_forward_hook(lambda m, a, out: calls.append(out[0].detach().clone()))
    with torch.no_grad():
        model(ids, pos, None, labels=ids)
    handle.remove()
    mtp_logits = calls[0].transpose(0, 1)[0, :-1]   # [S-1, V]: position t predicts token t + 2
    draft = DraftModel(hf_model.config)
    draft.load(_mtp_export(model, pgs, arch))
    with torch.no_grad():
        trunk = hf_model.model(ids).last_hidden_state[0]          # [S, H], after the final norm
        nxt = hf_model.model.embed_tokens(ids[0, 1:])             # embedding of token t + 1
        got = hf_model.lm_head(draft.hidden(nxt, trunk[:-1]))     # the target's shared LM head
    assert torch.allclose(got, mtp_logits, atol=ATOL), (got - mtp_logits).abs().max()
    # The drafter's hidden path is really exercised: the main logits differ from the MTP ones.
    assert (calls[1].transpose(0, 1)[0, :-1] - mtp_logits).abs().max() > 0.1


def test_sglang_has_the_qwen3_moe_drafter_from_0_5_13_only(hf_models):
    config = hf_models["qwen3_moe"][1].config
    assert drafter_for(config, "0.5.12") is None and isinstance(drafter_for(config, "0.5.13"), DraftModel)
    assert drafter_for(hf_models["qwen2"][1].config, "0.5.23") is None


def test_a_second_mtp_layer_has_no_hf_name(hf_models):
    arch = dataclasses.replace(arch_from_hf(hf_models["qwen3_moe"][0]), mtp_num_layers=2)
    second = [n for n in canonical_param_names(arch) if n.startswith("mtp.layers.1.")]
    with pytest.raises(ValueError, match=r"holds 1 MTP layer \(model.mtp_num_layers=1\)"):
        hf_sources(second[0])


def test_mtp_layers_load_from_a_checkpoint_that_has_them_and_start_fresh_otherwise(pgs, hf_models, tmp_path,
                                                                                   caplog):
    hf_dir, _ = hf_models["qwen3_moe"]
    arch, trained = _mtp_model(hf_dir, pgs, seed=1)
    exported = _mtp_export(trained, pgs, arch)
    with_mtp = tmp_path / "with_mtp"
    shutil.copytree(hf_dir, with_mtp)
    save_file({k: v.contiguous() for k, v in exported.items()}, str(with_mtp / "mtp.safetensors"))

    fresh = build_gpt_model(arch, pgs=pgs, seed=2)
    with caplog.at_level(logging.INFO, logger="megatron_dapo.models.hf"):
        loaded = load_hf_weights_into(fresh, str(with_mtp), pgs=pgs, arch=arch, keep_mtp_init=True)
    assert loaded == canonical_param_names(arch) and "fresh drafter" not in caplog.text
    assert _mtp_export(fresh, pgs, arch).keys() == exported.keys()
    assert all(torch.equal(t, exported[n]) for n, t in _mtp_export(fresh, pgs, arch).items())

    caplog.clear()
    before = {n: p.detach().clone() for n, p in build_gpt_model(arch, pgs=pgs, seed=3).named_parameters()}
    again = build_gpt_model(arch, pgs=pgs, seed=3)
    with caplog.at_level(logging.INFO, logger="megatron_dapo.models.hf"):
        loaded = load_hf_weights_into(again, hf_dir, pgs=pgs, arch=arch, keep_mtp_init=True)
    assert loaded == canonical_param_names(arch, include_mtp=False)
    assert "MTP layer(s) mtp.layers.0" in caplog.text and "fresh drafter" in caplog.text
    assert all(torch.equal(p, before[n]) for n, p in again.named_parameters() if n.startswith("mtp."))

    partial = tmp_path / "partial"
    shutil.copytree(hf_dir, partial)
    save_file({"mtp.fc.weight": exported["mtp.fc.weight"].contiguous()}, str(partial / "mtp.safetensors"))
    with pytest.raises(KeyError, match=r"MTP layer 0 is incomplete: \d+ of \d+ tensors missing"):
        load_hf_weights_into(again, str(partial), pgs=pgs, arch=arch, keep_mtp_init=True)
