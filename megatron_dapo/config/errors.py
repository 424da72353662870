"""The config error type: always names the offending key. A configuration with several bad keys is
reported whole (`ConfigErrors`, one line per key) rather than one key per run."""

from __future__ import annotations

import contextlib
import contextvars


class ConfigError(ValueError):
    """An invalid configuration. `key` is the dotted key (e.g. "actor.clip_ratio_c")."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}")


class ConfigErrors(ConfigError):
    """Several invalid keys at once; `errors` holds each (the first gives `key` and `message`)."""

    def __init__(self, errors: list[ConfigError]):
        self.errors = list(errors)
        super().__init__(self.errors[0].key, self.errors[0].message)

    def __str__(self) -> str:
        return "\n".join(str(e) for e in self.errors)


_COLLECT: contextvars.ContextVar[list[ConfigError] | None] = contextvars.ContextVar("config_errors", default=None)


@contextlib.contextmanager
def collecting(errors: list[ConfigError]):
    """Inside, `report` appends to `errors` instead of raising (the loader checks a section whole)."""
    token = _COLLECT.set(errors)
    try:
        yield errors
    finally:
        _COLLECT.reset(token)


def report(error: ConfigError) -> None:
    """Raise `error`, or record it when the loader is collecting (`collecting`)."""
    errors = _COLLECT.get()
    if errors is None:
        raise error
    errors.append(error)
