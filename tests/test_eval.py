"""Evaluation CLI: unbiased pass@k, and avg@n / pass@k of HF and trainer checkpoints on the arithmetic set."""

import json
import pathlib

import pytest

from megatron_dapo.eval import main, pass_at_k, summarize

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_pass_at_k_closed_forms():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0
    with pytest.raises(ValueError, match="pass@5"):
        pass_at_k(4, 1, 5)


def test_summarize_averages_over_prompts():
    out = summarize({"a": [True, False], "b": [False, False]}, [1, 2])
    assert out == {"avg@2": 0.25, "num_prompts": 2.0, "pass@1": 0.25, "pass@2": 0.5}


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_of_an_hf_checkpoint_on_the_arithmetic_set(tmp_path, capsys):
    import torch
    import transformers

    from megatron_dapo.data.tokenizer import CharTokenizer

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=CharTokenizer().vocab_size, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert main(["--model", str(tmp_path / "hf"), "--data", "arithmetic", "--tokenizer", "builtin:char", "--n", "2",
                 "--max-tokens", "4", "--top-p", "1.0"]) == 0
    out = _last_json(capsys)
    assert out["num_prompts"] == 128.0 and set(out) == {"avg@2", "num_prompts", "pass@1", "pass@2"}
    assert 0.0 <= out["pass@1"] <= out["pass@2"] <= 1.0 and out["pass@1"] == pytest.approx(out["avg@2"])


def test_eval_of_a_trainer_checkpoint(tmp_path, capsys):
    from megatron_dapo.config import load_config
    from megatron_dapo.trainer.run import run

    cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), [
        "trainer.total_training_steps=1", "trainer.sft_warmup_steps=0", "trainer.test_freq=0",
        "trainer.logger=[]", f"trainer.output_dir={tmp_path}", "trainer.experiment_name=ev",
        "algorithm.filter_groups.enable=false", "data.gen_batch_size=null", "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=8",
        "data.max_response_length=4", "reward.overlong_buffer.len=2"])
    run(cfg)
    capsys.readouterr()
    assert main(["--model", str(tmp_path / "ev/ckpt/global_step_1"), "--data", "arithmetic", "--n", "1",
                 "--max-tokens", "4", "--temperature", "0"]) == 0
    out = _last_json(capsys)
    assert out["num_prompts"] == 128.0 and out["avg@1"] == out["pass@1"]
    # Only --model and --data: the run's own validation settings (tiny_cpu: val_kwargs.n 4, responses of at
    # most data.max_response_length = 4 tokens), not the AIME defaults (20,480 tokens, more than this
    # model's 1,024 positions).
    assert main(["--model", str(tmp_path / "ev/ckpt"), "--data", "arithmetic"]) == 0
    out = _last_json(capsys)
    assert out["num_prompts"] == 128.0 and set(out) == {"avg@4", "num_prompts", "pass@1", "pass@2", "pass@4"}
