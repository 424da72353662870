"""rollout.mode=disaggregate needs servers of its own: refused at load when the trainer would launch them
on its own GPUs (a weight-update group would hold two ranks on one GPU, which NCCL refuses, and the servers
could not release memory)."""

import pathlib
import subprocess
import sys

import pytest

from megatron_dapo.config import ConfigError, load_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
SGLANG_RECIPES = ["configs/dapo_qwen2.5_32b.yaml", "configs/dapo_qwen3_30b_a3b.yaml"]


@pytest.mark.parametrize("recipe", [None, *SGLANG_RECIPES])
def test_disaggregate_without_server_urls_is_refused_naming_both_keys_and_the_fix(recipe):
    engine = ["rollout.engine=sglang", "model.hf_path=/m"] if recipe is None else []
    with pytest.raises(ConfigError) as e:
        load_config(recipe and str(ROOT / recipe), [*engine, "rollout.mode=disaggregate"])
    assert e.value.key == "rollout.mode"
    assert "rollout.sglang_urls" in e.value.message and "two ranks on one GPU" in e.value.message
    assert "start the SGLang servers on nodes of their own and pass their URLs" in e.value.message


@pytest.mark.parametrize("recipe", SGLANG_RECIPES)
def test_disaggregate_with_server_urls_and_colocate_without_them_load(recipe):
    urls = "rollout.sglang_urls=[http://10.0.1.1:30000,http://10.0.1.2:30000]"
    cfg = load_config(str(ROOT / recipe), ["rollout.mode=disaggregate", urls])
    assert cfg.rollout.mode == "disaggregate" and len(cfg.rollout.sglang_urls) == 2
    assert load_config(str(ROOT / recipe)).rollout.mode == "colocate"   # the recipes launch colocated servers


def test_servers_launched_on_the_cpu_and_the_local_engine_share_no_gpu_and_load():
    """CPU servers (the real-server tests) take no GPU of the trainer; the local engine has no servers."""
    cpu = load_config(None, ["rollout.engine=sglang", "model.hf_path=/m", "rollout.server_device=cpu",
                             "rollout.require_memory_saver=false", "rollout.mode=disaggregate"])
    assert cpu.rollout.mode == "disaggregate" and not cpu.rollout.sglang_urls
    assert load_config(None, ["rollout.mode=disaggregate"]).rollout.engine == "local"


def test_the_cli_stops_before_any_model_is_built_with_one_line():
    r = subprocess.run([sys.executable, "-m", "megatron_dapo.train", "--config", "configs/dapo_qwen2.5_32b.yaml",
                        "rollout.mode=disaggregate", "--print-config"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("config error: rollout.mode: disaggregate needs"), r.stderr
