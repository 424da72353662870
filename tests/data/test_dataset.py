"""load_prompt_dataset: the DAPO/AIME row layout in parquet and jsonl, bad rows, overflow, uids."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_dapo.data.dataset import DatasetError, PromptDataset, PromptRecord, load_prompt_dataset
from megatron_dapo.data.tokenizer import CharTokenizer

TOK = CharTokenizer()


def make_row(question="1+2=", truth="3", index=None, source="math_dapo"):
    row = {
        "data_source": source,
        "prompt": [{"role": "user", "content": question}],
        "ability": "MATH",
        "reward_model": {"style": "rule-lab", "ground_truth": truth},
    }
    if index is not None:
        row["extra_info"] = {"index": index}
    return row


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return str(path)


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


ROWS = [make_row("1+2=", "3", index="a"), make_row("10-4=", "6", index="b"), make_row("2*3=", "6", index="c")]


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet], ids=["jsonl", "parquet"])
def test_rows_become_records(tmp_path, writer):
    path = writer(tmp_path / ("data.jsonl" if writer is write_jsonl else "data.parquet"), ROWS)
    dataset = load_prompt_dataset(path, TOK, max_prompt_length=16)
    assert isinstance(dataset, PromptDataset) and len(dataset) == 3
    assert dataset[1] == PromptRecord(
        uid="math_dapo-b",
        prompt_ids=TOK.encode("10-4="),
        raw_prompt="10-4=",
        ground_truth="6",
        data_source="math_dapo",
        extra_info={"index": "b"},
    )
    assert dataset.uids == ["math_dapo-a", "math_dapo-b", "math_dapo-c"]
    assert dataset.stats == {"rows_read": 3, "rows_skipped_malformed": 0, "rows_filtered_too_long": 0}


def test_jsonl_and_parquet_give_the_same_records(tmp_path):
    from_jsonl = load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", ROWS), TOK, max_prompt_length=16)
    from_parquet = load_prompt_dataset(write_parquet(tmp_path / "d.parquet", ROWS), TOK, max_prompt_length=16)
    assert list(from_jsonl) == list(from_parquet)


def test_uid_falls_back_to_row_number_and_prefix_numbers_rows(tmp_path):
    rows = [make_row(index=0), make_row(), make_row(source="aime24")]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    assert load_prompt_dataset(path, TOK, max_prompt_length=16).uids == [
        "math_dapo-0",
        "math_dapo-1",
        "aime24-2",
    ]
    assert load_prompt_dataset(path, TOK, max_prompt_length=16, uid_prefix="val").uids == [
        "val-0",
        "val-1",
        "val-2",
    ]


def test_duplicate_uid_names_both_rows(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [make_row(index=7), make_row(), make_row(index=7)])
    with pytest.raises(DatasetError, match=r"rows 0 and 2 \(0-based\) have the same uid 'math_dapo-7'; .*`make data "
                                           r"DAPO_MATH=<file>`"):
        load_prompt_dataset(path, TOK, max_prompt_length=16)
    # Numbering rows instead resolves it.
    assert len(load_prompt_dataset(path, TOK, max_prompt_length=16, uid_prefix="p")) == 3


MALFORMED = [
    pytest.param({"prompt": [{"role": "user", "content": "1="}], "reward_model": {"ground_truth": "1"}},
                 "'data_source': missing", id="missing_column"),
    pytest.param({**make_row(), "prompt": []}, "'prompt': expected a non-empty list", id="empty_prompt"),
    pytest.param({**make_row(), "prompt": "1+2="}, "'prompt': expected a non-empty list", id="prompt_not_list"),
    pytest.param({**make_row(), "prompt": [{"role": "user"}]}, "'prompt': message 0 has content=None",
                 id="message_without_content"),
    pytest.param({**make_row(), "reward_model": {"style": "rule"}}, "'reward_model.ground_truth': expected a str",
                 id="ground_truth_missing"),
    pytest.param({**make_row(), "reward_model": {"ground_truth": [1]}}, "'reward_model.ground_truth': expected a str",
                 id="ground_truth_list"),
    pytest.param({**make_row(), "reward_model": {"ground_truth": True}}, "'reward_model.ground_truth'",
                 id="ground_truth_bool"),
    pytest.param({**make_row(), "extra_info": [1]}, "'extra_info': expected a dict", id="extra_info_list"),
    pytest.param(make_row(question="what?"), "'prompt': the tokenizer cannot encode it", id="unencodable"),
    pytest.param({**make_row(), "prompt": [{"role": "user", "content": ""}]}, "'prompt': encodes to no tokens",
                 id="empty_content"),
]  # fmt: skip


@pytest.mark.parametrize("bad_row,problem", MALFORMED)
def test_malformed_row_raises_naming_file_row_and_field(tmp_path, bad_row, problem):
    path = write_jsonl(tmp_path / "d.jsonl", [make_row(), make_row(), bad_row, make_row()])
    with pytest.raises(DatasetError) as info:
        load_prompt_dataset(path, TOK, max_prompt_length=16, uid_prefix="p")
    message = str(info.value)
    assert message.startswith(f"{path}: row 2 (0-based; line 3): field ")
    assert problem in message


@pytest.mark.parametrize("bad_row,problem", MALFORMED)
def test_malformed_row_is_skipped_and_counted(tmp_path, bad_row, problem):
    path = write_jsonl(tmp_path / "d.jsonl", [make_row(), make_row(), bad_row, make_row()])
    dataset = load_prompt_dataset(path, TOK, max_prompt_length=16, on_bad_row="skip", uid_prefix="p")
    assert dataset.uids == ["p-0", "p-1", "p-3"]
    assert dataset.stats == {"rows_read": 4, "rows_skipped_malformed": 1, "rows_filtered_too_long": 0}


def test_parquet_malformed_row_is_named_by_row(tmp_path):
    rows = [make_row(), {**make_row(), "reward_model": {"style": "rule", "ground_truth": None}}]
    path = write_parquet(tmp_path / "d.parquet", rows)
    with pytest.raises(DatasetError, match=r"row 1 \(0-based\): field 'reward_model.ground_truth'"):
        load_prompt_dataset(path, TOK, max_prompt_length=16)


def test_invalid_json_line_is_a_malformed_row(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(make_row()) + "\n\n{not json\n")
    with pytest.raises(DatasetError, match=r"row 1 \(0-based; line 3\): field '<json>': not valid JSON"):
        load_prompt_dataset(str(path), TOK, max_prompt_length=16)
    assert len(load_prompt_dataset(str(path), TOK, max_prompt_length=16, on_bad_row="skip")) == 1


def test_non_utf8_jsonl_line_is_a_malformed_row_and_the_rest_of_the_file_is_read(tmp_path):
    path = tmp_path / "d.jsonl"
    bad = json.dumps(make_row("3+4=x", "7")).encode().replace(b"3+4=x", b"3+4=\xe9")  # a Latin-1 byte
    column = bad.index(b"\xe9") + 1
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(make_row(index=0)).encode() + b"\n" + bad + b"\n"
                     + json.dumps(make_row("5+5=", "10", index=2)).encode() + b"\n")
    with pytest.raises(DatasetError, match=rf"^{path}: row 1 \(0-based; line 2\): field '<utf-8>': not UTF-8 text "
                                           rf"\(byte 0xe9 at column {column}\)$"):
        load_prompt_dataset(str(path), TOK, max_prompt_length=32)
    dataset = load_prompt_dataset(str(path), TOK, max_prompt_length=32, on_bad_row="skip")
    assert dataset.uids == ["math_dapo-0", "math_dapo-2"]  # the byte-order mark did not spoil row 0
    assert dataset.stats["rows_skipped_malformed"] == 1


@pytest.mark.parametrize("content", [b"", b"PAR1\x00\x01", "truncated"], ids=["0-byte", "garbage", "truncated"])
def test_unreadable_parquet_names_the_file(tmp_path, content):
    path = tmp_path / "d.parquet"
    if content == "truncated":
        write_parquet(path, [make_row(index=i) for i in range(50)])
        path.write_bytes(path.read_bytes()[:-100])
    else:
        path.write_bytes(content)
    size = path.stat().st_size
    with pytest.raises(DatasetError, match=rf"^{path}: not a readable parquet file \({size} bytes; read 0 rows"):
        load_prompt_dataset(str(path), TOK, max_prompt_length=32, on_bad_row="skip")


def test_non_utf8_json_array_names_the_file(tmp_path):
    path = tmp_path / "d.json"
    path.write_bytes(b'[{"data_source": "caf\xe9"}]')
    with pytest.raises(DatasetError, match=rf"^{path}: not UTF-8 text \(byte 0xe9 at offset 21\)$"):
        load_prompt_dataset(str(path), TOK, max_prompt_length=32)


def test_numeric_ground_truth_becomes_text(tmp_path):
    rows = [make_row(truth=42), make_row(truth=42.0), make_row(truth=0.5)]
    dataset = load_prompt_dataset(
        write_jsonl(tmp_path / "d.jsonl", rows), TOK, max_prompt_length=16, uid_prefix="p"
    )
    assert [record.ground_truth for record in dataset] == ["42", "42", "0.5"]


def test_overflow_filter_counts_and_error_names_row_and_length(tmp_path):
    rows = [make_row("1+2="), make_row("1234+5678="), make_row("3+4=")]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    dataset = load_prompt_dataset(path, TOK, max_prompt_length=4, uid_prefix="p")
    assert dataset.uids == ["p-0", "p-2"]
    assert dataset.stats == {"rows_read": 3, "rows_skipped_malformed": 0, "rows_filtered_too_long": 1}
    with pytest.raises(
        DatasetError, match=r"row 1 \(0-based; line 2\): prompt has 10 tokens > max_prompt_length=4"
    ):
        load_prompt_dataset(path, TOK, max_prompt_length=4, prompt_overflow="error")


def test_without_chat_template_contents_are_joined_by_newlines(tmp_path):
    class RecordingTokenizer(CharTokenizer):
        def encode(self, text):
            return [len(text)]

    row = make_row()
    row["prompt"] = [{"role": "system", "content": "ab"}, {"role": "user", "content": "cd"}]
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    record = load_prompt_dataset(path, RecordingTokenizer(), max_prompt_length=16, apply_chat_template=False)[
        0
    ]
    assert record.raw_prompt == "ab\ncd" and record.prompt_ids == [5]
    record = load_prompt_dataset(path, RecordingTokenizer(), max_prompt_length=16)[0]
    assert record.raw_prompt == "abcd"  # CharTokenizer's template concatenates


def test_file_with_no_usable_row_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [make_row("1234567=")])
    with pytest.raises(DatasetError, match="no usable rows"):
        load_prompt_dataset(path, TOK, max_prompt_length=2)


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        ({"max_prompt_length": 0}, "max_prompt_length"),
        ({"max_prompt_length": 8, "prompt_overflow": "truncate"}, "prompt_overflow"),
        ({"max_prompt_length": 8, "on_bad_row": "ignore"}, "on_bad_row"),
        ({"max_prompt_length": 8, "uid_prefix": ""}, "uid_prefix"),
    ],
)
def test_bad_arguments_are_named(tmp_path, kwargs, argument):
    path = write_jsonl(tmp_path / "d.jsonl", [make_row()])
    with pytest.raises(ValueError, match=argument):
        load_prompt_dataset(path, TOK, **kwargs)


def test_missing_file_and_unknown_suffix(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompt_dataset(str(tmp_path / "nope.parquet"), TOK, max_prompt_length=8)
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unsupported file type '.csv'"):
        load_prompt_dataset(str(tmp_path / "d.csv"), TOK, max_prompt_length=8)


def test_prompt_dataset_rejects_duplicate_uids():
    record = PromptRecord(uid="u", prompt_ids=[1], raw_prompt="1", ground_truth="1", data_source="s")
    with pytest.raises(DatasetError, match="duplicate uid 'u' at records 0 and 1"):
        PromptDataset([record, record])
