"""Does a megatron-core release still have every name and keyword this project uses?

    python tools/mcore_api_check.py                        # against the installed megatron-core
    python tools/mcore_api_check.py --tree DIR             # DIR holds megatron/core (an unpacked wheel)
    python tools/mcore_api_check.py --wheel FILE.whl       # read the wheel as a zip, no install
    python tools/mcore_api_check.py --list                 # print what the project uses, then check

Both sides are read with `ast`, nothing is imported: megatron-core 0.17 and later ship cp312 wheels
only, and this checks them from Python 3.11 all the same.

The project's uses are found in its own source (megatron_dapo/, kernels/, benchmarks/, tests/,
tools/), not in a hand-kept list:
  - names: every `import megatron.core.a.b [as x]` and `from megatron.core[.a] import n [as x]`,
    and every attribute read on such a binding (`ps.initialize_model_parallel`, `td.X`);
    assignments (`moe_utils.te_general_gemm = None`, a shim) define a name rather than use one;
  - keywords of every call whose callee resolves to a megatron-core function or class:
    the literal keywords, and the keys of dicts passed as `**kwargs`, traced through local
    `d = dict(...)` / `{...}` / `d.update(...)` / `d[k] = ...`, `a or b`, `x if c else y`,
    calls to project functions (their returned dict) and function parameters (the values passed
    at the project's call sites, also through a caller's own `**kwargs`).
Megatron's side: a callee's keywords are its `def` parameters; a class takes those of the first
`__init__` in its (megatron-core) bases, or its dataclass fields (TransformerConfig and its base
ModelParallelConfig); a callee with `**kwargs`, or whose bases leave megatron-core, accepts any.

Exit status 0 when everything is found, 1 with one line per missing name or keyword (each with the
project file and line that uses it), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCAN_DIRS = ("megatron_dapo", "kernels", "benchmarks", "tests", "tools")
ROOT_PACKAGE = "megatron.core"
_MAX_DEPTH = 8    # hops when tracing the keys of a **kwargs dict (the project's longest chain is 4)


# --- the project's side: what it uses -------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Use:
    """One use: `path` is dotted from megatron.core; `keyword` is set for a call's keyword."""

    path: str
    keyword: str | None         # "=" for an assignment to the attribute `path`
    where: str          # "megatron_dapo/models/builder.py:97"

    def describe(self) -> str:
        if self.keyword == "=":
            return f"{self.path} = ..."
        return f"{self.path}(..., {self.keyword}=...)" if self.keyword else self.path


@dataclasses.dataclass
class _Module:
    rel: str
    tree: ast.Module
    bindings: dict[str, str]      # local name -> dotted megatron.core path
    parents: dict[ast.AST, ast.AST]
    nodes: list[ast.AST]          # every node of the file, parents before children


def _project_files(repo: Path) -> Iterator[Path]:
    for top in SCAN_DIRS:
        for path in sorted((repo / top).rglob("*.py")):
            if not any(part.startswith(".venv") for part in path.relative_to(repo).parts):
                yield path


def _walk_with_parents(tree: ast.AST) -> tuple[list[ast.AST], dict[ast.AST, ast.AST]]:
    """Every node (one pass) and each node's parent."""
    nodes, parents, stack = [], {}, [tree]
    while stack:
        node = stack.pop()
        nodes.append(node)
        for child in ast.iter_child_nodes(node):
            parents[child] = node
            stack.append(child)
    return nodes, parents


def _megatron_bindings(nodes: list[ast.AST]) -> dict[str, str]:
    """Names bound to megatron.core modules or objects anywhere in the file (function-local imports too)."""
    out: dict[str, str] = {}
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == ROOT_PACKAGE or alias.name.startswith(ROOT_PACKAGE + "."):
                    if alias.asname:
                        out[alias.asname] = alias.name
                    else:       # `import megatron.core.x` binds `megatron`; reads spell the full path
                        out.setdefault("megatron", "megatron")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "megatron" or node.module == ROOT_PACKAGE or node.module.startswith(ROOT_PACKAGE + "."):
                for alias in node.names:
                    out[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return out


def _dotted(node: ast.AST, bindings: dict[str, str]) -> str | None:
    """The megatron path an expression names (`ps.x.y` -> megatron.core.parallel_state.x.y), else None."""
    if isinstance(node, ast.Name):
        return bindings.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, bindings)
        return f"{base}.{node.attr}" if base else None
    return None


class Project:
    """The project's parsed source, its megatron uses and a function index for tracing dict keys."""

    def __init__(self, repo: Path = REPO):
        self.repo = repo
        self.modules: list[_Module] = []
        self.functions: dict[str, list[tuple[ast.FunctionDef, _Module]]] = {}
        self.calls: dict[str, list[tuple[ast.Call, _Module]]] = {}     # by the callee's last name
        for path in _project_files(repo):
            tree = ast.parse(path.read_text(), filename=str(path))
            nodes, parents = _walk_with_parents(tree)
            mod = _Module(path.relative_to(repo).as_posix(), tree, _megatron_bindings(nodes), parents, nodes)
            self.modules.append(mod)
            for node in tree.body:
                # A project subclass without its own __init__ takes its megatron base's keywords.
                if isinstance(node, ast.ClassDef) and node.bases and not any(
                        isinstance(s, ast.FunctionDef) and s.name == "__init__" for s in node.body):
                    base = _dotted(node.bases[0], mod.bindings)
                    if base:
                        mod.bindings.setdefault(node.name, base)
            for node in nodes:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    self.functions.setdefault(node.name, []).append((node, mod))
                elif isinstance(node, ast.Call):
                    name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                    self.calls.setdefault(name, []).append((node, mod))

    def uses(self) -> list[Use]:
        out: list[Use] = []
        for mod in self.modules:
            if not mod.bindings:
                continue
            out += self._import_uses(mod)
            for node in mod.nodes:
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    # `Cls.attr = v` must hit an existing class attribute; `module.name = v` (a shim)
                    # may define a new one, so only its module is checked (as a read of the base).
                    base = _dotted(node.value, mod.bindings)
                    if base:
                        out.append(Use(f"{base}.{node.attr}", "=", f"{mod.rel}:{node.lineno}"))
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    path = _dotted(node, mod.bindings)
                    parent = mod.parents.get(node)
                    # Only the longest chain counts (`ps.a` inside `ps.a.b` is implied).
                    if path and path != "megatron" and not (isinstance(parent, ast.Attribute) and
                                                            _dotted(parent, mod.bindings)):
                        out.append(Use(path, None, f"{mod.rel}:{node.lineno}"))
                elif isinstance(node, ast.Call):
                    callee = self._callee(node, mod)
                    if callee:
                        for kw in self.call_keywords(node, mod):
                            out.append(Use(callee, kw, f"{mod.rel}:{node.lineno}"))
        return sorted(set(out), key=lambda u: (u.path, u.keyword or "", u.where))

    @staticmethod
    def _import_uses(mod: _Module) -> list[Use]:
        out = []
        for node in mod.nodes:
            if isinstance(node, ast.Import):
                out += [Use(a.name, None, f"{mod.rel}:{node.lineno}") for a in node.names
                        if a.name.startswith(ROOT_PACKAGE)]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(ROOT_PACKAGE):
                out += [Use(f"{node.module}.{a.name}", None, f"{mod.rel}:{node.lineno}") for a in node.names]
        return out

    def _callee(self, call: ast.Call, mod: _Module) -> str | None:
        """The megatron path of a call's callee: a binding, a local alias of one (`f = td.f; f(...)`),
        or what a megatron call returned (`fb = get_forward_backward_func(); fb(...)`: path + "()")."""
        path = _dotted(call.func, mod.bindings)
        if path or not isinstance(call.func, ast.Name):
            return path
        fn = self._enclosing_function(call, mod)
        for node in ast.walk(fn) if fn else ():
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == call.func.id
                                                    for t in node.targets):
                value = node.value
                if isinstance(value, ast.Call) and _dotted(value.func, mod.bindings):
                    return _dotted(value.func, mod.bindings) + "()"
                path = _dotted(value, mod.bindings)
                if path:
                    return path
        return None

    def _enclosing_function(self, node: ast.AST, mod: _Module):
        while node is not None and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            node = mod.parents.get(node)
        return node

    def call_keywords(self, call: ast.Call, mod: _Module) -> set[str]:
        names = {kw.arg for kw in call.keywords if kw.arg}
        for kw in call.keywords:
            if kw.arg is None:
                names |= self.dict_keys(kw.value, mod, self._enclosing_function(call, mod), depth=0, seen=set())
        return names

    # -- tracing the keys of a dict ---------------------------------------------------------------

    def dict_keys(self, expr: ast.AST, mod: _Module, fn, *, depth: int, seen: set) -> set[str]:
        if depth > _MAX_DEPTH:
            return set()
        if isinstance(expr, ast.Dict):
            keys = {k.value for k in expr.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            for k, v in zip(expr.keys, expr.values):
                if k is None:       # {**other}
                    keys |= self.dict_keys(v, mod, fn, depth=depth + 1, seen=seen)
            return keys
        if isinstance(expr, ast.IfExp):
            return (self.dict_keys(expr.body, mod, fn, depth=depth + 1, seen=seen)
                    | self.dict_keys(expr.orelse, mod, fn, depth=depth + 1, seen=seen))
        if isinstance(expr, ast.BoolOp):
            return set().union(*(self.dict_keys(v, mod, fn, depth=depth + 1, seen=seen) for v in expr.values))
        if isinstance(expr, ast.Call):
            if isinstance(expr.func, ast.Name) and expr.func.id == "dict":
                keys = {kw.arg for kw in expr.keywords if kw.arg}
                for part in [*expr.args, *(kw.value for kw in expr.keywords if kw.arg is None)]:
                    keys |= self.dict_keys(part, mod, fn, depth=depth + 1, seen=seen)
                return keys
            name = expr.func.id if isinstance(expr.func, ast.Name) else getattr(expr.func, "attr", None)
            keys = set()
            for target, target_mod in self.functions.get(name, []):     # a project function's returned dict
                for ret in ast.walk(target):
                    if isinstance(ret, ast.Return) and ret.value is not None:
                        keys |= self.dict_keys(ret.value, target_mod, target, depth=depth + 1, seen=seen)
            return keys
        if isinstance(expr, ast.Name) and fn is not None:
            return self._name_keys(expr.id, mod, fn, depth=depth, seen=seen)
        return set()

    def _name_keys(self, name: str, mod: _Module, fn, *, depth: int, seen: set) -> set[str]:
        token = (id(fn), name)
        if token in seen:
            return set()
        seen.add(token)
        keys: set[str] = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id == name:
                        keys |= self.dict_keys(node.value, mod, fn, depth=depth + 1, seen=seen)
                    elif (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)
                          and target.value.id == name and isinstance(target.slice, ast.Constant)
                          and isinstance(target.slice.value, str)):
                        keys.add(target.slice.value)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and isinstance(node.func.value, ast.Name) and node.func.value.id == name
                  and node.func.attr in ("update", "setdefault")):
                if node.func.attr == "setdefault" and node.args and isinstance(node.args[0], ast.Constant):
                    keys.add(node.args[0].value)
                elif node.func.attr == "update":
                    keys |= {kw.arg for kw in node.keywords if kw.arg}
                    for part in [*node.args, *(kw.value for kw in node.keywords if kw.arg is None)]:
                        keys |= self.dict_keys(part, mod, fn, depth=depth + 1, seen=seen)
        args = fn.args
        params = [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]
        if name in params:
            for value, caller_mod, caller_fn in self._argument_values(fn, name, depth=depth, seen=seen):
                keys |= self.dict_keys(value, caller_mod, caller_fn, depth=depth + 1, seen=seen)
        return keys

    def _argument_values(self, fn, param: str, *, depth: int, seen: set):
        """(expression, module, enclosing function) passed for `param` of `fn` at the project's call sites,
        following callers that hand their own **kwargs on (`def f(**kw): g(**kw)`)."""
        if depth > _MAX_DEPTH:
            return
        positional = [a.arg for a in [*fn.args.posonlyargs, *fn.args.args]]
        for call, mod in self.calls.get(fn.name, []):
            caller = self._enclosing_function(call, mod)
            explicit = [kw.value for kw in call.keywords if kw.arg == param]
            if param in positional:
                index = positional.index(param) - (1 if positional[:1] in (["self"], ["cls"]) and
                                                   isinstance(call.func, ast.Attribute) else 0)
                if 0 <= index < len(call.args) and not isinstance(call.args[index], ast.Starred):
                    explicit.append(call.args[index])
            for value in explicit:
                yield value, mod, caller
            if explicit or caller is None or caller.args.kwarg is None:
                continue
            forwarded = caller.args.kwarg.arg
            if any(kw.arg is None and isinstance(kw.value, ast.Name) and kw.value.id == forwarded
                   for kw in call.keywords):
                yield from self._argument_values(caller, param, depth=depth + 1, seen=seen)


# --- megatron-core's side: what a release defines -------------------------------------------------

@dataclasses.dataclass
class _Def:
    kind: str                     # "module", "class", "function", "value"
    module: str                   # dotted module that holds it
    node: ast.AST | None = None


class MegatronTree:
    """megatron.core read from source: modules, their bindings, classes and signatures."""

    def __init__(self, root: Path):
        self.root = Path(root)
        if not (self.root / "megatron" / "core").is_dir():
            raise FileNotFoundError(f"{root}: no megatron/core package inside")
        self._trees: dict[str, ast.Module | None] = {}

    def _file(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def is_package(self, module: str) -> bool:
        return (self.root.joinpath(*module.split(".")) / "__init__.py").is_file()

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            path = self._file(module)
            self._trees[module] = ast.parse(path.read_text(), filename=str(path)) if path else None
        return self._trees[module]

    def version(self) -> str:
        tree = self.tree(f"{ROOT_PACKAGE}.package_info")
        parts = {}
        for node in ast.walk(tree) if tree else ():
            if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                    and isinstance(node.value, ast.Constant)):
                parts[node.targets[0].id] = node.value.value
        return ".".join(str(parts[k]) for k in ("MAJOR", "MINOR", "PATCH") if k in parts) or "unknown"

    @staticmethod
    def _top_level(body) -> Iterator[ast.stmt]:
        """Module- or class-level statements, including those inside if / try / with blocks."""
        for stmt in body:
            yield stmt
            if isinstance(stmt, ast.If | ast.Try | ast.With):
                for block in ("body", "orelse", "finalbody"):
                    yield from MegatronTree._top_level(getattr(stmt, block, []))
                for handler in getattr(stmt, "handlers", []):
                    yield from MegatronTree._top_level(handler.body)

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = module if self.is_package(module) else module.rsplit(".", 1)[0]
        for _ in range(node.level - 1):
            package = package.rsplit(".", 1)[0]
        return f"{package}.{node.module}" if node.module else package

    def member(self, module: str, name: str, depth: int = 0) -> _Def | None:
        """What `module.name` is: a binding in the module (re-exports followed), else a submodule."""
        tree = self.tree(module)
        if tree is None or depth > 20:
            return None
        stars = []
        for stmt in self._top_level(tree.body):
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and stmt.name == name:
                return _Def("function", module, stmt)
            if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                return _Def("class", module, stmt)
            if isinstance(stmt, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                if name in names:
                    return _Def("value", module, stmt)
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if (alias.asname or alias.name.split(".")[0]) == name:
                        return self.resolve(alias.name if alias.asname else name, depth + 1) or _Def("value", module)
            if isinstance(stmt, ast.ImportFrom):
                source = self._absolute(module, stmt)
                for alias in stmt.names:
                    if alias.name == "*":
                        stars.append(source)
                    elif (alias.asname or alias.name) == name:
                        if not source.startswith("megatron"):
                            return _Def("value", module, stmt)     # torch, TE, ...: outside the check
                        found = self.member(source, alias.name, depth + 1)
                        return found or (_Def("module", f"{source}.{alias.name}")
                                         if self.tree(f"{source}.{alias.name}") else None)
        if self.tree(f"{module}.{name}") is not None:
            return _Def("module", f"{module}.{name}")
        for source in stars:
            found = self.member(source, name, depth + 1)
            if found:
                return found
        return None

    def resolve(self, path: str, depth: int = 0) -> _Def | None:
        """The definition a dotted path names, or None when it does not exist in this release."""
        parts = path.split(".")
        if len(parts) < 2 or parts[:2] != ["megatron", "core"]:
            return _Def("module", path) if path == "megatron" else None
        current = _Def("module", ROOT_PACKAGE)
        for name in parts[2:]:
            if current.kind == "module":
                current = self.member(current.module, name, depth)
            elif current.kind == "class":
                current = self.class_member(current, name)
            else:
                return current          # an attribute of a value / function: not checked further
            if current is None:
                return None
        return current

    def _bases(self, cls: _Def) -> list[_Def | None]:
        """Resolved megatron bases of a class; None for a base outside megatron-core (torch.nn.Module)."""
        out = []
        for base in cls.node.bases:
            name = ast.unparse(base)
            head, *rest = name.split(".")
            found = self.member(cls.module, head)
            for attr in rest:
                found = self.class_member(found, attr) if found and found.kind == "class" else (
                    self.member(found.module, attr) if found and found.kind == "module" else None)
            out.append(found if found and found.kind == "class" else None)
        return out

    def class_member(self, cls: _Def, name: str) -> _Def | None:
        for stmt in self._top_level(cls.node.body):
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and stmt.name == name:
                return _Def("function" if not isinstance(stmt, ast.ClassDef) else "class", cls.module, stmt)
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
                return _Def("value", cls.module, stmt)
            if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
                return _Def("value", cls.module, stmt)
        for base in self._bases(cls):
            if base is None:
                return _Def("value", cls.module)      # may come from a non-megatron base: accept
            found = self.class_member(base, name)
            if found:
                return found
        return None

    def keywords(self, target: _Def) -> set[str] | None:
        """Keyword names a callee accepts; None = any (a **kwargs, or a base outside megatron-core)."""
        if target.kind == "function":
            args = target.node.args
            if args.kwarg is not None:
                return None
            return {a.arg for a in [*args.args, *args.kwonlyargs]} - {"self", "cls"}
        if target.kind != "class":
            return None
        fields: set[str] = set()
        for cls in self._mro(target):
            if cls is None:
                return None
            init = next((s for s in cls.node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
            if init is not None:
                return self.keywords(_Def("function", cls.module, init))
            if _is_dataclass(cls.node):
                fields |= {s.target.id for s in cls.node.body
                           if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                           and "ClassVar" not in ast.unparse(s.annotation)}
        return fields or None

    def returned_functions(self, target: _Def) -> list[_Def]:
        """The module-level functions a function can return (`f = a if c else b; return f`)."""
        if target.kind != "function":
            return []
        assigned: dict[str, list[ast.AST]] = {}
        for node in ast.walk(target.node):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        assigned.setdefault(t.id, []).append(node.value)

        def names(expr, depth=0) -> list[str]:
            if isinstance(expr, ast.IfExp):
                return names(expr.body, depth) + names(expr.orelse, depth)
            if isinstance(expr, ast.Name):
                local = assigned.get(expr.id)
                if local and depth < 4:
                    return [n for v in local for n in names(v, depth + 1)]
                return [expr.id]
            return []

        out = []
        for node in ast.walk(target.node):
            if isinstance(node, ast.Return) and node.value is not None:
                for name in names(node.value):
                    found = self.member(target.module, name)
                    if found is not None and found.kind == "function":
                        out.append(found)
        return out

    def _mro(self, cls: _Def, seen: set | None = None) -> list[_Def | None]:
        seen = seen if seen is not None else set()
        if id(cls.node) in seen:
            return []
        seen.add(id(cls.node))
        out: list[_Def | None] = [cls]
        for base in self._bases(cls):
            out += [None] if base is None else self._mro(base, seen)
        return out


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any("dataclass" in ast.unparse(d) for d in node.decorator_list)


# --- the check ------------------------------------------------------------------------------------

def check(tree: MegatronTree, uses: list[Use]) -> list[str]:
    """One line per use that the tree lacks."""
    problems = []
    for use in uses:
        if use.keyword == "=":          # an assignment: the owner must exist, and a class its attribute
            owner_path, attr = use.path.rsplit(".", 1)
            owner = tree.resolve(owner_path)
            if owner is None:
                problems.append(f"{use.where}: {owner_path} does not exist")
            elif owner.kind == "class" and tree.class_member(owner, attr) is None:
                problems.append(f"{use.where}: {owner_path} has no attribute {attr!r} to assign")
            continue
        returned = use.path.endswith("()")
        target = tree.resolve(use.path.removesuffix("()"))
        if target is None:
            problems.append(f"{use.where}: {use.path.removesuffix('()')} does not exist")
            continue
        if use.keyword is None:
            continue
        callees = tree.returned_functions(target) if returned else [target]
        if returned and not callees:
            problems.append(f"{use.where}: {use.path.removesuffix('()')} no longer returns a function")
        for callee in callees:
            accepted = tree.keywords(callee)
            if accepted is not None and use.keyword not in accepted:
                name = use.path if not returned else f"{use.path} ({callee.node.name})"
                problems.append(f"{use.where}: {name} takes no keyword {use.keyword!r}")
    return sorted(set(problems))


def installed_tree() -> Path:
    """The directory that holds the installed megatron/ package (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("megatron-core is not installed")
    return Path(next(iter(spec.submodule_search_locations))).parent


def unpack_wheel(wheel: str | os.PathLike, into: str | os.PathLike) -> Path:
    """Extract the megatron/ sources of a wheel (a zip) into `into`; returns `into`."""
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.startswith("megatron/core/") and m.endswith(".py")]
        if not members:
            raise FileNotFoundError(f"{wheel}: no megatron/core sources inside")
        zf.extractall(into, members)
    return Path(into)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/mcore_api_check.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--tree", help="directory that holds megatron/core (default: the installed package)")
    where.add_argument("--wheel", help="a megatron-core wheel file, read as a zip")
    parser.add_argument("--list", action="store_true", help="print every use found in the project")
    parser.add_argument("--repo", default=str(REPO), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    uses = Project(Path(args.repo)).uses()
    if args.list:
        for use in uses:
            print(f"{use.where}: {use.describe()}")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            root = unpack_wheel(args.wheel, tmp) if args.wheel else Path(args.tree) if args.tree else installed_tree()
            tree = MegatronTree(root)
        except (FileNotFoundError, zipfile.BadZipFile) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        problems = check(tree, uses)
        names = len({u.path for u in uses})
        keywords = len({(u.path, u.keyword) for u in uses if u.keyword})
        for line in problems:
            print(line)
        verdict = f"{len(problems)} missing" if problems else "all present"
        print(f"megatron-core {tree.version()} at {root}: {names} names, {keywords} keywords used; {verdict}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
