"""The queue's vocabulary: key format, tags, and KVBatchMeta (what stages pass instead of data).

A key is `<prompt_uid>` for a prompt or `<prompt_uid>_<i>` for its i-th trajectory, `i` a decimal
without leading zeros. The prompt id of any key is the part before its `_` (the rule recovery
uses to find a prompt's trajectories), so a prompt uid may not contain `_`; allowed are 1-256 of
letters, digits and `.:/@+=#-`. Tags are `is_prompt` (follows the key form), `status` (one of
STATUSES), `global_steps` (int >= 0) and `policy_version` (int >= 0 or None). The argument
checks shared by the store (`check_keys`, `tags_for_put`) live here too.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

STATUSES = ("pending", "running", "done", "consumed")
TAG_NAMES = ("is_prompt", "status", "global_steps", "policy_version")

_UID = r"[A-Za-z0-9.:/@+=#-]{1,256}"
_UID_RE = re.compile(_UID)
_TRAJ_RE = re.compile(rf"({_UID})_(0|[1-9][0-9]{{0,9}})")


def parse_key(key: str) -> tuple[str, int | None]:
    """`"<uid>"` -> `(uid, None)`; `"<uid>_<i>"` -> `(uid, i)`; anything else is a ValueError."""
    if not isinstance(key, str):
        raise TypeError(f"key {key!r}: expected str, got {type(key).__name__}")
    if _UID_RE.fullmatch(key):
        return key, None
    m = _TRAJ_RE.fullmatch(key)
    if m:
        return m.group(1), int(m.group(2))
    raise ValueError(
        f"key {key!r}: expected '<prompt_uid>' or '<prompt_uid>_<i>', where prompt_uid is 1-256 of "
        f"letters, digits and '.:/@+=#-' (no '_': the prompt id is the part before '_') and i is a "
        f"decimal without leading zeros"
    )


def trajectory_key(prompt_uid: str, index: int) -> str:
    """The key of the `index`-th trajectory of a prompt."""
    if parse_key(prompt_uid)[1] is not None:
        raise ValueError(f"prompt_uid {prompt_uid!r} is itself a trajectory key")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ValueError(f"trajectory index for prompt {prompt_uid!r}: expected an int >= 0, got {index!r}")
    return f"{prompt_uid}_{index}"


def prompt_uid_of(key: str) -> str:
    """The prompt id of a prompt or trajectory key."""
    return parse_key(key)[0]


def check_partition(partition: Any) -> None:
    if not isinstance(partition, str) or not partition or not partition.isprintable():
        raise ValueError(f"partition {partition!r}: expected a non-empty printable string")


def check_unique(keys: Sequence[str], what: str) -> None:
    if len(set(keys)) != len(keys):
        seen, dups = set(), []
        for k in keys:
            if k in seen:
                dups.append(k)
            seen.add(k)
        raise ValueError(f"{what}: duplicate keys {dups[:10]}")


def check_tag(name: str, value: Any, *, key: str | None = None) -> Any:
    """Validate one tag value (numpy scalars accepted) and return it as a plain Python value."""
    where = f" (key {key!r})" if key is not None else ""
    if name == "status":
        if not isinstance(value, str) or value not in STATUSES:
            raise ValueError(f"tag status={value!r}{where}: expected one of {STATUSES}")
        return str(value)
    if name == "is_prompt":
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"tag is_prompt={value!r}{where}: expected a bool")
        return bool(value)
    if name in ("global_steps", "policy_version"):
        if value is None and name == "policy_version":
            return None
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
            allowed = "an int >= 0" + (" or None" if name == "policy_version" else "")
            raise ValueError(f"tag {name}={value!r}{where}: expected {allowed}")
        return int(value)
    raise ValueError(f"unknown tag {name!r}{where}: expected one of {TAG_NAMES}")


@dataclasses.dataclass(frozen=True)
class KVBatchMeta:
    """What moves between stages instead of the data: a partition id and keys with their tags.

    `tags[i]` (a read-only mapping, normally TAG_NAMES -> value) belongs to `keys[i]`; keys are
    unique. Cheap to copy, send to another process (`to_json`) or split across workers (`select`).
    """

    partition_id: str
    keys: tuple[str, ...]
    tags: tuple[Mapping[str, Any], ...]

    def __post_init__(self) -> None:
        check_partition(self.partition_id)
        keys, tags = tuple(self.keys), tuple(MappingProxyType(dict(t)) for t in self.tags)
        if len(keys) != len(tags):
            raise ValueError(f"KVBatchMeta: {len(keys)} keys but {len(tags)} tag dicts")
        check_unique(keys, "KVBatchMeta keys")
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "tags", tags)

    @classmethod
    def empty(cls, partition_id: str) -> KVBatchMeta:
        return cls(partition_id, (), ())

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        shown = ", ".join(map(repr, self.keys[:4])) + (", ..." if len(self) > 4 else "")
        return f"KVBatchMeta(partition_id={self.partition_id!r}, n={len(self)}, keys=[{shown}])"

    @property
    def prompt_uids(self) -> tuple[str, ...]:
        """The prompt id of each key (the key itself for prompts)."""
        return tuple(prompt_uid_of(k) for k in self.keys)

    def select(self, indices: Sequence[int] | slice) -> KVBatchMeta:
        """The entries at `indices` (ints or a slice), in that order."""
        idx = range(len(self))[indices] if isinstance(indices, slice) else list(indices)
        return KVBatchMeta(
            self.partition_id, tuple(self.keys[i] for i in idx), tuple(self.tags[i] for i in idx)
        )

    @classmethod
    def concat(cls, metas: Sequence[KVBatchMeta]) -> KVBatchMeta:
        """Join metas of one partition, in order; a key in two of them is an error."""
        if not metas:
            raise ValueError("KVBatchMeta.concat: need at least one meta")
        parts = sorted({m.partition_id for m in metas})
        if len(parts) != 1:
            raise ValueError(f"KVBatchMeta.concat: metas come from different partitions {parts}")
        keys = tuple(k for m in metas for k in m.keys)
        return cls(parts[0], keys, tuple(t for m in metas for t in m.tags))

    def to_json(self) -> str:
        obj = {
            "partition_id": self.partition_id,
            "keys": list(self.keys),
            "tags": [dict(t) for t in self.tags],
        }
        return json.dumps(obj)

    @classmethod
    def from_json(cls, text: str) -> KVBatchMeta:
        obj = json.loads(text)
        if not isinstance(obj, dict) or {"partition_id", "keys", "tags"} - set(obj):
            raise ValueError(
                f"KVBatchMeta.from_json: expected an object with partition_id, keys, tags; got {text!r:.120}"
            )
        return cls(obj["partition_id"], tuple(obj["keys"]), tuple(obj["tags"]))


def check_keys(keys: Any, *, validate: bool = True) -> list[str]:
    """A list of unique str keys; `validate` also checks the key format (done at put time)."""
    if isinstance(keys, str) or not isinstance(keys, Iterable):
        raise TypeError(f"keys must be a sequence of str, got {type(keys).__name__} {keys!r:.80}")
    keys = list(keys)
    for k in keys:
        if validate:
            parse_key(k)
        elif not isinstance(k, str):
            raise TypeError(f"key {k!r}: expected str, got {type(k).__name__}")
    check_unique(keys, "keys")
    return keys


def tags_for_put(keys: list[str], tags: Any) -> list[dict[str, Any]]:
    """One validated tag dict per key from `None`, one dict for all, or a list; defaults filled in."""
    if tags is None or isinstance(tags, Mapping):
        per_key = [tags or {}] * len(keys)
    elif isinstance(tags, Sequence) and len(tags) == len(keys):
        per_key = list(tags)
    else:
        raise ValueError(
            f"tags: expected one dict for all keys or a list of {len(keys)} dicts, got {tags!r:.120}"
        )
    rows = []
    for k, given in zip(keys, per_key, strict=True):
        if not isinstance(given, Mapping):
            raise ValueError(f"tags for key {k!r}: expected a dict, got {type(given).__name__}")
        is_prompt = parse_key(k)[1] is None
        row = {"is_prompt": is_prompt, "status": "pending", "global_steps": 0, "policy_version": None}
        for name, value in given.items():
            row[name] = check_tag(name, value, key=k)
        if row["is_prompt"] != is_prompt:
            raise ValueError(
                f"key {k!r}: tag is_prompt={row['is_prompt']} contradicts the key form "
                f"('<uid>' is a prompt, '<uid>_<i>' a trajectory)"
            )
        rows.append(row)
    return rows
