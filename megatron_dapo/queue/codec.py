"""Encode one field value of one queue entry to bytes, and back, without pickle.

Shapes: `N` keys in a put; a batch tensor field is `[N, ...]` and each key stores its own
row `[...]`; a per-key list field holds N values of any supported kind.

Three kinds, chosen from the value's type:
- "tensor":  torch.Tensor -> safetensors bytes (dtype and shape preserved, bf16 included).
             Stored from host memory; decoded tensors are CPU tensors.
- "ndarray": numpy.ndarray -> safetensors bytes (numpy flavour), decoded as ndarray.
- "json":    None, bool, int, float (NaN/inf kept), str, lists/tuples and str-keyed dicts
             of those; tuples come back as lists. numpy scalars are stored as the Python
             scalar they hold (`.item()`). Token lists are this kind.
Anything else is a TypeError that names the field and the key. Decoding only parses
safetensors headers and JSON text, so a tampered database cannot run code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import safetensors.numpy
import safetensors.torch
import torch

KIND_TENSOR = "tensor"
KIND_NDARRAY = "ndarray"
KIND_JSON = "json"
KINDS = (KIND_TENSOR, KIND_NDARRAY, KIND_JSON)

# The single tensor name inside each safetensors blob.
_ST_NAME = "v"
_JSON_SCALARS = (type(None), bool, int, float, str)


def encode_value(value: Any, *, field: str, key: str) -> tuple[str, bytes]:
    """Return `(kind, blob)` for one value; `field`/`key` only name the value in errors."""
    if isinstance(value, torch.Tensor):
        return KIND_TENSOR, _encode_tensor(value, field=field, key=key)
    if isinstance(value, np.ndarray):
        return KIND_NDARRAY, _encode_ndarray(value, field=field, key=key)
    return KIND_JSON, _encode_json(value, field=field, key=key)


def decode_value(kind: str, blob: bytes, *, field: str, key: str) -> Any:
    """Inverse of `encode_value`."""
    if kind == KIND_TENSOR:
        return safetensors.torch.load(bytes(blob))[_ST_NAME]
    if kind == KIND_NDARRAY:
        return safetensors.numpy.load(bytes(blob))[_ST_NAME]
    if kind == KIND_JSON:
        return json.loads(bytes(blob).decode("utf-8"))
    raise ValueError(f"field {field!r} of key {key!r}: stored kind {kind!r} is not one of {KINDS}")


def split_field(name: str, values: Any, keys: Sequence[str]) -> list[Any]:
    """Split one field given for a whole put into one value per key.

    `values` is either a tensor / ndarray whose first dimension is `len(keys)` (row i goes to
    key i) or a list / tuple of exactly `len(keys)` per-key values.
    """
    n = len(keys)
    if isinstance(values, (torch.Tensor, np.ndarray)):
        if values.ndim == 0 or values.shape[0] != n:
            raise ValueError(
                f"field {name!r}: a batch {type(values).__name__} must have first dimension "
                f"len(keys)={n}, got shape {tuple(values.shape)}"
            )
        if isinstance(values, np.ndarray):
            # np.asarray: a row of a 1-D array is a numpy scalar; keep it an (0-d) ndarray.
            return [np.asarray(values[i]) for i in range(n)]
        return [values[i] for i in range(n)]
    if isinstance(values, (list, tuple)):
        if len(values) != n:
            raise ValueError(f"field {name!r}: expected {n} values (one per key), got {len(values)}")
        return list(values)
    raise TypeError(
        f"field {name!r}: expected a tensor/ndarray with first dimension len(keys)={n} or a list "
        f"of {n} per-key values, got {type(values).__name__}"
    )


def encode_fields(keys: Sequence[str], fields: Mapping[str, Any]) -> list[tuple[str, str, str, bytes]]:
    """`(key, field name, kind, blob)` for every field of every key of a put."""
    if not isinstance(fields, Mapping):
        raise TypeError(f"fields: expected a dict of name -> values, got {type(fields).__name__}")
    rows = []
    for name, values in fields.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"field name {name!r}: expected a non-empty str")
        for k, v in zip(keys, split_field(name, values, keys), strict=True):
            rows.append((k, name, *encode_value(v, field=name, key=k)))
    return rows


def stack_values(name: str, values: list[Any]) -> Any:
    """Stack the per-key tensors (ndarrays) of one field into `[N, ...]`; JSON values stay a list."""
    if not any(isinstance(v, (torch.Tensor, np.ndarray)) for v in values):
        return values
    sigs = {
        (type(v).__name__, tuple(getattr(v, "shape", ())), str(getattr(v, "dtype", type(v)))) for v in values
    }
    if len(sigs) != 1:
        raise ValueError(
            f"get(stack=True): field {name!r} has differing per-key types/shapes/dtypes {sorted(sigs)[:4]}"
        )
    return torch.stack(values) if isinstance(values[0], torch.Tensor) else np.stack(values)


def _encode_tensor(t: torch.Tensor, *, field: str, key: str) -> bytes:
    if t.layout != torch.strided:
        raise TypeError(f"field {field!r} of key {key!r}: only dense tensors are supported, got {t.layout}")
    # .contiguous(): safetensors refuses strided views (e.g. a column slice of a batch).
    host = t.detach().to("cpu").contiguous()
    try:
        return safetensors.torch.save({_ST_NAME: host})
    except Exception as exc:  # safetensors raises several types for unsupported dtypes
        raise TypeError(
            f"field {field!r} of key {key!r}: cannot encode tensor of dtype {t.dtype}: {exc}"
        ) from exc


def _encode_ndarray(a: np.ndarray, *, field: str, key: str) -> bytes:
    try:
        return safetensors.numpy.save({_ST_NAME: np.ascontiguousarray(a)})
    except Exception as exc:
        raise TypeError(
            f"field {field!r} of key {key!r}: cannot encode ndarray of dtype {a.dtype}: {exc}"
        ) from exc


def _encode_json(value: Any, *, field: str, key: str) -> bytes:
    bad = _first_unsupported(value, "value")
    if bad is not None:
        path, what = bad
        raise TypeError(
            f"field {field!r} of key {key!r}: {path} is {what}; supported values are tensors, ndarrays, "
            f"None, bool, int, float, str, and lists / str-keyed dicts of these"
        )
    # allow_nan: NaN and +-inf rewards must round-trip; Python's json reads them back.
    return json.dumps(value, default=_numpy_scalar, allow_nan=True, separators=(",", ":")).encode("utf-8")


def _numpy_scalar(obj: Any) -> Any:
    # Only called for types json cannot write; _first_unsupported already let just numpy scalars through.
    return obj.item()


def _first_unsupported(value: Any, path: str) -> tuple[str, str] | None:
    """Walk a JSON candidate; return (path, description) of the first unsupported part, or None."""
    if isinstance(value, _JSON_SCALARS) or (isinstance(value, np.generic) and value.dtype.kind in "biuf"):
        return None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            # Fast path for long token lists: plain ints need no recursion.
            if type(item) is int:
                continue
            bad = _first_unsupported(item, f"{path}[{i}]")
            if bad is not None:
                return bad
        return None
    if isinstance(value, dict):
        for k, item in value.items():
            # json.dumps would silently turn int keys into strings; refuse rather than change the data.
            if not isinstance(k, str):
                return f"{path} key {k!r}", f"a {type(k).__name__} dict key (dict keys must be str)"
            bad = _first_unsupported(item, f"{path}[{k!r}]")
            if bad is not None:
                return bad
        return None
    return path, f"of unsupported type {type(value).__name__}"
