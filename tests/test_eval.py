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


def test_eval_of_a_trainer_checkpoint_equals_the_runs_validation_at_that_step(tmp_path, capsys):
    """Only --model: the run's own validation set (its 64 held-out problems, not the 128 of the standard
    split), sampling, lengths, reward and the seed its validation used at that step, so the figures
    are the run's validation figures at that step, exactly (same machine, same process count)."""
    from megatron_dapo.config import load_config
    from megatron_dapo.trainer.run import build_trainer, close_parts

    cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), [
        "trainer.total_training_steps=2", "trainer.sft_warmup_steps=0", "trainer.test_freq=2", "trainer.save_freq=2",
        "trainer.logger=[]", f"trainer.output_dir={tmp_path}", "trainer.experiment_name=ev",
        "algorithm.filter_groups.enable=false", "data.gen_batch_size=null", "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=8", "data.max_response_length=4", "reward.overlong_buffer.len=2",
        "trainer.seed=7", "data.arithmetic.num_val=64", "trainer.val_before_train=false"])
    trainer = build_trainer(cfg)
    try:
        val = trainer.fit()
    finally:
        close_parts(trainer.p)
    capsys.readouterr()
    assert main(["--model", str(tmp_path / "ev/ckpt"), "--dump", str(tmp_path / "own.jsonl")]) == 0
    out = _last_json(capsys)
    assert out["num_prompts"] == 64.0 and set(out) == {"avg@4", "num_prompts", "pass@1", "pass@2", "pass@4"}
    assert out["avg@4"] == val["val/arithmetic/acc/mean@4"] and out["pass@4"] == val["val/arithmetic/acc/pass@4"]
    # Another seed samples other responses: the default seed above is the one the run's validation used.
    assert main(["--model", str(tmp_path / "ev/ckpt/global_step_2"), "--seed", "8", "--dump",
                 str(tmp_path / "other.jsonl")]) == 0
    own, other = ([json.loads(line)["response"] for line in open(tmp_path / f)] for f in ("own.jsonl", "other.jsonl"))
    assert len(own) == len(other) == 256 and own != other
    # --data arithmetic is the standard synthetic split (128 problems), the same whatever model is evaluated.
    assert main(["--model", str(tmp_path / "ev/ckpt/global_step_2"), "--data", "arithmetic", "--n", "1",
                 "--temperature", "0"]) == 0
    out = _last_json(capsys)
    assert out["num_prompts"] == 128.0 and out["avg@1"] == out["pass@1"]


def test_the_export_of_the_embedded_default_carries_its_tokenizer(tmp_path, capsys):
    """The synthetic task's character vocabulary is written as HF files next to the weights: transformers
    loads the export's tokenizer with the trainer's ids, beside the Qwen2 config.json."""
    from megatron_dapo.config import load_config
    from megatron_dapo.convert import main as convert_main
    from megatron_dapo.data.tokenizer import CharTokenizer, HFTokenizer
    from megatron_dapo.trainer.run import run

    cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), [
        "trainer.total_training_steps=1", "trainer.sft_warmup_steps=0", "trainer.test_freq=0", "trainer.logger=[]",
        f"trainer.output_dir={tmp_path}", "trainer.experiment_name=ex", "algorithm.filter_groups.enable=false",
        "data.gen_batch_size=null", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
        "data.max_response_length=4", "reward.overlong_buffer.len=2"])
    assert run(cfg) == 0
    assert "done: 1 steps in " in capsys.readouterr().out
    assert run(cfg) == 0  # the same run again: resumed at its last step, nothing to train, and it says so
    assert (f"done: nothing to train, the checkpoint in {tmp_path / 'ex/ckpt'} is at step 1, "
            "trainer.total_training_steps") in capsys.readouterr().out
    assert convert_main(["mcore-to-hf", "--mcore", str(tmp_path / "ex/ckpt"), "--out", str(tmp_path / "hf")]) == 0
    hf, char = HFTokenizer(str(tmp_path / "hf")), CharTokenizer()
    assert (hf.vocab_size, hf.pad_id, hf.bos_id, hf.eos_id) == (18, 0, 1, 2)
    for text in ("12+34=", " 7 - 8 = -1", char.CHARS):
        assert hf.encode(text) == char.encode(text)
        assert hf.decode(char.encode(text) + [char.eos_id]) == text


def test_eval_errors_are_one_line(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("eval error: --model ") and "neither an HF directory" in err[0]
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf/config.json").write_text("{}")
    assert main(["--model", str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err.strip() == (f"eval error: --data is required for an HF directory "
                                               f"({tmp_path / 'hf'}): a prompt file or `arithmetic`")
