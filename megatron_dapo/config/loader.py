"""Base -> recipe YAML -> `key=value` dotlist, with typed coercion and named errors.

No Hydra composition (STYLE.md rule 5): a recipe is one flat-or-nested YAML file of overrides.
Unknown keys are errors that suggest the closest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import sys
import types
import typing
from typing import Any, Literal, Union

import yaml

from megatron_dapo.config import verl
from megatron_dapo.config.errors import ConfigError, ConfigErrors, collecting
from megatron_dapo.config.root import Config

_FLOAT_TEXT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def _field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _all_keys(cls, prefix: str = "", *, leaves: bool = False) -> list[str]:
    """Every dotted key of `cls`, sections included (leaves=True: only the keys that hold a value)."""
    keys = []
    for name, tp in _field_types(cls).items():
        key, section = prefix + name, dataclasses.is_dataclass(tp)
        if not (leaves and section):
            keys.append(key)
        if section:
            keys.extend(_all_keys(tp, key + ".", leaves=leaves))
    return keys


@functools.cache
def _leaf_keys() -> frozenset[str]:
    """The keys of Config that hold a value (not a section)."""
    return frozenset(_all_keys(Config, leaves=True))


def _unknown_key(cls, key: str) -> ConfigError:
    """The closest key that holds a value, first among the keys of the same section (`trainer.foo` is never
    answered with the section `trainer`); a section with no close key says so."""
    section, _, leaf = key.rpartition(".")
    siblings = sorted(k for k in _leaf_keys() if k.rpartition(".")[0] == section)
    names = difflib.get_close_matches(leaf, [k.rpartition(".")[2] for k in siblings], n=1, cutoff=0.6)
    close = ([f"{section}.{names[0]}"] if names
             else difflib.get_close_matches(key, sorted(_leaf_keys()), n=1, cutoff=0.75))
    if close:
        hint = f"; did you mean {close[0]!r}?"
    elif siblings:
        hint = f"; {section} has no key {leaf!r} (docs/configuration.md lists its keys)"
    else:
        hint = ""
    return ConfigError(key, f"unknown key{hint}")


def _coerce(tp, value, key: str):
    """Check and convert one leaf value against its annotated type."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(key, f"expected {_type_name(tp)}, got null")
        errors = []
        for opt in options:
            if opt is type(None):
                continue
            try:
                return _coerce(opt, value, key)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(key, f"expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(key, f"expected one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if item_tp is str and isinstance(value, str):  # `trainer.logger=console`: a list of one, as in verl
            value = [value]
        if not isinstance(value, list | tuple):
            raise ConfigError(key, f"expected a list, got {value!r}")
        return [_coerce(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT_TEXT.match(value):
            return float(value)  # YAML 1.1 reads "1e-5" (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(key, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {value!r}")
        return value
    raise ConfigError(key, f"unsupported type {tp}")


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(t) for t in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _build(cls, raw: dict, prefix: str, errors: list[ConfigError] | None = None):
    """Instantiate dataclass `cls` from a nested dict of overrides (missing keys keep defaults). Every bad key
    is found in one pass: an unknown key or a bad value is recorded and its default kept, so the section's own
    checks still run on the rest (recorded too); a section holding an error makes its parent unbuildable, so
    the cross-section checks wait for the next run. Raises the one error, or ConfigErrors with each."""
    top = errors is None
    errors = [] if errors is None else errors
    built = _build_section(cls, raw, prefix, errors)
    if top and errors:
        raise errors[0] if len(errors) == 1 else ConfigErrors(errors)
    return built


def _build_section(cls, raw: dict, prefix: str, errors: list[ConfigError]):
    """cls(...) from `raw`, or None when an error makes it unbuildable; errors go to `errors`."""
    if not isinstance(raw, dict):
        errors.append(ConfigError(prefix.rstrip(".") or "<root>", f"expected a mapping, got {raw!r}"))
        return None
    hints = _field_types(cls)
    kwargs, broken = {}, False
    for name, value in raw.items():
        key = prefix + str(name)
        if name not in hints:
            errors.append(_unknown_key(cls, key))
            continue
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            had = len(errors)
            section = _build_section(tp, value if value is not None else {}, key + ".", errors)
            broken |= section is None or len(errors) > had  # its values are not checked: no cross-checks on them
            kwargs[name] = section
            continue
        try:
            kwargs[name] = _coerce(tp, value, key)
        except ConfigError as e:
            errors.append(e)
    if broken:
        return None
    before = len(errors)
    with collecting(errors):
        try:
            return cls(**kwargs)
        except ConfigError as e:
            errors.append(e)
        except (TypeError, ValueError, ArithmeticError, AttributeError) as e:
            if len(errors) == before:  # otherwise a consequence of an error already recorded in this section
                errors.append(ConfigError(prefix.rstrip(".") or "<root>", str(e)))
    return None


def _merge(dst: dict, src: dict) -> dict:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v
    return dst


def _has(tree: dict, key: str) -> bool:
    node = tree
    for p in key.split("."):
        if not isinstance(node, dict) or p not in node:
            return False
        node = node[p]
    return True


def _set(out: dict, key: str, value) -> None:
    node = out
    parts = key.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(key, "conflicts with an earlier override of a parent key")
    node[parts[-1]] = value


def _parse_dotlist(items: list[str], ignored: list[tuple[str, str]] | None = None,
                   implies: list[tuple[str, object]] | None = None) -> dict:
    """`key=value` overrides as a nested dict; verl's keys (config/verl.py) become ours (those with no effect
    go to `ignored`, what they imply to `implies`)."""
    out: dict = {}
    pairs = []
    for item in items:
        if "=" not in item:
            raise ConfigError(item, "expected key=value")
        key, text = item.split("=", 1)
        key = key.strip()
        if not key.lstrip("+"):
            raise ConfigError(item, "empty key in key=value override")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(key, f"cannot parse value {text!r}: {e}") from None
        pairs.append((key, value))
    for key, value in _from_verl(pairs, ignored, implies):
        _set(out, key, value)
    return out


def _from_verl(pairs: list[tuple[str, object]], ignored: list[tuple[str, str]] | None = None,
               implies: list[tuple[str, object]] | None = None) -> list[tuple[str, object]]:
    """Our keys as they are; verl's translated (those with no effect dropped, the `last` ones moved to the
    end); a key that is neither stays, so that the build names it as unknown. ignored: receives (verl key,
    why it has no effect here) for each one dropped; implies: the (key, value) pairs verl's keys imply
    (config/verl.py Alias.implies), set later where the configuration does not give the key."""
    ours = _leaf_keys()
    kept, last = [], []
    for key, value in pairs:
        key = key.lstrip("+")  # Hydra's "add" / "force add" prefixes, as verl's scripts write some keys
        if verl.lookup(key) is None:  # (an alias may name one of ours: data.train_files takes verl's list of one)
            if key not in ours and key.split(".")[0] in verl.SECTIONS:
                raise ConfigError(key, f"not a verl key this project maps{_verl_hint(key, ours)} "
                                       "(docs/migrating-from-verl.md)")
            kept.append((key, value))
            continue
        translated = verl.translate(key, value)
        if implies is not None:
            implies += verl.implied(key, value)
        if translated is not None:
            (last if translated[2] else kept).append(translated[:2])
        elif ignored is not None:
            ignored.append((key, verl.no_effect_reason(key)))
    return kept + last


def _verl_hint(key: str, ours) -> str:
    """A mapped verl key or a key of ours with the same meaning: the same leaf name, the closest section
    first (never a key that merely looks alike)."""
    leaf, parts = key.rsplit(".", 1)[-1], key.split(".")
    same = [k for k in verl.ALIASES if k.rsplit(".", 1)[-1] == leaf]
    if same:
        shared = lambda k: sum(1 for a, b in zip(k.split("."), parts, strict=False) if a == b)  # noqa: E731
        best = max(same, key=shared)
        return f"; verl's {best!r} is (here {verl.ALIASES[best].key or 'no effect'})"
    here = sorted(k for k in ours if k.rsplit(".", 1)[-1] == leaf)
    if here:
        return f"; this project's {here[0]!r} is the same setting by name"
    section = key.rsplit(".", 1)[0] + "."  # a typo of a leaf in the same section
    leaves = {k[len(section):]: k for k in verl.ALIASES if k.startswith(section) and "." not in k[len(section):]}
    typo = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.75)
    return f"; verl's {leaves[typo[0]]!r} is" if typo else ""


def _flatten_unknown(raw: dict, cls=Config, prefix: str = "") -> list[tuple[str, object]]:
    """Remove from a recipe's nested dict the keys that are not ours and return them as dotted leaves."""
    hints = _field_types(cls)
    out = []
    for name in list(raw):
        key, value = prefix + str(name), raw[name]
        tp = hints.get(name)
        if tp is not None and dataclasses.is_dataclass(tp) and isinstance(value, dict):
            out += _flatten_unknown(value, tp, key + ".")
        elif tp is None or (verl.lookup(key) is not None and not isinstance(value, dict)):
            # not ours, or ours under a verl alias that converts verl's value (data.train_files: a list of one)
            del raw[name]
            out += _leaves(value, key) if isinstance(value, dict) else [(key, value)]
    return out


def _leaves(tree: dict, prefix: str) -> list[tuple[str, object]]:
    out = []
    for name, value in tree.items():
        key = f"{prefix}.{name}"
        out += _leaves(value, key) if isinstance(value, dict) and verl.lookup(key) is None else [(key, value)]
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a mapping with the same key twice (the last one would win silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: SafeLoader's own error follows
                continue
            if first != key_node.start_mark.line + 1:
                raise ConfigError("--config", f"{self.name}: key {key!r} appears twice in one mapping "
                                              f"(lines {first} and {key_node.start_mark.line + 1})")
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str) -> dict:
    """A recipe file: a UTF-8 YAML mapping with no duplicate keys; anything else is a ConfigError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            loader = _UniqueKeyLoader(f)
            try:
                raw = loader.get_single_data()
            finally:
                loader.dispose()
    except FileNotFoundError:
        raise ConfigError("--config", f"file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError("--config", f"{path} is a directory, expected a YAML file") from None
    except PermissionError:
        raise ConfigError("--config", f"{path} cannot be read (permission denied)") from None
    except UnicodeDecodeError as e:
        raise ConfigError("--config", f"{path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                                      f"{e.start}): a recipe is a YAML file") from None
    except yaml.YAMLError as e:
        raise ConfigError("--config", f"{path} is not valid YAML: {e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError("--config", f"{path} must hold a mapping of overrides")
    return raw


def load_config(config_path: str | None = None, overrides: list[str] | None = None) -> Config:
    """The resolved config: dataclass defaults, then the recipe, then the dotlist overrides. The verl keys
    that have no effect here are listed, with the reason, in `ignored_keys(cfg)`."""
    raw: dict = {}
    ignored: list[tuple[str, str]] = []
    implies: list[tuple[str, object]] = []
    if config_path:
        recipe = load_yaml(config_path)
        foreign = _flatten_unknown(recipe)  # verl's nested sections (actor_rollout_ref, reward_model, ...)
        _merge(raw, recipe)
        for key, value in _from_verl(foreign, ignored, implies):
            _set(raw, key, value)
    _merge(raw, _parse_dotlist(list(overrides or []), ignored, implies))
    for key, value in implies:  # what verl derives from a key, where the configuration does not say itself
        if not _has(raw, key):
            _set(raw, key, value)
    cfg = _build(Config, raw, "")
    object.__setattr__(cfg, "_ignored_keys", tuple(ignored))  # not a config key: never saved or printed as one
    return cfg


def ignored_keys(cfg: Config) -> tuple[tuple[str, str], ...]:
    """(verl key, why it has no effect here) for each key `load_config` read and dropped."""
    return getattr(cfg, "_ignored_keys", ())


def load_config_cli(config_path: str | None, overrides: list[str] | None) -> Config | None:
    """load_config for a command line: None after printing `config error: <key>: <problem>` to stderr (the
    caller exits 2, the contract of every CLI here). Each verl key with no effect here gets one
    `ignored: <key> (<reason>)` line on stderr (once per job: global rank 0 under torchrun)."""
    try:
        cfg = load_config(config_path, overrides)
    except ConfigError as e:
        for error in getattr(e, "errors", [e]):
            print(f"config error: {error}", file=sys.stderr)
        return None
    if os.environ.get("RANK", "0") == "0":
        for key, why in ignored_keys(cfg):
            print(f"ignored: {key} ({why})", file=sys.stderr)
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def from_dict(raw: dict) -> Config:
    """Rebuild a Config from `to_dict` output (used when resuming from a saved config.yaml)."""
    return _build(Config, raw, "")
