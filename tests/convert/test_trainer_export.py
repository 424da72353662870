"""`python -m megatron_dapo.convert mcore-to-hf --mcore runs/<exp>/ckpt/global_step_<k>`: a trainer checkpoint
written by 4 gloo ranks (dense tiny at TP=2 x PP=2; tiny MoE at TP=2 x EP=2, slow) exports to an HF
directory whose transformers logits give the trainer's own log-probs on a probe; `megatron_dapo.eval`
reads the checkpoint and the export alike."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_dapo import convert
from megatron_dapo import eval as evaluate

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multiproc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_checkpoint(case: str, out: Path) -> Path:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           str(REPO / "tests" / "convert" / "_mp_write_ckpt.py"), "--case", case, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return _write_checkpoint("dense", tmp_path_factory.mktemp("dense"))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return _write_checkpoint("moe", tmp_path_factory.mktemp("moe"))


def _export(src: Path, out: Path, capsys) -> None:
    assert convert.main(["mcore-to-hf", "--mcore", str(src), "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out


def _hf_log_probs(hf_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """[V, B, S] log softmax of transformers' logits, laid out like the probe's reference."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids).logits.float()
    return torch.log_softmax(logits, dim=-1).permute(2, 0, 1)


def _check_export_matches_trainer(root: Path, hf: Path, model_type: str) -> None:
    probe = load_file(root / "probe.safetensors")
    config = json.loads((hf / "config.json").read_text())
    assert config["model_type"] == model_type and config["vocab_size"] == probe["log_probs"].shape[0]
    # fp32 on both sides; only the summation order differs (TP-split matmuls and all-reduces, Megatron's
    # vocab-parallel log-softmax vs transformers' dense one): 1.2e-6 seen, 10x margin.
    torch.testing.assert_close(_hf_log_probs(hf, probe["input_ids"]), probe["log_probs"], atol=1e-5, rtol=0)


def test_dense_tp2_pp2_checkpoint_exports_to_hf_with_the_trainers_logits(dense, tmp_path, capsys):
    _export(dense / "runs/exp/ckpt/global_step_3", tmp_path / "hf", capsys)
    _check_export_matches_trainer(dense, tmp_path / "hf", "qwen2")
    # The ckpt/ root exports its latest step: the same tensors.
    _export(dense / "runs/exp/ckpt", tmp_path / "hf_latest", capsys)
    a, b = load_file(tmp_path / "hf/model.safetensors"), load_file(tmp_path / "hf_latest/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _eval(model: str, capsys, *extra: str) -> dict:
    assert evaluate.main(["--model", model, "--data", "arithmetic", "--n", "1", "--max-tokens", "4",
                          "--temperature", "0", *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_reads_the_trainer_checkpoint_and_its_export_alike(dense, tmp_path, capsys):
    _export(dense / "runs/exp/ckpt/global_step_3", tmp_path / "hf", capsys)
    # the same engine batch for both (a checkpoint's default is its run's rollout.max_num_seqs)
    from_ckpt = _eval(str(dense / "runs/exp/ckpt/global_step_3"), capsys, "--max-batch-size", "64")
    from_hf = _eval(str(tmp_path / "hf"), capsys, "--tokenizer", "builtin:char")
    # Greedy decoding of the same fp32 weights in the same engine: the same answers.
    assert from_ckpt == from_hf and from_ckpt["num_prompts"] == 128.0


class _Payload:
    """Unpickling this runs `open(<path>, "w")`: what a crafted `.metadata` could do."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("given", ["step", "root"])
def test_a_tampered_checkpoint_is_refused_before_anything_in_it_is_unpickled(dense, tmp_path, capsys, given):
    """torch's distributed checkpoint reads model/.metadata with pickle: export (and eval, through the same
    loader) check the manifest first, so a replaced .metadata is named and never unpickled."""
    import pickle
    import shutil

    run = tmp_path / "runs/exp"
    shutil.copytree(dense / "runs/exp", run)
    marker = tmp_path / "PWNED"
    (run / "ckpt/global_step_3/model/.metadata").write_bytes(pickle.dumps(_Payload(marker)))
    source = run / "ckpt/global_step_3" if given == "step" else run / "ckpt"
    assert convert.main(["mcore-to-hf", "--mcore", str(source), "--out", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert f"{run}/ckpt/global_step_3/model/.metadata has " in err and "the manifest" in err, err
    assert not marker.exists()


@pytest.mark.slow
def test_moe_tp2_ep2_checkpoint_exports_to_hf_with_the_trainers_logits(moe, tmp_path, capsys):
    _export(moe / "runs/exp/ckpt/global_step_3", tmp_path / "hf", capsys)
    _check_export_matches_trainer(moe, tmp_path / "hf", "qwen3_moe")


def test_neither_form_is_an_error_naming_both(tmp_path, capsys):
    assert convert.main(["mcore-to-hf", "--mcore", str(tmp_path), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "is not an mcore checkpoint (mcore_checkpoint.json) nor a trainer checkpoint (trainer_state.pt" in err


def test_a_trainer_checkpoint_without_its_run_config_says_where_it_looked(tmp_path, capsys):
    step = tmp_path / "ckpt" / "global_step_1"
    (step / "model").mkdir(parents=True)
    torch.save({"global_step": 1}, step / "trainer_state.pt")
    assert convert.main(["mcore-to-hf", "--mcore", str(step), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "the run's config.yaml is not at any of" in err and str(tmp_path / "config.yaml") in err
    assert "pass --config" in err
