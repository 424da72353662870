"""Both weight transports against the real servers, checked by what the servers generate: after a sync
the servers' greedy tokens equal the project's local engine's on the actor's model, token for token.

- "distributed": /init_weights_update_group (backend gloo) + /update_weights_from_distributed.
- "ipc": /update_weights_from_tensor inside 0.5.23's /begin_weight_update ... /end_weight_update session,
  with CPU tensors serialized by shared-memory file name (the default file-descriptor payload kills a
  real server; tests/rollout/test_sglang_weights.py).

Version 0 syncs the actor as loaded; version 1 after seeded noise on every parameter, which changes the
local engine's greedy tokens (asserted), so a server that kept any old tensor would not follow. Greedy
argmax over fp32 logits that agree to ~1e-6 (test_train's log-prob check): a flip needs two logits
within that of each other, which these random weights do not produce on the six prompts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.sglang_real.conftest import ROOT, model_overrides

SYNC_VERSIONS = (0, 1)


@pytest.mark.parametrize("transport", ["distributed", "ipc"])
def test_after_a_sync_each_server_generates_the_local_engines_greedy_tokens(real_servers, tmp_path, transport):
    urls = ",".join(real_servers.urls)
    cmd = [sys.executable, str(ROOT / "tests/sglang_real/_sync_vs_local.py"), str(tmp_path), transport,
           *model_overrides(real_servers.model_dir, real_servers.tokenizer_dir), "rollout.engine=sglang",
           f"rollout.sglang_urls=[{urls}]", "rollout.mode=disaggregate", "model.params_dtype=fp32",
           "rollout.weight_sync_bucket_mb=0.02", "trainer.sft_warmup_steps=0"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    with open(tmp_path / "run.log", "w") as log:  # a file: torch_shm_manager may outlive the run (ipc)
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=600).returncode
    assert rc == 0, (tmp_path / "run.log").read_text()[-8000:]
    report = json.loads((tmp_path / "sync_vs_local.json").read_text())
    assert [e["version"] for e in report] == list(SYNC_VERSIONS)
    for entry in report:
        print(f"{transport}: sync to version {entry['version']} in {entry['sync_s']:.2f} s")
        # every bucket went as one byte tensor (SGLang's flattened_bucket), and there were several
        assert entry["flattened_buckets"] == entry["buckets"] > 1, entry
        local = {pid: r["tokens"] for pid, r in entry["local"].items()}
        assert all(len(t) > 0 for t in local.values())
        for url, rows in entry["servers"].items():
            assert {pid: r["version"] for pid, r in rows.items()} == dict.fromkeys(local, entry["version"]), url
            assert {pid: r["tokens"] for pid, r in rows.items()} == local, (entry["version"], url)
    before, after = ({pid: r["tokens"] for pid, r in e["local"].items()} for e in report)
    assert sum(before[p] != after[p] for p in before) >= 3, "the noise did not change the greedy tokens"
