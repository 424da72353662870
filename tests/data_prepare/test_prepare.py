"""`python -m megatron_dapo.data.prepare`: row validation, bad-row report, dedupe, and that the files
it writes load with the training loader (`megatron_dapo.data.dataset.load_prompt_dataset`)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_dapo.data.dataset import load_prompt_dataset
from megatron_dapo.data.prepare import DAPO_PROMPT_TEMPLATE, main


class ByteTokenizer:
    """Enough of the Tokenizer protocol for the loader: one id per UTF-8 byte."""

    vocab_size, pad_id, eos_id, bos_id = 256, 0, 0, None

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode()

    def apply_chat_template(self, messages):
        return "\n".join(m["content"] for m in messages)


def _row(question, answer, index, **changes):
    row = {"data_source": "math_dapo", "prompt": [{"role": "user", "content": question}], "ability": "MATH",
           "reward_model": {"style": "rule-lang", "ground_truth": answer}, "extra_info": {"index": index}}
    row.update(changes)
    return row


def _write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture
def dapo_file(tmp_path):
    rows = [
        _row("What is 1+1?", "2", "a"),                                     # 0 good
        _row("What is 1+1?", "2", "a"),                                     # 1 exact duplicate of 0
        _row("What is 2+2?", "4", "b", prompt=[]),                          # 2 empty prompt
        _row("What is 3+3?", "6", "c", prompt=[{"role": "robot", "content": "x"}]),  # 3 bad role
        _row("What is 4+4?", None, "d"),                                    # 4 no ground truth
        _row("What is 5+5?", "10", "e"),                                    # 5 good
        _row("What is 6+6?", "12", "a"),                                    # 6 index of row 0, other prompt
        _row("What is 7+7?", "14", "f", data_source=""),                    # 7 empty data_source
    ]
    return _write(tmp_path / "dapo_raw.parquet", rows)


def test_bad_rows_are_reported_with_0_based_row_and_field_and_exit_1_writes_no_data(dapo_file, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["--dapo-math", dapo_file, "--out-dir", str(out)]) == 1
    report = json.loads((out / "prepare_report.json").read_text())
    assert report["row_numbers"] == "0-based positions in the input file"
    (file_report,) = report["files"]
    assert [(b["row"], b["field"]) for b in file_report["bad_rows"]] == [
        (2, "prompt"), (3, "prompt[0].role"), (4, "reward_model.ground_truth"), (6, "extra_info.index"),
        (7, "data_source")]
    assert "row 0" in file_report["bad_rows"][3]["problem"]          # the index clash names the other row
    assert file_report["rows_read"] == 8 and file_report["duplicates_dropped"] == 1
    assert not (out / "dapo-math-17k.parquet").exists()
    printed = capsys.readouterr().out
    assert "bad row 3 (0-based): field 'prompt[0].role'" in printed


def test_skip_bad_writes_good_deduplicated_rows_that_the_training_loader_reads(dapo_file, tmp_path):
    out = tmp_path / "out"
    assert main(["--dapo-math", dapo_file, "--out-dir", str(out), "--skip-bad"]) == 0
    path = out / "dapo-math-17k.parquet"
    table = pq.read_table(path)
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    ds = load_prompt_dataset(str(path), ByteTokenizer(), max_prompt_length=100)
    assert ds.uids == ["math_dapo-a", "math_dapo-e"]
    assert [r.ground_truth for r in ds] == ["2", "10"]
    assert ds[1].raw_prompt == "What is 5+5?"
    report = json.loads((out / "prepare_report.json").read_text())["files"][0]
    assert report["rows_written"] == 2 and len(report["bad_rows"]) == 5


def test_numeric_ground_truth_becomes_text_and_integer_floats_lose_the_point(tmp_path):
    src = _write(tmp_path / "aime.parquet", [_row("p1", 42.0, 1), _row("p2", 2.5, 2), _row("p3", float("nan"), 3)])
    out = tmp_path / "out"
    assert main(["--aime", src, "--out-dir", str(out), "--skip-bad"]) == 0
    rows = pq.read_table(out / "aime-2024.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["42", "2.5"]
    assert [r["extra_info"]["index"] for r in rows] == ["1", "2"]      # index stored as text
    report = json.loads((out / "prepare_report.json").read_text())["files"][0]
    assert report["bad_rows"] == [{"row": 2, "field": "reward_model.ground_truth", "problem": "is nan"}]


def test_problem_answer_layout_is_converted_with_the_dapo_prompt(tmp_path):
    src = _write(tmp_path / "aime_plain.parquet", [
        {"ID": "2024-I-1", "Problem": "Find x.", "Answer": 204},
        {"ID": "2024-I-2", "Problem": "Find y.", "Answer": 25},
        {"ID": "2024-I-3", "Problem": "   ", "Answer": 7}])
    out = tmp_path / "out"
    assert main(["--aime", src, "--out-dir", str(out)]) == 1       # row 2: blank problem
    report = json.loads((out / "prepare_report.json").read_text())["files"][0]
    assert report["layout"] == "problem/answer"
    assert [(b["row"], b["field"]) for b in report["bad_rows"]] == [(2, "Problem")]
    assert main(["--aime", src, "--out-dir", str(out), "--skip-bad"]) == 0
    ds = load_prompt_dataset(str(out / "aime-2024.parquet"), ByteTokenizer(), max_prompt_length=1000)
    assert ds.uids == ["aime-2024-2024-I-1", "aime-2024-2024-I-2"]
    assert ds[0].raw_prompt == DAPO_PROMPT_TEMPLATE.format(problem="Find x.")
    assert ds[0].raw_prompt.endswith('Remember to put your answer on its own line after "Answer:".')
    assert [r.ground_truth for r in ds] == ["204", "25"]


def test_both_files_written_under_the_recipe_names(tmp_path):
    dapo = _write(tmp_path / "d.parquet", [_row("q", "1", "x")])
    aime = _write(tmp_path / "a.parquet", [_row("r", "2", "y", data_source="aime24")])
    out = tmp_path / "data"
    assert main(["--dapo-math", dapo, "--aime", aime, "--out-dir", str(out)]) == 0
    assert pq.read_table(out / "dapo-math-17k.parquet").num_rows == 1
    assert pq.read_table(out / "aime-2024.parquet").column("data_source").to_pylist() == ["aime24"]


def test_a_bad_row_in_one_file_blocks_writing_both(tmp_path):
    dapo = _write(tmp_path / "d.parquet", [_row("q", "1", "x")])
    aime = _write(tmp_path / "a.parquet", [_row("r", "2", "y", prompt=[])])
    out = tmp_path / "data"
    assert main(["--dapo-math", dapo, "--aime", aime, "--out-dir", str(out)]) == 1
    assert not (out / "dapo-math-17k.parquet").exists() and not (out / "aime-2024.parquet").exists()
    bad = json.loads((out / "prepare_report.json").read_text())["files"][1]["bad_rows"]
    assert [(b["row"], b["field"]) for b in bad] == [(0, "prompt")]


@pytest.mark.parametrize("case, expected", [
    ("missing", "no such file"),
    ("not_parquet", "not a readable parquet file"),
    ("wrong_columns", "match neither layout"),
    ("all_bad", "no good rows"),
])
def test_file_level_problems_exit_2_with_a_named_reason(tmp_path, capsys, case, expected):
    path = tmp_path / "x.parquet"
    if case == "not_parquet":
        path.write_text("hello")
    elif case == "wrong_columns":
        _write(path, [{"text": "a"}])
    elif case == "all_bad":
        _write(path, [_row("q", None, "x")])
    args = ["--dapo-math", str(path), "--out-dir", str(tmp_path / "o")]
    assert main(args + (["--skip-bad"] if case == "all_bad" else [])) == 2
    assert expected in capsys.readouterr().err


def test_extra_info_fields_and_nulls_survive_the_round_trip(tmp_path):
    src = _write(tmp_path / "d.parquet", [_row("q1", "1", "a", extra_info={"index": "a", "level": "3"}),
                                          _row("q2", "2", "b", extra_info={"index": "b", "level": None})])
    out = tmp_path / "o"
    assert main(["--dapo-math", src, "--out-dir", str(out)]) == 0
    table = pq.read_table(out / "dapo-math-17k.parquet")
    assert table.column("extra_info").to_pylist() == [{"index": "a", "level": "3"}, {"index": "b", "level": None}]


def test_nested_extra_info_value_is_a_bad_row_naming_the_key(tmp_path):
    src = _write(tmp_path / "d.parquet", [_row("q1", "1", "a", extra_info={"index": "a", "meta": {"x": 1}})])
    out = tmp_path / "o"
    assert main(["--dapo-math", src, "--out-dir", str(out)]) == 1
    bad = json.loads((out / "prepare_report.json").read_text())["files"][0]["bad_rows"]
    assert [(b["row"], b["field"]) for b in bad] == [(0, "extra_info.meta")]


def test_the_raw_dapo_math_layout_repeats_collapse_and_optional_columns_may_be_absent(tmp_path, capsys):
    """The published DAPO-Math-17k parquet repeats each problem about 100 times, each copy with its own
    extra_info.index (1.79M rows for 17.4k problems); verl's AIME file repeats each problem for avg@32. The
    copies collapse to one row per problem (n does the repeats), and the count is said. A file with only the
    columns the loader needs (no ability, no reward_model.style, no extra_info) is accepted too."""
    copies = [_row(f"What is {q}+{q}?", str(2 * q), f"uuid-{q}-{c}") for q in range(3) for c in range(5)]
    out = tmp_path / "out"
    assert main(["--dapo-math", _write(tmp_path / "raw.parquet", copies), "--out-dir", str(out)]) == 0
    said = capsys.readouterr().out
    assert "15 rows read, 0 bad, 12 duplicates dropped" in said, said
    ds = load_prompt_dataset(str(out / "dapo-math-17k.parquet"), ByteTokenizer(), max_prompt_length=100)
    assert ds.uids == ["math_dapo-uuid-0-0", "math_dapo-uuid-1-0", "math_dapo-uuid-2-0"]  # the first copy kept

    bare = [{"data_source": "aime-2024", "prompt": [{"role": "user", "content": f"p{i}"}],
             "reward_model": {"ground_truth": str(i)}} for i in range(4)]
    assert main(["--aime", _write(tmp_path / "bare.parquet", bare), "--out-dir", str(out)]) == 0
    rows = pq.read_table(out / "aime-2024.parquet").to_pylist()
    assert [(r["ability"], r["reward_model"]["style"], r["extra_info"]) for r in rows] == [("MATH", "rule", None)] * 4
    assert load_prompt_dataset(str(out / "aime-2024.parquet"), ByteTokenizer(), max_prompt_length=100).uids == \
        [f"aime-2024-{i}" for i in range(4)]
