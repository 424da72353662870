"""Two gloo processes (torchrun): TP=2, EP=2, PP=2 and PP=2 x VPP=2 give the log-probs of
TP=1 / EP=1 / PP=1 and of transformers, and multi-rank HF export reproduces the checkpoint.

One torchrun launch runs every layout (tests/models/_mp_parallel.py); results come back as
safetensors files in tmp_path.
"""

import os
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from megatron_dapo.models.weights import SafetensorsDir

from ._mp_parallel import TEMPERATURE, batch

pytestmark = pytest.mark.multiproc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mp_results(hf_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("mp_out")
    script = os.path.join(os.path.dirname(__file__), "_mp_parallel.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), script,
           "--hf-dense", hf_models["qwen2"][0], "--hf-dense4", hf_models["qwen2_4l"][0],
           "--hf-moe", hf_models["qwen3_moe"][0], "--hf-moe2", hf_models["qwen3_moe_nonorm"][0],
           "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return out


def _load(out, case):
    return [load_file(os.path.join(out, f"{case}.rank{r}.safetensors")) for r in range(2)]


def _hf_logprobs(hf_model, batch_index):
    ids, _, labels = batch(batch_index, 128)
    with torch.no_grad():
        logits = hf_model(ids).logits / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("preset", ["tiny", "tiny_moe"])
def test_tp2_logprobs_equal_tp1_from_the_same_seed(mp_results, preset):
    tp1, tp2 = _load(mp_results, f"random_{preset}_tp1"), _load(mp_results, f"random_{preset}_tp2")
    assert int(tp1[0]["batch"]) == 0 and int(tp1[1]["batch"]) == 1
    for rank in range(2):                              # both TP ranks see batch 0
        assert int(tp2[rank]["batch"]) == 0
        torch.testing.assert_close(tp2[rank]["lp"], tp1[0]["lp"], rtol=0, atol=1e-5)
    assert not torch.allclose(tp1[0]["lp"], tp1[1]["lp"])  # the two batches differ


@pytest.mark.parametrize("case,hf_name", [("hf_dense_tp1", "qwen2"), ("hf_dense_tp2", "qwen2"),
                                          ("hf_moe_tp1", "qwen3_moe"), ("hf_moe_tp2", "qwen3_moe"),
                                          ("hf_moe_ep2", "qwen3_moe")])
def test_tp2_and_ep2_logprobs_equal_transformers(mp_results, hf_models, case, hf_name):
    for result in _load(mp_results, case):
        expected = _hf_logprobs(hf_models[hf_name][1], int(result["batch"]))
        torch.testing.assert_close(result["lp"], expected, rtol=0, atol=1e-4)


def test_ep2_equals_ep1_on_the_moe_model(mp_results):
    ep1, ep2 = _load(mp_results, "hf_moe_tp1"), _load(mp_results, "hf_moe_ep2")
    for rank in range(2):                              # rank r fed batch r in both layouts
        torch.testing.assert_close(ep2[rank]["lp"], ep1[rank]["lp"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("case,hf_name", [("hf_dense_pp2", "qwen2"), ("hf_moe2_pp2", "qwen3_moe_nonorm"),
                                          ("hf_dense4_vpp2", "qwen2_4l")])
def test_pipeline_logprobs_equal_transformers_on_every_rank(mp_results, hf_models, case, hf_name):
    expected = torch.stack([_hf_logprobs(hf_models[hf_name][1], i) for i in range(2)])
    for result in _load(mp_results, case):             # broadcast from the last stage
        torch.testing.assert_close(result["lp"], expected, rtol=0, atol=1e-4)


def test_pp2_equals_pp1(mp_results):
    pp2 = _load(mp_results, "hf_dense_pp2")[0]["lp"]
    pp1 = _load(mp_results, "hf_dense_tp1")                # pp=1, rank r fed batch r
    torch.testing.assert_close(pp2, torch.stack([pp1[0]["lp"], pp1[1]["lp"]]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("export,hf_name", [("export_moe_tp2", "qwen3_moe"), ("export_moe_ep2", "qwen3_moe"),
                                            ("export_dense_pp2", "qwen2")])
def test_multi_rank_hf_export_reproduces_the_checkpoint(mp_results, hf_models, export, hf_name):
    original, written = SafetensorsDir(hf_models[hf_name][0]), SafetensorsDir(str(mp_results / export))
    assert sorted(written.keys()) == sorted(original.keys())
    for key in original.keys():
        assert torch.equal(written.get(key), original.get(key)), key
