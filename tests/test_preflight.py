"""`python -m megatron_dapo.train ... --check`: every problem a job would meet minutes into its allocation,
found on one CPU in seconds, one line each, exit 2; or one ok line."""

import json
import pathlib
import subprocess
import sys

from megatron_dapo.config import load_config
from megatron_dapo.preflight import check

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_dapo.train", *args, "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_the_embedded_default_passes_with_what_was_checked(tmp_path):
    r = _cli("--config", "configs/tiny_cpu.yaml", f"trainer.output_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ("preflight: ok: tokenizer (18 tokens), data (16000 training prompts, 256 validation), "
                                "schedule (350 steps; the epochs hold 16,667 generation batches), "
                                "model (4 layers, hidden 128) at the layout, reward, output directories, memory plan "
                                "(training peak 4.4 GiB of 80)")


def test_epochs_that_end_the_run_before_its_steps_are_refused_by_name(tmp_path):
    """verl's DAPO script: total_epochs=1 sized for the 1.79M-row file; here the prompts hold fewer batches."""
    r = _cli("--config", "configs/tiny_cpu.yaml", f"trainer.output_dir={tmp_path}", "trainer.total_epochs=1",
             "trainer.total_training_steps=200")
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "preflight: trainer.total_epochs: trainer.total_epochs=1 over 16,000 training prompts is 167 generation "
        "batches of 96, so the run would end by step 167 (earlier when dynamic sampling draws several batches a "
        "step), before trainer.total_training_steps=200: set trainer.total_epochs=2 or more (more with dynamic "
        "sampling), or lower trainer.total_training_steps"]


def test_schedule_closed_forms():
    from megatron_dapo.trainer.schedule import Schedule

    recipe = Schedule(prompts=17_398, gen_batch=1536, epochs=1, steps=500)  # verl's keys over `make data`'s file
    assert recipe.gen_batches == 12 and recipe.epochs_end_first and "set trainer.total_epochs=45 " in recipe.problem()
    fits = Schedule(prompts=17_398, gen_batch=1536, epochs=45, steps=500)
    assert fits.gen_batches == 510 and fits.problem() is None and fits.describe().endswith("it ends at step 500")


def test_the_32b_recipe_without_its_model_and_data_names_each_missing_part(tmp_path):
    r = _cli("--config", "configs/dapo_qwen2.5_32b.yaml", f"trainer.output_dir={tmp_path}/runs",
             f"model.hf_path={tmp_path}/Qwen2.5-32B", f"data.tokenizer={tmp_path}/Qwen2.5-32B",
             f"data.train_files={tmp_path}/dapo.parquet", f"data.val_files={tmp_path}/aime.parquet")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        f"preflight: data.tokenizer: '{tmp_path}/Qwen2.5-32B' does not load: FileNotFoundError: tokenizer path "
        f"'{tmp_path}/Qwen2.5-32B' does not exist (expected an HF tokenizer directory)",
        f"preflight: data.train_files: {tmp_path}/dapo.parquet: no such file",
        f"preflight: data.val_files: {tmp_path}/aime.parquet: no such file",
        f"preflight: model: model.arch=qwen2.5-32b: model.hf_path '{tmp_path}/Qwen2.5-32B' has no config.json "
        "(an HF model directory is expected)"]


def test_another_model_a_short_data_file_a_held_and_an_unwritable_directory_and_a_plan_that_does_not_fit(tmp_path):
    import fcntl

    from megatron_dapo.trainer.rundir import LOCK_NAME

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 5120,
        "intermediate_size": 27648, "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False}))
    data = tmp_path / "few.jsonl"
    data.write_text("".join(json.dumps({"data_source": "d", "prompt": [{"role": "user", "content": f"{i}+1="}],
                                        "reward_model": {"ground_truth": str(i + 1)}}) + "\n" for i in range(3)))
    (tmp_path / "afile").write_text("")
    held = tmp_path / "ckpts"
    held.mkdir()
    lock = open(held / LOCK_NAME, "w")  # another trainer's lock on the checkpoint directory
    lock.write('{"pid": 4242, "host": "node-7"}')
    lock.flush()
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        cfg = load_config(str(ROOT / "configs/dapo_qwen2.5_32b.yaml"), [
            f"model.hf_path={hf}", "data.tokenizer=builtin:char", f"data.train_files={data}", "data.val_files=",
            "trainer.test_freq=0", f"trainer.output_dir={tmp_path}/afile/runs", f"trainer.default_local_dir={held}"])
        problems, _ = check(cfg, gpu_memory_gib=8)
    finally:
        lock.close()
    got = dict(problems)
    assert got["data"].startswith(f"{data}: 3 usable prompts, fewer than one generation batch (1536)")
    assert got["model"] == (f"model.arch=qwen2.5-32b: {hf}/config.json is another model: num_layers 2 "
                            "(model.arch 64)")
    assert got[cfg.run_dir].startswith("cannot write there (Not a directory")
    assert got[str(held)] == 'another run holds it: {"pid": 4242, "host": "node-7"}'
    assert "memory plan" not in got  # the plan needs the model's shape: it is checked once that is right
    problems, _ = check(load_config(str(ROOT / "configs/dapo_qwen2.5_32b.yaml"), [
        "data.tokenizer=builtin:char", f"data.train_files={data}", "data.val_files=", "trainer.test_freq=0",
        "model.hf_path=", f"trainer.output_dir={tmp_path}/ok"]), gpu_memory_gib=8)
    assert dict(problems)["memory plan"].startswith("configuration does not fit: actor training (pipeline rank 1) "
                                                    "needs 22.29 GiB > GPU 8.00 GiB")
