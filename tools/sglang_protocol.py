"""Extract SGLang's HTTP protocol from a release wheel, by reading its source with `ast` (never importing it).

    python tools/sglang_protocol.py --download 0.5.8 0.5.23 --out tests/assets/sglang
    python tools/sglang_protocol.py path/to/sglang-0.5.23-...whl --out tests/assets/sglang

writes `protocol-<version>.json` per release, holding what a client and a stand-in server need:

- `routes`: every constant path of `sglang/srt/entrypoints/http_server.py` with its HTTP methods and
  the request class of its `obj` parameter (FastAPI validates the JSON body against that class);
- `request_classes`: the fields (annotation text, required or not) of the request classes in
  `sglang/srt/managers/io_struct.py` named in REQUEST_CLASSES, inherited fields first;
- `sampling_params`: the keyword parameters `SamplingParams(**params)` accepts (`__init__` up to
  0.5.14, the struct fields from 0.5.15 when SamplingParams became a msgspec Struct), and from 0.5.22
  the JSON contract of `sglang/api/v1/api_types.py` (fields of GenerateRequest and SamplingParams
  and whether each rejects or ignores unknown keys);
- `meta_info_keys`: every literal key the tokenizer manager sets on a reply's `meta_info`
  (`spec_*` are the speculative-decoding counters);
- `launch_flags`: every `--flag` of `python -m sglang.launch_server` with its kind (`switch` takes no
  value, `value` one, `values` one or more), from `add_argument` calls and, from 0.5.20, from the
  annotated fields of `sglang/srt/arg_groups/fields/*.py` that become flags.

The JSON is a reading of the source, not of a running server; tests/standin loads it to speak the
release, and tests/standin/test_protocol_assets.py (slow) re-extracts the wheels and compares.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REQUEST_CLASSES = (
    "GenerateReqInput",
    "AbortReq",
    "FlushCacheReqInput",
    "ReleaseMemoryOccupationReqInput",
    "ResumeMemoryOccupationReqInput",
    "InitWeightsUpdateGroupReqInput",
    "DestroyWeightsUpdateGroupReqInput",
    "UpdateWeightsFromDistributedReqInput",
    "UpdateWeightsFromTensorReqInput",
    "UpdateWeightFromDiskReqInput",
    "BeginWeightUpdateReqInput",
    "EndWeightUpdateReqInput",
    "GetWeightsByNameReqInput",
    "UpdateWeightVersionReqInput",
)
"""The request classes megatron_dapo's client (or the stand-in) touches."""

FORMAT_VERSION = 1
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
SAMPLING = "sglang/srt/sampling/sampling_params.py"
API_TYPES = "sglang/api/v1/api_types.py"
TOKENIZER_MANAGER = "sglang/srt/managers/tokenizer_manager.py"
SERVER_ARGS = "sglang/srt/server_args.py"
ARG_GROUPS = "sglang/srt/arg_groups/"
ARG_FIELDS = "sglang/srt/arg_groups/fields/"
_HTTP_DECORATORS = {"get": ["GET"], "post": ["POST"], "put": ["PUT"], "delete": ["DELETE"]}


def _parse(src: str, where: str) -> ast.Module:
    try:
        return ast.parse(src)
    except SyntaxError as e:
        raise ValueError(f"{where}: cannot parse ({e})") from e


def _const_str(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _top_classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _base_name(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _field_has_default(value) -> bool:
    """A class-level `x: T = value`: `field(...)` without default / default_factory is required."""
    if value is None:
        return False
    if isinstance(value, ast.Call) and _base_name(value.func) == "field":
        return any(k.arg in ("default", "default_factory") for k in value.keywords)
    return True


def class_fields(classes: dict[str, ast.ClassDef], name: str) -> dict[str, dict]:
    """Annotated fields of class `name` with those of its bases defined in the same module first."""
    cls = classes[name]
    out: dict[str, dict] = {}
    for base in cls.bases:
        b = _base_name(base)
        if b in classes and b != name:
            out.update(class_fields(classes, b))
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            ann = ast.unparse(stmt.annotation)
            if ann.startswith(("ClassVar", "typing.ClassVar")):
                continue
            out[stmt.target.id] = {"type": ann, "required": not _field_has_default(stmt.value)}
    return out


def request_classes(io_src: str) -> dict[str, dict]:
    classes = _top_classes(_parse(io_src, IO_STRUCT))
    return {name: {"fields": class_fields(classes, name)} for name in REQUEST_CLASSES if name in classes}


def _request_class_of(fn: ast.AsyncFunctionDef | ast.FunctionDef) -> str | None:
    """The class of the route function's body parameter (`obj: X` or `obj: Annotated[X, Body()]`)."""
    for arg in fn.args.args:
        if arg.arg != "obj" or arg.annotation is None:
            continue
        ann = arg.annotation
        if isinstance(ann, ast.Subscript) and _base_name(ann.value) in ("Annotated", "A"):
            elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
            ann = elts[0]
        if isinstance(ann, ast.Subscript) and _base_name(ann.value) == "Optional":
            ann = ann.slice
        return _base_name(ann)
    return None


def routes(http_src: str) -> dict[str, dict]:
    """path -> {"methods": [...], "request_class": name | None} for every constant route path."""
    out: dict[str, dict] = {}
    for fn in ast.walk(_parse(http_src, HTTP_SERVER)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)):
                continue
            if _base_name(dec.func.value) != "app" or not dec.args:
                continue
            path = _const_str(dec.args[0])
            if path is None:
                continue  # a path read from the environment (vertex / ollama routes)
            kind = dec.func.attr
            if kind in _HTTP_DECORATORS:
                methods = _HTTP_DECORATORS[kind]
            elif kind == "api_route":
                kw = {k.arg: k.value for k in dec.keywords}
                m = kw.get("methods")
                methods = [e.value for e in m.elts] if isinstance(m, ast.List) else ["GET"]
            else:
                continue  # websocket, exception handlers
            entry = out.setdefault(path, {"methods": [], "request_class": _request_class_of(fn)})
            entry["methods"] = sorted(set(entry["methods"]) | set(methods))
    return dict(sorted(out.items()))


def sampling_params(sampling_src: str) -> dict[str, dict]:
    """Keywords `SamplingParams(**params)` accepts: its `__init__` parameters, else its struct fields."""
    cls = _top_classes(_parse(sampling_src, SAMPLING)).get("SamplingParams")
    if cls is None:
        raise ValueError(f"{SAMPLING}: no class SamplingParams")
    init = next((s for s in cls.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
    if init is None:
        return class_fields({"SamplingParams": cls}, "SamplingParams")
    args = init.args.args[1:] + init.args.kwonlyargs
    n_pos_defaults = len(init.args.defaults)
    out = {}
    for i, a in enumerate(args):
        if i < len(init.args.args) - 1:
            has_default = i >= len(init.args.args) - 1 - n_pos_defaults
        else:
            has_default = init.args.kw_defaults[i - (len(init.args.args) - 1)] is not None
        out[a.arg] = {"type": ast.unparse(a.annotation) if a.annotation else "Any", "required": not has_default}
    return out


def api_contract(api_src: str) -> dict[str, dict]:
    """GenerateRequest and SamplingParams of the generated JSON contract (0.5.22+): fields and the
    unknown-key policy stated in each struct's docstring ("unknown keys rejected" / "ignored")."""
    classes = _top_classes(_parse(api_src, API_TYPES))
    out = {}
    for name in ("GenerateRequest", "SamplingParams"):
        cls = classes.get(name)
        if cls is None:
            raise ValueError(f"{API_TYPES}: no struct {name}")
        doc = ast.get_docstring(cls) or ""
        m = re.search(r"unknown keys (rejected|ignored)", doc)
        if m is None:
            raise ValueError(f"{API_TYPES}: {name} docstring does not state its unknown-key policy")
        out[name] = {"unknown_keys": "reject" if m.group(1) == "rejected" else "ignore",
                     "fields": class_fields(classes, name)}
    return out


def meta_info_keys(tm_src: str) -> list[str]:
    """Literal keys set on a variable named `meta_info`: `meta_info = {...}`, `meta_info["k"] = ...`,
    `meta_info.update({...})`."""
    keys: set[str] = set()
    for node in ast.walk(_parse(tm_src, TOKENIZER_MANAGER)):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name) and t.id == "meta_info" and isinstance(node.value, ast.Dict):
                    keys.update(k for k in map(_const_str, node.value.keys) if k)
                if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == "meta_info"
                        and _const_str(t.slice)):
                    keys.add(_const_str(t.slice))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
              and isinstance(node.func.value, ast.Name) and node.func.value.id == "meta_info"
              and node.args and isinstance(node.args[0], ast.Dict)):
            keys.update(k for k in map(_const_str, node.args[0].keys) if k)
    return sorted(keys)


def _switch_actions(trees: list[ast.Module]) -> set[str]:
    """argparse.Action subclasses whose __init__ defaults nargs to 0 (they take no value)."""
    out = set()
    for tree in trees:
        for cls in ast.walk(tree):
            if not isinstance(cls, ast.ClassDef):
                continue
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                    a = fn.args
                    pos = a.args[len(a.args) - len(a.defaults):]
                    pairs = list(zip(pos, a.defaults)) + list(zip(a.kwonlyargs, a.kw_defaults))
                    if any(p.arg == "nargs" and isinstance(d, ast.Constant) and d.value == 0 for p, d in pairs):
                        out.add(cls.name)
    return out


def _kind_of_action(action, nargs, switch_actions: set[str]) -> str:
    name = _const_str(action) if action is not None else None
    if name is None and action is not None:
        name = _base_name(action)
    if name in ("store_true", "store_false", "store_const", "count") or name in switch_actions:
        return "switch"
    if name == "BooleanOptionalAction":
        return "switch"
    n = _const_str(nargs) if nargs is not None else None
    if n in ("+", "*") or (isinstance(nargs, ast.Constant) and isinstance(nargs.value, int) and nargs.value > 1):
        return "values"
    if n == "?":
        return "optional_value"
    return "value"


def _add_argument_flags(tree: ast.Module, switch_actions: set[str]) -> dict[str, str]:
    out = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        names = [s for s in map(_const_str, node.args) if s and s.startswith("-")]
        if not names:
            continue
        kw = {k.arg: k.value for k in node.keywords}
        kind = _kind_of_action(kw.get("action"), kw.get("nargs"), switch_actions)
        for n in names:
            out[n] = kind
        if _base_name(kw.get("action")) == "BooleanOptionalAction":
            for n in names:
                if n.startswith("--"):
                    out["--no-" + n[2:]] = "switch"
    return out


def _unwrap_optional(node):
    if isinstance(node, ast.Subscript) and _base_name(node.value) == "Optional":
        return node.slice
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        sides = [s for s in (node.left, node.right) if not (isinstance(s, ast.Constant) and s.value is None)]
        if len(sides) == 1:
            return sides[0]
    return node


def _field_flags(tree: ast.Module, switch_actions: set[str]) -> dict[str, str]:
    """Flags of `name: A[T, "help"]` / `A[T, Arg(...)]` fields (the arg_groups layout, 0.5.20+):
    `--name-with-dashes` (or Arg.cli_name) plus Arg.aliases; Arg.no_cli fields have none."""
    out = {}
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for stmt in cls.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            ann = stmt.annotation
            if not (isinstance(ann, ast.Subscript) and _base_name(ann.value) in ("A", "Annotated")
                    and isinstance(ann.slice, ast.Tuple) and len(ann.slice.elts) >= 2):
                continue
            typ, meta = ann.slice.elts[0], ann.slice.elts[1]
            kw = {}
            if isinstance(meta, ast.Call) and _base_name(meta.func) == "Arg":
                kw = {k.arg: k.value for k in meta.keywords}
            elif _const_str(meta) is None:
                continue  # not a CLI annotation
            if isinstance(kw.get("no_cli"), ast.Constant) and kw["no_cli"].value is True:
                continue
            cli = _const_str(kw.get("cli_name")) if "cli_name" in kw else None
            names = [cli or "--" + stmt.target.id.replace("_", "-")]
            if isinstance(kw.get("aliases"), ast.List):
                names += [s for s in map(_const_str, kw["aliases"].elts) if s]
            inner = _unwrap_optional(typ)
            if "action" in kw:
                kind = _kind_of_action(kw["action"], kw.get("nargs"), switch_actions)
            elif isinstance(inner, ast.Name) and inner.id == "bool":
                kind = "switch"
            elif (isinstance(inner, ast.Subscript) and _base_name(inner.value) in ("List", "list")
                  and "type_parser" not in kw):
                kind = "values" if _const_str(kw.get("nargs")) in (None, "+", "*") else "value"
            else:
                kind = _kind_of_action(None, kw.get("nargs"), switch_actions)
            for n in names:
                out[n] = kind
    return out


def launch_flags(files: dict[str, str]) -> dict[str, str]:
    paths = [p for p in files if p == SERVER_ARGS or p.startswith(ARG_GROUPS)]
    trees = [_parse(files[p], p) for p in sorted(paths)]
    switch = _switch_actions(trees)
    out: dict[str, str] = {}
    for p, tree in zip(sorted(paths), trees):
        if p.startswith(ARG_FIELDS):
            out.update(_field_flags(tree, switch))
        out.update(_add_argument_flags(tree, switch))
    return dict(sorted(out.items()))


def read_wheel(path: str | Path) -> tuple[str, dict[str, str]]:
    """(version, {path: source}) of the files this tool reads from the wheel."""
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        meta = next((n for n in names if n.endswith(".dist-info/METADATA")), None)
        if meta is None:
            raise ValueError(f"{path}: not a wheel (no .dist-info/METADATA)")
        version = next((line.split(":", 1)[1].strip() for line in z.read(meta).decode().splitlines()
                        if line.startswith("Version:")), None)
        if version is None:
            raise ValueError(f"{path}: METADATA has no Version")
        wanted = {HTTP_SERVER, IO_STRUCT, SAMPLING, API_TYPES, TOKENIZER_MANAGER, SERVER_ARGS}
        files = {n: z.read(n).decode() for n in names
                 if n in wanted or (n.startswith(ARG_GROUPS) and n.endswith(".py"))}
    for need in (HTTP_SERVER, IO_STRUCT, SAMPLING, TOKENIZER_MANAGER, SERVER_ARGS):
        if need not in files:
            raise ValueError(f"{path}: the wheel has no {need}")
    return version, files


def extract(wheel: str | Path) -> dict:
    """The protocol of one release (see the module docstring for the layout)."""
    version, files = read_wheel(wheel)
    digest = hashlib.sha256(Path(wheel).read_bytes()).hexdigest()
    return {
        "format": FORMAT_VERSION,
        "sglang_version": version,
        "wheel": {"name": Path(wheel).name, "sha256": digest},
        "routes": routes(files[HTTP_SERVER]),
        "request_classes": request_classes(files[IO_STRUCT]),
        "sampling_params": sampling_params(files[SAMPLING]),
        "api_contract": api_contract(files[API_TYPES]) if API_TYPES in files else None,
        "meta_info_keys": meta_info_keys(files[TOKENIZER_MANAGER]),
        "launch_flags": launch_flags(files),
    }


def dumps(protocol: dict) -> str:
    """The committed text form (stable: sorted keys, one field per line)."""
    return json.dumps(protocol, indent=1, sort_keys=True) + "\n"


def download_wheel(version: str, dest: str | Path) -> Path:
    """`pip download --no-deps sglang==version` into dest; the wheel's path."""
    dest = Path(dest)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", f"sglang=={version}",
                    "-d", str(dest)], check=True, stdout=subprocess.DEVNULL)
    found = sorted(dest.glob(f"sglang-{version}-*.whl"))
    if not found:
        raise FileNotFoundError(f"pip download left no sglang-{version}-*.whl in {dest}")
    return found[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheels", nargs="*", help="sglang wheel files")
    ap.add_argument("--download", nargs="*", default=[], metavar="VERSION", help="releases to fetch with pip")
    ap.add_argument("--out", required=True, help="directory for protocol-<version>.json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheels = list(args.wheels) + [download_wheel(v, tmp) for v in args.download]
        if not wheels:
            ap.error("give wheels or --download VERSION ...")
        for w in wheels:
            p = extract(w)
            target = out / f"protocol-{p['sglang_version']}.json"
            target.write_text(dumps(p))
            print(f"{w} -> {target} ({len(p['routes'])} routes, {len(p['launch_flags'])} flags)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
