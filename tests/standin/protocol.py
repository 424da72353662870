"""One SGLang release's HTTP protocol, loaded from tests/assets/sglang/protocol-<version>.json
(written by tools/sglang_protocol.py from the release's wheel), and request validation that reacts
the way that release does.

What SGLang does with a request, as read in its source (FastAPI parses the body into the route's
io_struct class; pydantic ignores unknown keys of dataclasses and, through the msgspec schema of
0.5.15+, of structs; a type error or a missing required field is a RequestValidationError, which
SGLang's handler turns into HTTP 400 with an ErrorResponse body):

- unknown request fields: ignored (all releases). The stand-in records them so a test can assert
  the client sends none (an ignored field is a silent no-op, e.g. `selector` before 0.5.21);
- unknown sampling parameters: before 0.5.22 `SamplingParams(**params)` raises TypeError inside
  the tokenizer manager, which no handler catches: HTTP 500 "Internal Server Error"; from 0.5.22 the
  JSON contract (sglang/api/v1) rejects them first: HTTP 400 `{"error": "unknown field ..."}`;
- bad sampling values: SamplingParams.verify raises ValueError: HTTP 400 `{"error": {"message"}}`.
"""

from __future__ import annotations

import ast
import functools
import json
import math
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "sglang"
DEFAULT_VERSION = "0.5.23"


def available_versions() -> list[str]:
    return sorted((p.stem.removeprefix("protocol-") for p in ASSETS.glob("protocol-*.json")), key=version_key)


def version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".")[:3])


class RequestError(Exception):
    """A request SGLang refuses: `status` and the JSON (or text) body it answers with."""

    def __init__(self, status: int, body: Any):
        super().__init__(f"HTTP {status}: {body}")
        self.status, self.body = status, body


def validation_error(cls: str, loc: str, msg: str, value: Any) -> RequestError:
    """SGLang's answer to a RequestValidationError: 400 with an ErrorResponse naming the field."""
    text = f"1 validation error for {cls}\n{loc}\n  {msg} [input_value={value!r:.80}]"
    return RequestError(400, {"object": "error", "message": text, "type": "Bad Request", "param": None,
                              "code": 400})


def value_error(message: str) -> RequestError:
    """A ValueError raised while SGLang handles /generate: HTTP 400 {"error": {"message": ...}}."""
    return RequestError(400, {"error": {"message": message}})


# ----------------------------------------------------------------------------- annotation checks


@functools.cache
def _parse_type(text: str) -> ast.expr:
    return ast.parse(text, mode="eval").body


def _name(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _args(node: ast.Subscript) -> list[ast.expr]:
    return list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]


def matches(value: Any, node: ast.expr) -> bool:
    """Does a JSON value fit the annotation `node` (pydantic-like, lax for int -> float)? Names the
    stand-in does not know (SGLang's own aliases and classes) accept anything."""
    if isinstance(node, ast.Constant):
        return value is None if node.value is None else True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return matches(value, node.left) or matches(value, node.right)
    if isinstance(node, ast.Subscript):
        head, args = _name(node.value), _args(node)
        if head == "Optional":
            return value is None or matches(value, args[0])
        if head == "Union":
            return any(matches(value, a) for a in args)
        if head in ("Annotated", "A"):
            return matches(value, args[0])
        if head == "Literal":
            return any(isinstance(a, ast.Constant) and a.value == value for a in args)
        if head in ("List", "list", "Set", "set", "Sequence"):
            return isinstance(value, list) and all(matches(v, args[0]) for v in value)
        if head in ("Tuple", "tuple"):
            return isinstance(value, list)
        if head in ("Dict", "dict"):
            return isinstance(value, dict) and all(matches(v, args[-1]) for v in value.values())
        return True
    name = _name(node)
    if name == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if name == "str":
        return isinstance(value, str)
    if name == "bool":
        return isinstance(value, bool)
    if name == "bytes":
        return isinstance(value, str)  # base64 text in JSON
    if name in ("dict", "Dict"):
        return isinstance(value, dict)
    if name in ("list", "List"):
        return isinstance(value, list)
    if name == "None":
        return value is None
    return True


class Protocol:
    """The protocol of one release (the committed JSON) and the checks that use it."""

    def __init__(self, version: str = DEFAULT_VERSION):
        path = ASSETS / f"protocol-{version}.json"
        if not path.exists():
            raise ValueError(f"no protocol asset for SGLang {version}; have {available_versions()} "
                             f"(tools/sglang_protocol.py --download {version} --out {ASSETS})")
        self.data = json.loads(path.read_text())
        self.version = self.data["sglang_version"]
        self.key = version_key(self.version)
        self.routes: dict[str, dict] = self.data["routes"]
        self.classes: dict[str, dict] = self.data["request_classes"]
        self.sampling_fields: dict[str, dict] = self.data["sampling_params"]
        self.contract = self.data["api_contract"]
        self.meta_info_keys = set(self.data["meta_info_keys"])
        self.launch_flags: dict[str, str] = self.data["launch_flags"]

    def at_least(self, version: str) -> bool:
        return self.key >= version_key(version)

    def has_route(self, path: str, method: str) -> bool:
        r = self.routes.get(path)
        return r is not None and method in r["methods"]

    def request_fields(self, path: str) -> dict[str, dict] | None:
        cls = self.routes.get(path, {}).get("request_class")
        return None if cls is None or cls not in self.classes else self.classes[cls]["fields"]

    def check_body(self, path: str, body: Any) -> list[str]:
        """Validate a JSON body against the route's request class; return the unknown (ignored) keys."""
        cls = self.routes[path]["request_class"]
        fields = self.request_fields(path)
        if fields is None:
            return []
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise validation_error(cls, "body", "Input should be a valid dictionary", body)
        for name, spec in fields.items():
            if name not in body:
                if spec["required"]:
                    raise validation_error(cls, f"body.{name}", "Field required", body)
                continue
            if not matches(body[name], _parse_type(spec["type"])):
                raise validation_error(cls, f"body.{name}", f"Input should match {spec['type']}", body[name])
        return sorted(set(body) - set(fields))

    def check_sampling_params(self, params: Any) -> None:
        """The checks SGLang runs on one item's sampling_params dict before any generation."""
        if not isinstance(params, dict):
            raise value_error(f"sampling_params must be an object, got {type(params).__name__}")
        if self.contract is not None:  # 0.5.22+: the JSON contract first, 400 with serde's text
            spec = self.contract["SamplingParams"]
            names = list(spec["fields"])
            for key, value in params.items():
                if key not in spec["fields"]:
                    listed = ", ".join(f"`{n}`" for n in names)
                    raise RequestError(400, {"error": f"unknown field `{key}`, expected one of {listed}"})
                if not matches(value, _parse_type(spec["fields"][key]["type"])):
                    raise RequestError(400, {"error": f"invalid type for `{key}`: {value!r}"})
        unknown = sorted(set(params) - set(self.sampling_fields))
        if unknown:
            # SamplingParams(**params) -> TypeError, uncaught: Starlette's plain 500.
            raise RequestError(500, "Internal Server Error")
        verify_sampling(params)


def verify_sampling(p: dict) -> None:
    """SamplingParams.__post_init__ / verify: the value checks (ValueError -> 400)."""
    t = p.get("temperature")
    t = 1.0 if t is None else t
    if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise value_error(f"temperature must be a non-negative finite number, got {t}.")
    top_p = 1.0 if p.get("top_p") is None else p["top_p"]
    if not 0.0 < top_p <= 1.0:
        raise value_error(f"top_p must be in (0, 1], got {top_p}.")
    top_k = -1 if p.get("top_k") is None else p["top_k"]
    if top_k != -1 and top_k < 1:
        raise value_error(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    min_p = 0.0 if p.get("min_p") is None else p["min_p"]
    if not 0.0 <= min_p <= 1.0:
        raise value_error(f"min_p must be in [0, 1], got {min_p}.")
    mx = p.get("max_new_tokens", 128)
    mn = p.get("min_new_tokens") or 0
    if mx is not None and mx < 0:
        raise value_error(f"max_new_tokens must be at least 0, got {mx}.")
    if mx is not None and not 0 <= mn <= mx:
        raise value_error(f"min_new_tokens must be in [0, max_new_tokens({mx})], got {mn}.")
    seed = p.get("sampling_seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not -(2**63) <= seed < 2**63):
        raise value_error(f"sampling_seed must be an integer in [-2**63, 2**63 - 1], got {seed!r}.")
