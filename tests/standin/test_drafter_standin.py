"""The stand-in's speculative draft runner, per release: which updates reach it (before 0.5.21 a distributed
update loads the target only, a tensor update the drafter and the target; 0.5.21+ the selector), which
names each runner keeps (the Qwen3-MoE target skips `mtp.*`, its drafter keeps only those), and launches
SGLang would not serve with an MTP drafter."""

import re
import subprocess

import pytest
import torch
import torch.multiprocessing as tmp

from megatron_dapo.rollout.sglang.engine import EngineRequestError, SGLangEngine
from tests.models.conftest import make_hf_model
from tests.standin import LAUNCHER, StandinServer, expected_checksums, free_port

NAMED = [("model.norm.weight", torch.full((64,), 2.0)), ("mtp.fc.weight", torch.ones(64, 128))]


@pytest.fixture
def file_system_sharing():
    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    yield
    tmp.set_sharing_strategy(before)


@pytest.mark.parametrize("version", ["0.5.20", "0.5.23"])
def test_a_distributed_update_reaches_the_toy_drafter_only_from_0_5_21(tmp_path, version):
    named = [("a", torch.arange(4.0)), ("b", torch.ones(2, 3))]
    with StandinServer(toy=True, emulate_version=version, args=["--speculative-algorithm", "NEXTN"],
                       log_dir=tmp_path) as s, SGLangEngine([s.url]) as eng:
        eng.init_weights_update_group(master_address="127.0.0.1", master_port=free_port(), backend="gloo",
                                      group_name="g", timeout_s=60)
        eng.update_weights_from_distributed(named, bucket_mb=1, policy_version=1)
        eng.destroy_weights_update_group()
        assert s.checksums() == [expected_checksums(named)]
        assert s.checksums(role="draft") == ([expected_checksums(named)] if version == "0.5.23" else [{}])


def test_a_tensor_update_reaches_the_drafter_before_0_5_21_unless_disabled(tmp_path, file_system_sharing):
    import requests

    from megatron_dapo.rollout.sglang import weights as sw

    named = [("a", torch.arange(4.0))]
    with StandinServer(toy=True, emulate_version="0.5.20", args=["--speculative-algorithm", "NEXTN"],
                       log_dir=tmp_path) as s, SGLangEngine([s.url]) as eng:
        eng.update_weights(named, policy_version=1, bucket_mb=1)
        assert s.checksums() == s.checksums(role="draft") == [expected_checksums(named)]
        body = sw.tensor_update_payload([sw.serialize_named_tensors([("b", torch.ones(2))])], flush_cache=False,
                                        weight_version=None)
        assert requests.post(s.url + "/update_weights_from_tensor", json={**body, "disable_draft_model": True},
                             timeout=30).status_code == 200
        assert "b" in s.checksums()[0] and "b" not in s.checksums(role="draft")[0]


def test_the_qwen3_moe_target_skips_mtp_names_and_its_drafter_keeps_only_them(tmp_path, file_system_sharing):
    hf = tmp_path / "moe"
    make_hf_model("qwen3_moe", hf)
    args = ["--speculative-algorithm", "NEXTN", "--speculative-draft-model-path", str(hf)]
    with StandinServer(model_path=str(hf), emulate_version="0.5.20", args=args, log_dir=tmp_path) as s, \
            SGLangEngine([s.url]) as eng:
        eng.update_weights(NAMED, policy_version=1, bucket_mb=1)
        assert s.checksums() == [expected_checksums(NAMED[:1])]
        assert s.checksums(role="draft") == [expected_checksums(NAMED[1:])]
        with pytest.raises(EngineRequestError, match=r"unknown parameter 'mtp\.layers\.1\.mlp\.gate\.weight' \(not "
                                                     r"a tensor of this Qwen3MoeForCausalLMMTP drafter\)"):
            eng.update_weights([("mtp.layers.1.mlp.gate.weight", torch.ones(4, 64))], policy_version=2, bucket_mb=1)


@pytest.mark.parametrize("version, model, flags, message", [
    ("0.5.12", "qwen3_moe", True, "SGLang 0.5.12 has no MTP drafter for \\['Qwen3MoeForCausalLM'\\]"),
    ("0.5.23", "qwen2", True, "SGLang 0.5.23 has no MTP drafter for \\['Qwen2ForCausalLM'\\]"),
    ("0.5.23", "qwen3_moe", False, "without --speculative-draft-model-path"),
])
def test_speculation_sglang_cannot_serve_from_the_mtp_layer_fails_at_load(tmp_path, version, model, flags, message):
    hf = tmp_path / model
    make_hf_model(model, hf)
    args = ["--speculative-algorithm", "NEXTN"] + (["--speculative-draft-model-path", str(hf)] if flags else [])
    srv = StandinServer(model_path=str(hf), emulate_version=version, args=args, log_dir=tmp_path)
    proc = subprocess.run([*srv.command(LAUNCHER)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Scheduler hit an exception" in proc.stderr
    assert re.search(message, proc.stderr), proc.stderr[-2000:]
