"""The sync trainer driving SGLang servers over HTTP (a protocol-faithful server on loopback stands in
for SGLang, which cannot be installed here): generation goes through /generate, and after every step
the actor's weights arrive at the server under their HF names, with the policy version."""

import pathlib

from megatron_dapo.config import load_config
from megatron_dapo.data.tokenizer import CharTokenizer
from megatron_dapo.trainer.run import run
from tests.rollout import sglang_protocol_server as sps

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_fit_with_the_sglang_engine_generates_over_http_and_syncs_hf_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(sps, "VOCAB", CharTokenizer().vocab_size)  # the toy model samples our vocabulary
    with sps.ProtocolServer() as server:
        cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), [
            "rollout.engine=sglang", f"rollout.sglang_urls=[{server.url}]", "trainer.total_training_steps=2",
            "trainer.sft_warmup_steps=0", "algorithm.filter_groups.enable=false", "data.gen_batch_size=null",
            "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2", "data.max_response_length=6",
            "reward.overlong_buffer.len=4", "trainer.test_freq=0", "trainer.val_before_train=false",
            "trainer.logger=[]", "trainer.save_freq=-1", f"trainer.output_dir={tmp_path}",
            "rollout.weight_sync_bucket_mb=1"])
        assert run(cfg) == 0
        generate = server.state.bodies("/generate")
        assert sum(len(b["input_ids"]) if isinstance(b["input_ids"][0], list) else 1 for b in generate) == 2 * 4 * 4
        names = set(server.state.weights)
        assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
        assert any(n.endswith("self_attn.q_proj.weight") for n in names)
        assert server.state.weight_version == "2"
