"""Prompt datasets in the DAPO-Math-17k / AIME 2024 layout, read from parquet or JSON lines.

One row per prompt, with the columns
    data_source   str                          e.g. "math_dapo", "aime24"
    prompt        list of {"role", "content"}   chat messages, str fields
    reward_model  {"style", "ground_truth"}     ground_truth a str or a number
    ability       str                           optional, not used
    extra_info    dict or null                  optional; "index" (if any) names the row in the uid

Rows are numbered from 0 in file order (in a .jsonl file blank lines do not count; error
messages also give the 1-based line). A .jsonl line that is not UTF-8 is a malformed row (skipped
with ``on_bad_row="skip"``); a parquet file that cannot be read (empty, truncated) or a .json array
that is not UTF-8 is an error naming the file. ``load_prompt_dataset`` turns each row into a
``PromptRecord``: the prompt goes through the tokenizer's chat template (or is the message
contents joined by newlines when ``apply_chat_template=False``) and is tokenized without extra
special tokens.

uid of a row: ``f"{uid_prefix}-{row}"`` when ``uid_prefix`` is given, else
``f"{data_source}-{extra_info['index']}"`` when the row has an index, else
``f"{data_source}-{row}"``. uids key GRPO groups and the rollout queue, so two rows with the
same uid are an error (naming both rows); pass ``uid_prefix`` to number rows instead.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from megatron_dapo.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_REQUIRED_FIELDS = ("data_source", "prompt", "reward_model")
_PARQUET_BATCH_ROWS = 4096


class DatasetError(ValueError):
    """A data file or row that cannot be used; the message names the file, row and field."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt, ready for rollout.

    prompt_ids: token ids of ``raw_prompt`` (no padding). raw_prompt: the text that was tokenized
    (chat template applied). ground_truth: the reference answer as text.
    """

    uid: str
    prompt_ids: list[int]
    raw_prompt: str
    ground_truth: str
    data_source: str
    extra_info: dict = field(default_factory=dict)


class PromptDataset(Sequence):
    """An immutable sequence of PromptRecord with unique uids, and load statistics.

    stats: rows_read (rows in the source), rows_skipped_malformed, rows_filtered_too_long.
    """

    def __init__(self, records: Sequence[PromptRecord], stats: dict | None = None):
        self._records = tuple(records)
        first_position: dict[str, int] = {}
        for position, record in enumerate(self._records):
            if record.uid in first_position:
                raise DatasetError(
                    f"duplicate uid {record.uid!r} at records {first_position[record.uid]} and {position}"
                )
            first_position[record.uid] = position
        self.stats = (
            dict(stats)
            if stats is not None
            else {
                "rows_read": len(self._records),
                "rows_skipped_malformed": 0,
                "rows_filtered_too_long": 0,
            }
        )

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index):
        return self._records[index]

    @property
    def uids(self) -> list[str]:
        return [record.uid for record in self._records]

    def __repr__(self) -> str:
        return f"PromptDataset({len(self)} records, stats={self.stats})"


class _BadRow(Exception):
    def __init__(self, field_name: str, problem: str):
        super().__init__(f"field {field_name!r}: {problem}")


def _iter_rows(path: str) -> Iterator[tuple[int, str, dict | _BadRow]]:
    """Yield (row number, where, row or _BadRow) in file order; ``where`` locates the row for messages."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        row = 0
        try:
            batches = pq.ParquetFile(path).iter_batches(batch_size=_PARQUET_BATCH_ROWS)
            for batch in batches:
                for item in batch.to_pylist():
                    yield row, f"row {row} (0-based)", item
                    row += 1
        except (pa.ArrowException, OSError) as exc:
            size = os.path.getsize(path)
            raise DatasetError(f"{path}: not a readable parquet file ({size} bytes; read {row} rows before the "
                               f"error): {exc}") from None
    elif suffix in (".jsonl", ".json"):
        with open(path, "rb") as f:
            data = f.read().removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark is not part of the JSON
        if suffix == ".json" and data.lstrip().startswith(b"["):
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") \
                    from None
            try:
                items = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}: not valid JSON ({exc})") from exc
            for row, item in enumerate(items):
                yield (
                    row,
                    f"row {row} (0-based)",
                    item
                    if isinstance(item, dict)
                    else _BadRow("<row>", f"expected a JSON object, got {type(item).__name__}"),
                )
            return
        row = 0
        for line_number, raw in enumerate(data.splitlines(), start=1):
            if not raw.strip():
                continue
            where = f"row {row} (0-based; line {line_number})"
            try:
                item = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                item = _BadRow("<utf-8>", f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})")
            except json.JSONDecodeError as exc:
                item = _BadRow("<json>", f"not valid JSON ({exc.msg} at column {exc.colno})")
            else:
                if not isinstance(item, dict):
                    item = _BadRow("<row>", f"expected a JSON object, got {type(item).__name__}")
            yield row, where, item
            row += 1
    else:
        raise DatasetError(f"{path}: unsupported file type {suffix!r}; expected .parquet, .jsonl or .json")


def _parse_messages(value) -> list[dict]:
    if not isinstance(value, (list, tuple)) or not value:
        raise _BadRow(
            "prompt", f"expected a non-empty list of {{role, content}} messages, got {value!r:.200}"
        )
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise _BadRow("prompt", f"message {i} is {type(message).__name__}, expected a dict")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise _BadRow("prompt", f"message {i} has {key}={message.get(key)!r:.200}, expected a str")
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


def _parse_ground_truth(reward_model) -> str:
    if not isinstance(reward_model, dict):
        raise _BadRow("reward_model", f"expected a dict with 'ground_truth', got {reward_model!r:.200}")
    truth = reward_model.get("ground_truth")
    if isinstance(truth, str):
        if not truth.strip():
            raise _BadRow("reward_model.ground_truth", "is an empty string")
        return truth
    if isinstance(truth, bool) or not isinstance(truth, (int, float)):
        raise _BadRow("reward_model.ground_truth", f"expected a str or a number, got {truth!r:.200}")
    if isinstance(truth, float):
        if not math.isfinite(truth):
            raise _BadRow("reward_model.ground_truth", f"is {truth}")
        # 42.0 read back from a float column means the integer 42; write it as such.
        return str(int(truth)) if truth.is_integer() else repr(truth)
    return str(truth)


def _parse_row(item: dict) -> tuple[str, list[dict], str, dict]:
    for name in _REQUIRED_FIELDS:
        if name not in item:
            raise _BadRow(name, "missing")
    data_source = item["data_source"]
    if not isinstance(data_source, str) or not data_source:
        raise _BadRow("data_source", f"expected a non-empty str, got {data_source!r:.200}")
    messages = _parse_messages(item["prompt"])
    truth = _parse_ground_truth(item["reward_model"])
    extra_info = item.get("extra_info")
    if extra_info is None:
        extra_info = {}
    elif not isinstance(extra_info, dict):
        raise _BadRow("extra_info", f"expected a dict or null, got {type(extra_info).__name__}")
    return data_source, messages, truth, dict(extra_info)


def load_prompt_dataset(
    path: str,
    tokenizer: Tokenizer,
    *,
    max_prompt_length: int,
    prompt_overflow: str = "filter",
    on_bad_row: str = "raise",
    apply_chat_template: bool = True,
    uid_prefix: str | None = None,
) -> PromptDataset:
    """Read and tokenize a prompt file (see the module docstring for the layout and the uids).

    prompt_overflow: "filter" drops prompts longer than ``max_prompt_length`` tokens (counted in
    stats["rows_filtered_too_long"]); "error" raises DatasetError naming the row and its length.
    on_bad_row: "raise" raises DatasetError naming the file, row and field of a malformed row
    (a required field missing, a prompt that is not a non-empty list of role/content strings, a
    ground truth missing or not a str/number, a prompt the tokenizer cannot encode); "skip" drops
    it and counts it in stats["rows_skipped_malformed"]. A file with no usable row is an error.
    """
    if (
        isinstance(max_prompt_length, bool)
        or not isinstance(max_prompt_length, int)
        or max_prompt_length <= 0
    ):
        raise ValueError(f"max_prompt_length must be a positive int, got {max_prompt_length!r}")
    if prompt_overflow not in ("filter", "error"):
        raise ValueError(f"prompt_overflow must be 'filter' or 'error', got {prompt_overflow!r}")
    if on_bad_row not in ("raise", "skip"):
        raise ValueError(f"on_bad_row must be 'raise' or 'skip', got {on_bad_row!r}")
    if uid_prefix is not None and (not isinstance(uid_prefix, str) or not uid_prefix):
        raise ValueError(f"uid_prefix must be a non-empty str or None, got {uid_prefix!r}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file {path!r} does not exist")

    records: list[PromptRecord] = []
    row_of_uid: dict[str, int] = {}
    stats = {"rows_read": 0, "rows_skipped_malformed": 0, "rows_filtered_too_long": 0}
    skipped_messages: list[str] = []
    for row, where, item in _iter_rows(path):
        stats["rows_read"] += 1
        try:
            if isinstance(item, _BadRow):
                raise item
            data_source, messages, truth, extra_info = _parse_row(item)
            if apply_chat_template:
                text = tokenizer.apply_chat_template(messages)
            else:
                text = "\n".join(message["content"] for message in messages)
            try:
                prompt_ids = tokenizer.encode(text)
            except ValueError as exc:
                raise _BadRow("prompt", f"the tokenizer cannot encode it ({exc})") from exc
            if not prompt_ids:
                raise _BadRow("prompt", f"encodes to no tokens (content {text!r:.80}): nothing to generate from")
        except _BadRow as bad:
            message = f"{path}: {where}: {bad}"
            if on_bad_row == "raise":
                raise DatasetError(message) from None
            stats["rows_skipped_malformed"] += 1
            skipped_messages.append(message)
            continue

        if len(prompt_ids) > max_prompt_length:
            if prompt_overflow == "error":
                raise DatasetError(
                    f"{path}: {where}: prompt has {len(prompt_ids)} tokens > max_prompt_length="
                    f"{max_prompt_length} (set prompt_overflow='filter' to drop such rows)"
                )
            stats["rows_filtered_too_long"] += 1
            continue

        index = extra_info.get("index")
        if uid_prefix is not None:
            uid = f"{uid_prefix}-{row}"
        elif index is not None:
            uid = f"{data_source}-{index}"
        else:
            uid = f"{data_source}-{row}"
        if uid in row_of_uid:
            raise DatasetError(
                f"{path}: rows {row_of_uid[uid]} and {row} (0-based) have the same uid {uid!r}; "
                "uids must be unique: a file that repeats its problems (the published DAPO-Math-17k parquet "
                "holds each one many times) goes through `make data DAPO_MATH=<file>` first, which keeps one row "
                "per problem; any other file needs a distinct extra_info.index per row"
            )
        row_of_uid[uid] = row
        records.append(
            PromptRecord(
                uid=uid,
                prompt_ids=prompt_ids,
                raw_prompt=text,
                ground_truth=truth,
                data_source=data_source,
                extra_info=extra_info,
            )
        )

    if skipped_messages:
        logger.warning(
            "%s: skipped %d malformed rows; first: %s", path, len(skipped_messages), skipped_messages[0]
        )
    if not records:
        raise DatasetError(
            f"{path}: no usable rows (read {stats['rows_read']}, malformed {stats['rows_skipped_malformed']}, "
            f"longer than max_prompt_length={max_prompt_length}: {stats['rows_filtered_too_long']})"
        )
    return PromptDataset(records, stats)
