"""Issue #15 item 7: SGLang's MTP drafter stays in step with the policy.

The trainer (a Qwen3-MoE HF model, model.mtp_num_layers=1, its MTP layer fresh: the checkpoint has none)
drives SGLang stand-ins launched with --speculative-algorithm NEXTN, which run SGLang's Qwen3-MoE drafter
(tests/standin/draft.py) and route each update to the runners the emulated release's scheduler routes it
to. After every weight sync the drafter's tensors at every server TP rank equal the actor's MTP export and
the target's the rest of it (sha256): over a weight-update group on 0.5.23 (selector "all"), by tensor
updates on 0.5.20; on 0.5.20 a weight-update group cannot reach the drafter and the run stops with
DrafterSyncUnsupported naming the release and the keys that fix it. With PP = 2 the MTP layer comes from
the last stage's sender.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from megatron_dapo.rollout.sglang.drafter import drafter_sync
from tests.standin import StandinServer, free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
VOCAB = 18  # the arithmetic task's character tokenizer


def hf_moe(out: pathlib.Path) -> str:
    """A tiny Qwen3-MoE checkpoint over the task's vocabulary (no MTP tensors, as released ones)."""
    import transformers

    config = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=64, num_hidden_layers=2,
                                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                         norm_topk_prob=True, tie_word_embeddings=False)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = out / "hf_moe"
    model.save_pretrained(path)
    return str(path)


def speculative_server(hf_dir: str, tmp_path, version: str, *extra: str) -> StandinServer:
    args = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2", "--speculative-num-draft-tokens", "3",
            "--speculative-draft-model-path", hf_dir, "--enable-deterministic-inference", *extra]
    return StandinServer(model_path=hf_dir, tp_size=2, emulate_version=version, args=args, log_dir=tmp_path)


def overrides(hf_dir: str, urls: list[str], *more: str) -> list[str]:
    return ["model.arch=hf", f"model.hf_path={hf_dir}", "model.mtp_num_layers=1", "rollout.engine=sglang",
            f"rollout.sglang_urls=[{','.join(urls)}]", "rollout.tensor_model_parallel_size=2",
            "rollout.speculative.algorithm=NEXTN", "rollout.speculative.num_steps=2",
            "rollout.speculative.num_draft_tokens=3", "rollout.deterministic_inference=true",
            "rollout.weight_sync_bucket_mb=0.02", "rollout.require_memory_saver=false", "data.train_batch_size=4",
            "data.gen_batch_size=null",
            "rollout.n=2", "actor.ppo_mini_batch_size=4", "data.max_response_length=6",
            "reward.overlong_buffer.len=4", "algorithm.filter_groups.enable=false", "trainer.sft_warmup_steps=0",
            "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.logger=[]",
            "trainer.total_training_steps=2", "trainer.save_freq=-1", "actor.lr=1e-2", *more]


def launch(out: pathlib.Path, cfg: list[str], nproc: int = 1, port: int = 0) -> tuple[subprocess.CompletedProcess, list,
                                                                                        dict]:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
        "--master_port", str(port)]
    # Output to a file, not a pipe: with rollout.weight_transport=ipc on CPU torch starts torch_shm_manager,
    # which inherits the trainer's stdout and outlives it while the server holds shared memory.
    with open(out / "log.txt", "w") as log:
        code = subprocess.run([*launcher, str(ROOT / "tests/trainer/_mp_drafter.py"), str(out), *cfg], cwd=ROOT,
                              env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900).returncode
    r = subprocess.CompletedProcess([], code, stdout=(out / "log.txt").read_text(), stderr="")
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else []
    metrics = json.loads((out / "metrics.json").read_text()) if (out / "metrics.json").exists() else {}
    return r, report, metrics


def check_every_sync(r, report, steps: int = 2) -> None:
    assert r.returncode == 0, r.stdout[-8000:]
    assert [e["version"] for e in report] == list(range(steps + 1))  # the start sync, then every step
    for e in report:
        assert e["mtp_tensors"] > 0 and e["draft_compared"] >= 2 * e["mtp_tensors"], e  # both TP ranks
        assert not e["draft_mismatch"] and not e["target_mismatch"], (e["version"], e["draft_mismatch"][:4],
                                                                       e["target_mismatch"][:4])
    # The MTP layer trains (lr 1e-2): the drafter received other weights after each step, not once.
    assert len({e["mtp_digest"] for e in report}) == steps + 1
    assert "fresh drafter" in r.stdout  # build: the checkpoint has no MTP tensors, named in the log


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return hf_moe(tmp_path_factory.mktemp("drafter"))


def _drafter_weights(server) -> list[dict]:
    return [{n: c["sha256"] for n, c in rank.items()} for rank in server.checksums(role="draft")]


def test_the_drafter_follows_the_policy_over_a_weight_update_group_on_0_5_23(hf_dir, tmp_path):
    with speculative_server(hf_dir, tmp_path, "0.5.23") as srv:
        r, report, metrics = launch(tmp_path / "run", overrides(hf_dir, [srv.url]))
        check_every_sync(r, report)
        assert all(b.get("selector") == "all" for b in srv.requests("/update_weights_from_distributed"))
        assert srv.requests("/begin_weight_update") == [{"selector": "all"}] * 3 and srv.ignored_fields() == {}
        drafter = _drafter_weights(srv)
    assert drafter[0] == drafter[1] and "mtp.fc.weight" in drafter[0]
    # Speculative counters of the release (0.5.23's names) reach the step's metrics.
    for step in ("1", "2"):
        m = metrics[step]
        assert m["spec_decode/num_requests"] + m["spec_decode/num_unverified"] == 8.0 and m["spec_decode/accept_length"] > 1


def test_the_drafter_follows_the_policy_by_tensor_updates_on_0_5_20(hf_dir, tmp_path):
    with speculative_server(hf_dir, tmp_path, "0.5.20") as srv:
        r, report, _ = launch(tmp_path / "run", overrides(hf_dir, [srv.url], "rollout.weight_transport=ipc"))
        check_every_sync(r, report)
        bodies = srv.requests("/update_weights_from_tensor")
        assert bodies and all("selector" not in b for b in bodies) and srv.ignored_fields() == {}


def test_a_weight_update_group_cannot_reach_the_drafter_before_0_5_21(hf_dir, tmp_path):
    with speculative_server(hf_dir, tmp_path, "0.5.20") as srv:
        r, report, _ = launch(tmp_path / "run", overrides(hf_dir, [srv.url]))
        assert r.returncode != 0 and report == []
        assert "DrafterSyncUnsupported: rollout.speculative.algorithm=NEXTN: SGLang 0.5.20 loads " \
               "/update_weights_from_distributed into the target model only" in r.stdout, r.stdout[-3000:]
        assert "rollout.weight_transport=ipc" in r.stdout
        assert srv.requests("/update_weights_from_distributed") == []  # refused before anything was sent


@pytest.mark.multiproc
def test_with_two_pipeline_stages_the_last_stage_sends_the_drafter(hf_dir, tmp_path):
    with speculative_server(hf_dir, tmp_path, "0.5.23") as srv:
        layout = ["trainer.n_gpus_per_node=2", "parallel.pipeline_model_parallel_size=2"]
        r, report, _ = launch(tmp_path / "run", overrides(hf_dir, [srv.url], *layout), nproc=2,
                              port=free_port())
        check_every_sync(r, report)


def test_the_drafter_sync_per_release_and_model():
    """The decision table (rollout/sglang/drafter.py) on the releases' features."""
    import dataclasses

    from megatron_dapo.models.arch import get_arch
    from megatron_dapo.rollout.sglang.drafter import DrafterSync, DrafterSyncUnsupported
    from megatron_dapo.rollout.sglang.versions import features_for

    moe = get_arch("tiny_moe", mtp_num_layers=1)
    kw = dict(algorithm="NEXTN", arch=moe, model_type="qwen3_moe")
    assert drafter_sync(**kw, features=features_for("0.5.23"), transport="distributed") == DrafterSync(True, "all")
    assert drafter_sync(**kw, features=features_for("0.5.21"), transport="ipc") == DrafterSync(True, "all")
    assert drafter_sync(**kw, features=features_for("0.5.13"), transport="ipc") == DrafterSync(True, None)
    assert drafter_sync(**kw, features=None, transport=None) is None  # before launch: nothing release-bound failed
    assert drafter_sync(algorithm=None, arch=moe, model_type="qwen3_moe", features=features_for("0.5.8"),
                        transport="distributed") == DrafterSync(False, None)
    cases = [
        (dict(kw, features=features_for("0.5.20"), transport="distributed"), "SGLang 0.5.20 loads /update_weights"),
        (dict(kw, features=features_for("0.5.12"), transport="ipc"), "SGLang 0.5.12 has no MTP drafter for qwen3_moe"),
        (dict(kw, model_type="qwen2", features=None, transport=None), "no MTP drafter for qwen2 models in any"),
        (dict(kw, arch=get_arch("tiny_moe"), features=None, transport=None), "model.mtp_num_layers=0"),
        (dict(kw, arch=get_arch("tiny_moe", mtp_num_layers=2), features=None, transport=None), "holds one layer"),
        (dict(kw, arch=dataclasses.replace(moe, moe_layer_freq=(1, 0, 0, 0)), features=None, transport=None),
         "MTP layer is dense .* decoder layer 0 .* \\(MoE\\)"),
    ]
    for case, message in cases:
        with pytest.raises(DrafterSyncUnsupported, match=message):
            drafter_sync(**case)
