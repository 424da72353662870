"""Generate the config-key table of docs/configuration.md from the field docstrings of the config tree.

`python -m megatron_dapo.config.docs` prints the table; `--write docs/configuration.md` replaces the
block between the CONFIG-TABLE markers. A test keeps the page in sync with the schema.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import typing

from megatron_dapo.config.root import Config

BEGIN, END = "<!-- CONFIG-TABLE:BEGIN -->", "<!-- CONFIG-TABLE:END -->"
_RECIPE = re.compile(r"\s*\[recipe: ([^\]]+)\]\s*$")


def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings (the string literal right under each annotated field)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def rows(cls=Config, prefix: str = "", obj=None):
    """(key, default, meaning, recipe key) for every leaf field, depth first."""
    obj = obj if obj is not None else cls()
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(tp):
            yield from rows(tp, prefix + f.name + ".", value)
            continue
        doc = docs.get(f.name, "")
        m = _RECIPE.search(doc)
        recipe = m.group(1) if m else ""
        doc = _RECIPE.sub("", doc)
        yield prefix + f.name, value, doc, recipe


def _fmt(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def table() -> str:
    lines = ["| key | default | meaning | DAPO recipe key |", "|---|---|---|---|"]
    for key, default, doc, recipe in rows():
        cell = doc.replace("|", "\\|")
        lines.append(f"| `{key}` | `{_fmt(default)}` | {cell} | {f'`{recipe}`' if recipe else ''} |")
    return "\n".join(lines)


def replace_block(text: str, block: str, begin: str = BEGIN, end: str = END) -> str:
    start, stop = text.index(begin) + len(begin), text.index(end)
    return text[:start] + "\n" + block + "\n" + text[stop:]


def main(argv: list[str]) -> int:
    """`--write FILE` replaces the CONFIG-TABLE block (docs/configuration.md) or the VERL-TABLE block
    (docs/migrating-from-verl.md: config/verl.py's table) of FILE; without it, print the key table."""
    from megatron_dapo.config import verl

    if argv[:1] == ["--write"]:
        path = argv[1]
        text = open(path).read()
        if verl.BEGIN in text:
            text = replace_block(text, verl.table(), verl.BEGIN, verl.END)
        else:
            text = replace_block(text, table())
        open(path, "w").write(text)
        return 0
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
