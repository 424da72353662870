"""What the trainer does with prompt files it cannot fully use: the rows dropped for length are counted and
logged, too few left for a generation batch is an error giving the counts, and an unreadable file stops the
run with exit code 2 and one line naming it."""

import json
import logging
import pathlib
import subprocess
import sys

import pytest

from megatron_dapo.config import load_config
from megatron_dapo.data.build import build_datasets
from megatron_dapo.data.dataset import DatasetError
from megatron_dapo.data.tokenizer import CharTokenizer

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _write(path, num_short, num_long):
    rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{i}+1=" if i < num_short else "9" * 40}],
             "reward_model": {"ground_truth": str(i + 1)}} for i in range(num_short + num_long)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(train_file, *extra):
    return load_config(str(ROOT / "configs/tiny_cpu.yaml"),
                       ["data.task=files", f"data.train_files={train_file}", "data.tokenizer=builtin:char",
                        "data.apply_chat_template=false", "data.max_prompt_length=16", "trainer.test_freq=0", *extra])


def test_prompts_dropped_for_length_are_counted_in_a_warning(tmp_path, caplog):
    path = _write(tmp_path / "t.jsonl", num_short=100, num_long=4)
    with caplog.at_level(logging.WARNING, logger="megatron_dapo"):
        train, val = build_datasets(_cfg(path), CharTokenizer())
    assert len(train) == 100 and val is None
    assert f"{path}: dropped 4 of 104 prompts longer than data.max_prompt_length=16 tokens" in caplog.text


def test_too_few_prompts_left_for_a_generation_batch_gives_the_counts(tmp_path):
    path = _write(tmp_path / "t.jsonl", num_short=4, num_long=36)
    cfg = _cfg(path)
    with pytest.raises(DatasetError) as err:
        build_datasets(cfg, CharTokenizer())
    assert str(err.value) == (
        f"{path}: 4 usable prompts, fewer than one generation batch ({cfg.data.effective_gen_batch_size}): of 40 "
        "rows, 36 are longer than data.max_prompt_length=16 tokens and 0 are malformed")


def test_an_unreadable_data_file_exits_2_with_one_line_naming_it(tmp_path):
    path = tmp_path / "t.parquet"
    path.write_bytes(b"")
    r = subprocess.run([sys.executable, "-m", "megatron_dapo.train", "--config", "configs/tiny_cpu.yaml",
                        "data.task=files", f"data.train_files={path}", "data.tokenizer=builtin:char",
                        "trainer.test_freq=0", f"trainer.output_dir={tmp_path}/runs"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if "Traceback" in line or line.startswith("data error")]
    assert errors == [f"data error: {path}: not a readable parquet file (0 bytes; read 0 rows before the error): "
                      "Parquet file size is 0 bytes"], r.stderr[-3000:]
