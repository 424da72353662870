"""`python -m megatron_dapo.eval --engine sglang` without --sglang-url: the evaluator launches the servers
itself through the trainer's launcher (rollout/sglang/build.py), evaluates through them and stops them; its
greedy responses equal the local engine's on the same checkpoint (fp32 server and actor)."""

from __future__ import annotations

import json

import psutil

from megatron_dapo.eval import main
from tests.sglang_real.conftest import assert_all_gone, cpu_server_overrides, free_port_pair


def _responses(path) -> dict[tuple[str, int], str]:
    rows = [json.loads(line) for line in open(path)]
    return {(r["uid"], r["sample"]): r["response"] for r in rows}


def _sglang_children() -> set[int]:
    me = psutil.Process()
    return {c.pid for c in me.children(recursive=True) if "sglang" in " ".join(c.cmdline())}


def test_eval_launches_its_own_servers_and_agrees_with_the_local_engine(tiny_qwen2, tmp_path, capsys):
    model_dir, tokenizer_dir = tiny_qwen2
    common = ["--model", model_dir, "--tokenizer", tokenizer_dir, "--data", "arithmetic", "--n", "1",
              "--temperature", "0", "--max-tokens", "6", "--max-prompt-length", "24"]
    assert main([*common, "--dump", str(tmp_path / "local.jsonl")]) == 0
    local = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    before = _sglang_children()
    assert main([*common, "--dump", str(tmp_path / "sglang.jsonl"), "--engine", "sglang", *cpu_server_overrides(),
                 f"rollout.server_base_port={free_port_pair()}", f"trainer.output_dir={tmp_path}"]) == 0
    served = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert served == local and served["num_prompts"] == 128.0
    assert _responses(tmp_path / "sglang.jsonl") == _responses(tmp_path / "local.jsonl")
    responses = _responses(tmp_path / "local.jsonl")
    assert len(responses) == 128 and len(set(responses.values())) > 10  # real, varied generations were compared
    assert_all_gone(_sglang_children() - before)  # the launched servers are stopped on the way out
    assert list((tmp_path).glob("*/sglang/*")), "the servers' logs are under the run directory"
