"""The sync trainer driving an SGLang server over HTTP (the SGLang stand-in, its own process, 0.5.23's
protocol, the toy model over our vocabulary): generation goes through /generate, and after every step
the actor's weights arrive at the server under their HF names, with the policy version."""

import pathlib

import pytest
import torch.multiprocessing as tmp

from megatron_dapo.config import load_config
from megatron_dapo.data.tokenizer import CharTokenizer
from megatron_dapo.trainer.run import run
from tests.standin import StandinServer

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _cfg(url, tmp_path):
    return load_config(str(ROOT / "configs/tiny_cpu.yaml"), [
        "rollout.engine=sglang", f"rollout.sglang_urls=[{url}]", "trainer.total_training_steps=2",
        "trainer.sft_warmup_steps=0", "algorithm.filter_groups.enable=false", "data.gen_batch_size=null",
        "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2", "data.max_response_length=6",
        "reward.overlong_buffer.len=4", "trainer.test_freq=0", "trainer.val_before_train=false",
        "trainer.logger=[]", "trainer.save_freq=-1", f"trainer.output_dir={tmp_path}",
        "rollout.weight_sync_bucket_mb=1",
        "rollout.require_memory_saver=false"])  # the stand-in shares no accelerator memory with the trainer


def _server(tmp_path):
    return StandinServer(toy=True, args=["--toy-vocab-size", str(CharTokenizer().vocab_size)], log_dir=tmp_path)


@pytest.fixture
def file_system_sharing():
    """CPU tensors shared through named shared-memory files, which the server process can open (on a
    GPU node CUDA IPC does this); by default ForkingPickler shares them by file descriptor, which only
    the sender's multiprocessing children can open."""
    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    yield
    tmp.set_sharing_strategy(before)


def test_fit_with_the_sglang_engine_generates_over_http_and_syncs_hf_weights(tmp_path, file_system_sharing):
    with _server(tmp_path) as server:
        assert run(_cfg(server.url, tmp_path)) == 0
        generate = server.requests("/generate")
        assert sum(len(b["input_ids"]) if isinstance(b["input_ids"][0], list) else 1 for b in generate) == 2 * 4 * 4
        names = set(server.checksums()[0])
        assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
        assert any(n.endswith("self_attn.q_proj.weight") for n in names)
        assert server.stats()["weight_version"] == "2" and server.ignored_fields() == {}


def test_fit_syncs_weights_to_a_server_process_with_the_default_sharing_strategy(tmp_path):
    """The default torch sharing strategy (file descriptors, which only the sender's own children can
    open) is what a trainer runs with: the sync must not depend on it (it sends over a weight-update
    group, rollout/sglang/sync.py). Before the rework the server died on the first bucket."""
    assert tmp.get_sharing_strategy() == "file_descriptor"
    with _server(tmp_path) as server:
        assert run(_cfg(server.url, tmp_path)) == 0
        assert server.stats()["weight_version"] == "2"
