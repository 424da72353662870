"""Megatron's GPU fusions (models/fusions.py): on with Transformer Engine, off on the local spec, each
model.* key honoured, impossible requests refused naming the key, and the resolved values reach the
real TransformerConfig (through build_transformer_config and the actor's build)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.models.arch import get_arch
from megatron_dapo.models.fusions import FUSIONS, resolve_fusions

TINY = get_arch("tiny", vocab_size=18)


def test_on_with_te_off_on_the_local_spec():
    assert resolve_fusions("te", arch=TINY, main_grad=True) == dict.fromkeys(FUSIONS, True)
    assert resolve_fusions("local", arch=TINY, main_grad=True) == dict.fromkeys(FUSIONS, False)
    # A bare model (no DDP main_grad) keeps gradient_accumulation_fusion off even with TE.
    bare = resolve_fusions("te", arch=TINY)
    assert bare == {**dict.fromkeys(FUSIONS, True), "gradient_accumulation_fusion": False}


def test_user_values_win_over_the_backend_default():
    assert resolve_fusions("te", arch=TINY, main_grad=True, apply_rope_fusion=False, masked_softmax_fusion=False) \
        == {**dict.fromkeys(FUSIONS, True), "apply_rope_fusion": False, "masked_softmax_fusion": False}
    assert resolve_fusions("local", arch=TINY, bias_activation_fusion=True, bias_dropout_fusion=True,
                           masked_softmax_fusion=True) == {
        **dict.fromkeys(FUSIONS, False), "bias_activation_fusion": True, "bias_dropout_fusion": True,
        "masked_softmax_fusion": True}


def test_gelu_without_bias_keeps_the_activation_unfused():
    gelu = dataclasses.replace(TINY, swiglu=False, add_bias_linear=False)
    assert resolve_fusions("te", arch=gelu, main_grad=True)["bias_activation_fusion"] is False
    with pytest.raises(ConfigError, match="model.bias_activation_fusion: .*GeLU without a bias"):
        resolve_fusions("te", arch=gelu, bias_activation_fusion=True)


@pytest.mark.parametrize("kwargs, key, message", [
    ({"apply_rope_fusion": True}, "model.apply_rope_fusion", "needs Transformer Engine's fused RoPE"),
    ({"gradient_accumulation_fusion": True}, "model.gradient_accumulation_fusion", "needs Transformer Engine"),
    ({"bias_activation_fusion": True, "device_type": "cpu"}, "model.bias_activation_fusion", "torch.compile"),
    ({"bias_dropout_fusion": True, "device_type": "cpu"}, "model.bias_dropout_fusion", "torch.compile"),
])
def test_a_fusion_the_local_spec_cannot_run_is_refused_naming_the_key(kwargs, key, message):
    with pytest.raises(ConfigError, match=message) as err:
        resolve_fusions("local", arch=TINY, main_grad=True, **kwargs)
    assert err.value.key == key


def test_gradient_accumulation_fusion_needs_main_grad():
    with pytest.raises(ConfigError, match="main_grad") as err:
        resolve_fusions("te", arch=TINY, gradient_accumulation_fusion=True)
    assert err.value.key == "model.gradient_accumulation_fusion"


def test_te_values_reach_the_transformer_config():
    """build_transformer_config with backend="te" (a CPU config object; no TE kernel runs): the TE defaults,
    then the actor's overrides. apply_rope_fusion is off here only because TransformerConfig checks that
    TE's fused RoPE imports, which it cannot on this machine."""
    from megatron_dapo.models.builder import build_transformer_config

    bare = build_transformer_config(TINY, backend="te", device="cpu",
                                    overrides={"apply_rope_fusion": False})
    assert (bare.gradient_accumulation_fusion, bare.bias_activation_fusion, bare.bias_dropout_fusion,
            bare.masked_softmax_fusion) == (False, True, True, True)
    overrides = resolve_fusions("te", arch=TINY, main_grad=True, apply_rope_fusion=False, bias_dropout_fusion=False)
    trained = build_transformer_config(TINY, backend="te", device="cpu", overrides=overrides)
    assert {name: getattr(trained, name) for name in FUSIONS} == overrides
    local = build_transformer_config(TINY, backend="local", device="cpu")
    assert {name: getattr(local, name) for name in FUSIONS} == dict.fromkeys(FUSIONS, False)


def test_the_actor_applies_the_model_keys(tmp_path):
    """Through workers/build.py on CPU (the local spec): defaults off, a key set to true reaches every chunk's
    config, and an impossible one stops the build naming the key."""
    from megatron_dapo.models.config_arch import model_arch
    from megatron_dapo.parallel import init_parallel
    from megatron_dapo.workers.build import build_model_chunks

    pgs = init_parallel(backend="gloo")
    for overrides, expected in (([], dict.fromkeys(FUSIONS, False)),
                                (["model.masked_softmax_fusion=true"],
                                 {**dict.fromkeys(FUSIONS, False), "masked_softmax_fusion": True})):
        cfg = load_config("configs/tiny_cpu.yaml", overrides)
        (chunk,) = build_model_chunks(cfg, model_arch(cfg, vocab_size=18), pgs, seed=1)
        assert {name: getattr(chunk.config, name) for name in FUSIONS} == expected
    cfg = load_config("configs/tiny_cpu.yaml", ["model.apply_rope_fusion=true"])
    with pytest.raises(ConfigError, match="model.apply_rope_fusion: needs Transformer Engine"):
        build_model_chunks(cfg, model_arch(cfg, vocab_size=18), pgs, seed=1)


def test_the_keys_are_typed_config_fields():
    with pytest.raises(ConfigError, match="model.apply_rope_fusion: expected bool or null, got 1"):
        load_config(None, ["model.apply_rope_fusion=1"])
    assert load_config(None, ["model.bias_dropout_fusion=false"]).model.bias_dropout_fusion is False
