"""Layering guard rails (STYLE.md, DESIGN.md): lower packages never import higher ones, and no two
modules import each other (function-level imports included: a lazy import is still a dependency)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "megatron_dapo"

# package -> packages it must never import (directly or lazily).
FORBIDDEN = {
    "algos": ("trainer", "workers", "rollout", "models", "queue"),
    "kernels": ("trainer", "workers", "rollout", "models", "queue"),
    "models": ("trainer", "workers", "rollout", "queue"),
    "workers": ("trainer", "rollout", "queue"),
    "rollout": ("trainer", "workers"),
    "metrics": ("trainer", "workers"),  # metrics read the engine contract (rollout.base) by design
    "rewards": ("trainer", "workers", "rollout"),
    "data": ("trainer", "workers", "rollout"),
    "queue": ("trainer", "workers"),
}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports() -> dict[str, set[str]]:
    """module -> the megatron_dapo modules it imports anywhere in its body."""
    out: dict[str, set[str]] = {}
    files = [p for p in PKG.rglob("*.py") if "kernels" not in p.relative_to(PKG).parts[:1]]
    files += list((ROOT / "kernels").glob("*.py"))
    for path in files:
        name = _module_name(path) if path.is_relative_to(PKG) else "megatron_dapo.kernels." + path.stem
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.startswith("megatron_dapo"):
                    deps.add(node.module)
                    deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("megatron_dapo"))
        out[name] = deps
    known = set(out)
    return {m: {d for d in deps if d in known and d != m} for m, deps in out.items()}


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else None


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_lower_packages_do_not_import_higher_ones(package):
    bad = sorted(f"{m} imports {d}" for m, deps in _imports().items() if _package(m) == package
                 for d in deps if _package(d) in FORBIDDEN[package])
    assert not bad, "\n".join(bad)


def test_no_two_modules_import_each_other():
    graph = _imports()
    pairs = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps
                    if a in graph.get(b, ()) and not (a.endswith("__init__") or b.endswith("__init__"))})
    pairs = [(a, b) for a, b in pairs if not (b.startswith(a + ".") or a.startswith(b + "."))]  # a package and its own module
    assert not pairs, pairs
