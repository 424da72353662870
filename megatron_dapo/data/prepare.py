"""`make data`: validate DAPO-Math-17k and AIME-2024 parquet files and write the training files.

    python -m megatron_dapo.data.prepare --dapo-math PATH --aime PATH [--out-dir data] [--skip-bad]

Reads only the files given (no network). Writes, under --out-dir, the names the recipes use:
`dapo-math-17k.parquet`, `aime-2024.parquet`, and `prepare_report.json`.

Accepted input layouts, detected per file from its columns:
- "verl" (the layout the DAPO recipe's files already have): data_source (str), prompt (non-empty
  list of {role, content} messages), reward_model {ground_truth (str or number), style (str, optional)},
  and optionally ability (str) and extra_info (dict or null; a dict of scalars, e.g. {"index": ...}):
  the rows the loader accepts.
- "problem/answer" (plain question sets, e.g. an AIME table): a problem column (problem, Problem,
  question or Question) and an answer column (answer, Answer); optional id (id, ID). Each row is
  converted with the DAPO prompt template below, data_source "math_dapo" / "aime-2024",
  ability "MATH", reward_model {style "rule-lang", ground_truth = the answer as text},
  extra_info {"index": id or row number}.

Output: the verl layout with fixed column types (ground_truth always a str; a float that holds an
integer is written without ".0"; extra_info.index as a str), i.e. exactly the columns that
`megatron_dapo.data.dataset.load_prompt_dataset` reads. Exact duplicate rows (same data_source,
prompt and ground truth) are dropped, first kept: the published DAPO-Math-17k parquet repeats each
of its about 17k problems (1.79M rows), and the loader requires unique ids. Two different rows with the same
extra_info.index are a bad row (the later one).

Every row is validated; a bad row is reported with its 0-based row number in the input file and
the field at fault. With any bad row the exit code is 1 and nothing but the report is written,
unless --skip-bad, which drops bad rows (still reported) and exits 0. A file that is missing,
unreadable, in neither layout, or left with no good row exits 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

DAPO_PROMPT_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
"""The DAPO-Math-17k user prompt (what the reward's `Answer:` extraction expects)."""

OUTPUT_NAMES = {"dapo_math": "dapo-math-17k.parquet", "aime": "aime-2024.parquet"}
DEFAULT_DATA_SOURCE = {"dapo_math": "math_dapo", "aime": "aime-2024"}
REPORT_NAME = "prepare_report.json"
VERL_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
REQUIRED_VERL_COLUMNS = ("data_source", "prompt", "reward_model")  # what the loader needs; the rest optional
ROLES = ("system", "user", "assistant")
_PROBLEM_COLUMNS = ("problem", "Problem", "question", "Question")
_ANSWER_COLUMNS = ("answer", "Answer")
_ID_COLUMNS = ("id", "ID")
_BATCH_ROWS = 4096
_SHOWN_BAD_ROWS = 20          # per file on the console; the JSON report lists all

OUTPUT_SCHEMA_FIXED = {
    "data_source": pa.string(),
    "prompt": pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])),
    "ability": pa.string(),
    "reward_model": pa.struct([("style", pa.string()), ("ground_truth", pa.string())]),
}


class PrepareError(Exception):
    """A problem with a whole file (exit code 2), as opposed to a bad row."""


class BadRow(Exception):
    def __init__(self, field_name: str, problem: str):
        super().__init__(problem)
        self.field = field_name
        self.problem = problem


@dataclass
class FileReport:
    """What happened to one input file. Row numbers are 0-based positions in the input file."""

    name: str
    source: str
    layout: str = ""
    rows_read: int = 0
    rows_written: int = 0
    duplicates_dropped: int = 0
    bad_rows: list[dict] = field(default_factory=list)
    output: str | None = None


# --- validation of one row ------------------------------------------------------------------------

def _text(value, field_name: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise BadRow(field_name, f"expected a str, got {type(value).__name__} {value!r:.80}")
    if not allow_empty and not value.strip():
        raise BadRow(field_name, "is empty")
    return value


def _answer_text(value, field_name: str) -> str:
    """A ground truth as text: a non-empty str, or a finite number (42.0 -> "42")."""
    if isinstance(value, str):
        return _text(value, field_name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRow(field_name, f"expected a str or a number, got {type(value).__name__} {value!r:.80}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise BadRow(field_name, f"is {value}")
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)


def _messages(value) -> list[dict]:
    if not isinstance(value, list | tuple) or not value:
        raise BadRow("prompt", f"expected a non-empty list of {{role, content}} messages, got {value!r:.80}")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise BadRow(f"prompt[{i}]", f"expected a {{role, content}} dict, got {type(message).__name__}")
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise BadRow(f"prompt[{i}]", f"unexpected keys {extra}; a message has only role and content")
        role = _text(message.get("role"), f"prompt[{i}].role")
        if role not in ROLES:
            raise BadRow(f"prompt[{i}].role", f"expected one of {', '.join(ROLES)}, got {role!r}")
        out.append({"role": role, "content": _text(message.get("content"), f"prompt[{i}].content")})
    if not any(m["role"] == "user" for m in out):
        raise BadRow("prompt", "has no user message")
    return out


def _extra_info(value) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadRow("extra_info", f"expected a dict or null, got {type(value).__name__}")
    out = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise BadRow("extra_info", f"keys must be str, got {key!r}")
        if item is not None and not isinstance(item, str | int | float | bool):
            raise BadRow(f"extra_info.{key}", f"expected a scalar (str, number, bool or null), "
                                              f"got {type(item).__name__}")
        out[key] = item
    if out.get("index") is not None:
        out["index"] = str(out["index"])   # one column type across rows; the loader's uid text is unchanged
    return out or None                     # parquet cannot store a struct without fields


def validate_verl_row(item: dict) -> dict:
    """One row of the verl layout, checked and normalised; raises BadRow naming the field."""
    missing = [name for name in REQUIRED_VERL_COLUMNS if name not in item]
    if missing:
        raise BadRow(missing[0], "missing")
    reward_model = item["reward_model"]
    if not isinstance(reward_model, dict):
        raise BadRow("reward_model",
                     f"expected a {{style, ground_truth}} dict, got {type(reward_model).__name__}")
    if reward_model.get("ground_truth") is None:
        raise BadRow("reward_model.ground_truth", "missing")
    # ability, reward_model.style and extra_info are optional, as for the loader (which reads none of the first
    # two): absent, they are written as verl's files have them for math ("MATH", "rule") and null.
    ability, style = item.get("ability"), reward_model.get("style")
    return {
        "data_source": _text(item["data_source"], "data_source"),
        "prompt": _messages(item["prompt"]),
        "ability": "MATH" if ability is None else _text(ability, "ability"),
        "reward_model": {
            "style": "rule" if style is None else _text(style, "reward_model.style"),
            "ground_truth": _answer_text(reward_model["ground_truth"], "reward_model.ground_truth"),
        },
        "extra_info": _extra_info(item.get("extra_info")),
    }


def convert_problem_row(item: dict, *, row: int, columns: dict[str, str | None], data_source: str) -> dict:
    """One row of the problem/answer layout, converted to the verl layout with the DAPO prompt."""
    problem = _text(item.get(columns["problem"]), columns["problem"])
    answer = _answer_text(item.get(columns["answer"]), columns["answer"])
    index = item.get(columns["id"]) if columns["id"] else None
    if columns["id"] and index is None:
        raise BadRow(columns["id"], "missing")
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": DAPO_PROMPT_TEMPLATE.format(problem=problem.strip())}],
        "ability": "MATH",
        "reward_model": {"style": "rule-lang", "ground_truth": answer},
        "extra_info": {"index": str(index if index is not None else row)},
    }


def detect_layout(column_names: list[str]) -> tuple[str, dict[str, str | None]]:
    """("verl", {}) or ("problem/answer", {"problem": col, "answer": col, "id": col or None})."""
    names = set(column_names)
    if {"prompt", "reward_model"} <= names:
        return "verl", {}
    problem = next((c for c in _PROBLEM_COLUMNS if c in names), None)
    answer = next((c for c in _ANSWER_COLUMNS if c in names), None)
    if problem and answer:
        return "problem/answer", {"problem": problem, "answer": answer,
                                  "id": next((c for c in _ID_COLUMNS if c in names), None)}
    raise PrepareError(f"columns {sorted(names)} match neither layout: expected {list(VERL_COLUMNS)} "
                       f"or a problem column ({'/'.join(_PROBLEM_COLUMNS)}) and an answer column "
                       f"({'/'.join(_ANSWER_COLUMNS)})")


# --- one file ------------------------------------------------------------------------------------

def _row_key(row: dict) -> str:
    payload = json.dumps([row["data_source"], row["prompt"], row["reward_model"]["ground_truth"]],
                         sort_keys=True, ensure_ascii=True)
    return hashlib.sha1(payload.encode()).hexdigest()


def read_and_validate(path: str, *, name: str) -> tuple[list[dict], FileReport]:
    """Validate every row of one parquet file; return the good, de-duplicated rows and the report."""
    report = FileReport(name=name, source=path)
    if not os.path.isfile(path):
        raise PrepareError(f"{path}: no such file")
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise PrepareError(f"{path}: not a readable parquet file ({exc})") from None
    layout, columns = detect_layout(parquet.schema_arrow.names)
    report.layout = layout
    kept: list[dict] = []
    first_row_of_key: dict[str, int] = {}
    key_of_index: dict[tuple[str, str], tuple[str, int]] = {}
    row = 0
    for batch in parquet.iter_batches(batch_size=_BATCH_ROWS):
        for item in batch.to_pylist():
            try:
                if layout == "verl":
                    clean = validate_verl_row(item)
                else:
                    clean = convert_problem_row(item, row=row, columns=columns,
                                                data_source=DEFAULT_DATA_SOURCE[name])
                key = _row_key(clean)
                if key in first_row_of_key:
                    report.duplicates_dropped += 1
                    continue
                index = (clean["extra_info"] or {}).get("index")
                if index is not None:
                    other = key_of_index.get((clean["data_source"], index))
                    if other is not None and other[0] != key:
                        raise BadRow("extra_info.index", f"{index!r} is also the index of row {other[1]}, "
                                                         "whose prompt or answer differs")
                    key_of_index[(clean["data_source"], index)] = (key, row)
            except BadRow as bad:
                report.bad_rows.append({"row": row, "field": bad.field, "problem": bad.problem})
            else:
                first_row_of_key[key] = row
                kept.append(clean)
            finally:
                row += 1
    report.rows_read = row
    return kept, report


def write_training_parquet(rows: list[dict], path: str) -> None:
    """Write rows in the training layout (fixed column types; extra_info typed from its values)."""
    arrays = [pa.array([r[name] for r in rows], type=tp) for name, tp in OUTPUT_SCHEMA_FIXED.items()]
    extra = [r["extra_info"] for r in rows]
    extra_array = pa.array(extra) if any(e for e in extra) else pa.array(extra, type=pa.null())
    table = pa.Table.from_arrays(arrays + [extra_array], names=[*OUTPUT_SCHEMA_FIXED, "extra_info"])
    tmp = path + ".tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, path)    # never leave a half-written file under the name a recipe reads


# --- CLI -----------------------------------------------------------------------------------------

def _print_report(report: FileReport) -> None:
    print(f"{report.name}: {report.source} ({report.layout} layout): {report.rows_read} rows read, "
          f"{len(report.bad_rows)} bad, {report.duplicates_dropped} duplicates dropped, "
          f"{report.rows_written} written" + (f" to {report.output}" if report.output else ""))
    for bad in report.bad_rows[:_SHOWN_BAD_ROWS]:
        print(f"  bad row {bad['row']} (0-based): field {bad['field']!r}: {bad['problem']}")
    if len(report.bad_rows) > _SHOWN_BAD_ROWS:
        print(f"  ... and {len(report.bad_rows) - _SHOWN_BAD_ROWS} more (all in the JSON report)")


def prepare(inputs: dict[str, str], *, out_dir: str, skip_bad: bool = False) -> tuple[int, list[FileReport]]:
    """Validate and convert each input {name: path}; returns (exit code, reports).

    The JSON report is always written; the training files only when no row is bad, or with skip_bad.
    """
    results = [(name, *read_and_validate(path, name=name)) for name, path in inputs.items()]
    reports = [report for _, _, report in results]
    any_bad = any(report.bad_rows for report in reports)
    os.makedirs(out_dir, exist_ok=True)
    empty = [report.source for _, rows, report in results if not rows]
    if (skip_bad or not any_bad) and not empty:
        for name, rows, report in results:
            report.output = os.path.join(out_dir, OUTPUT_NAMES[name])
            write_training_parquet(rows, report.output)
            report.rows_written = len(rows)
    with open(os.path.join(out_dir, REPORT_NAME), "w") as f:
        json.dump({"row_numbers": "0-based positions in the input file",
                   "files": [vars(r) for r in reports]}, f, indent=2)
    if empty and (skip_bad or not any_bad):
        raise PrepareError(f"{', '.join(empty)}: no good rows, nothing written")
    return (1 if any_bad and not skip_bad else 0), reports


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_dapo.data.prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dapo-math", default=None, help="DAPO-Math-17k parquet (training prompts)")
    p.add_argument("--aime", default=None, help="AIME-2024 parquet (validation prompts)")
    p.add_argument("--out-dir", default="data", help="where the training files go (default: data)")
    p.add_argument("--skip-bad", action="store_true", help="drop bad rows (reported) instead of failing")
    args = p.parse_args(argv)
    if not args.dapo_math and not args.aime:
        p.error("give --dapo-math and/or --aime")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    inputs = {name: path for name, path in (("dapo_math", args.dapo_math), ("aime", args.aime)) if path}
    try:
        code, reports = prepare(inputs, out_dir=args.out_dir, skip_bad=args.skip_bad)
    except PrepareError as exc:
        print(f"prepare: {exc}", file=sys.stderr)
        return 2
    for report in reports:
        _print_report(report)
    if code:
        print(f"prepare: bad rows found; nothing written but {os.path.join(args.out_dir, REPORT_NAME)} "
              "(fix the rows, or pass --skip-bad to drop them)", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
