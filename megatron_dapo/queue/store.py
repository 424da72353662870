"""TransferQueue: a keyed sample store with partitions, tags and statuses, persisted in SQLite.

Shapes: `N` keys per call; a batch tensor field is `[N, ...]` (row i belongs to key i) and `get`
returns one tensor per key, or `[N, ...]` with `stack=True`.

Entries. Keys, tags and KVBatchMeta are defined in meta.py. Tags are indexed columns (for
list_keys / claim); named fields are stored one row per field, so a stage reads only the fields
it needs (reward reads `responses`, writes `rm_scores`). Values go through codec.py
(safetensors / JSON, never pickle).

Durability and concurrency. The file is a SQLite database in WAL mode. Every public call is one
transaction (all or nothing); `transaction()` groups several. Writers take the write lock up
front (BEGIN IMMEDIATE), so two processes never both claim a key, and wait up to `busy_timeout_s`
for each other. `durability="process"` (synchronous=NORMAL, the default) writes each commit to
the WAL before returning, so a killed process (SIGKILL, OOM) loses nothing it committed; only a
power loss or kernel crash can drop the last commits (the file stays consistent). "power"
(synchronous=FULL) also fsyncs every commit, at about one disk flush per call. Each process and
thread opens its own connection lazily (SQLite connections must not cross fork), and a
TransferQueue pickles as its path, so it can be handed to spawned workers.

Errors. Reading a partition that was never created raises UnknownPartitionError (a typo should
not look like an empty queue); `create_partition` makes an empty one and `put` creates it.
Missing keys or fields raise QueueKeyError naming them; putting an existing key raises
DuplicateKeyError unless `overwrite=True`.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any

from megatron_dapo.queue import codec
from megatron_dapo.queue.meta import (
    STATUSES,
    TAG_NAMES,
    KVBatchMeta,
    check_keys,
    check_partition,
    check_tag,
    parse_key,
    prompt_uid_of,
    tags_for_put,
)

FILTER_NAMES = TAG_NAMES + ("prompt_uid",)
DURABILITY_MODES = {"process": "NORMAL", "power": "FULL"}
SCHEMA_VERSION = "1"

# Keys per `IN (...)` list: far below SQLite's bound-parameter limit (32766).
_CHUNK = 900
# Connections inherited through fork: SQLite forbids using them in the child, and closing them
# there is not safe either (it can touch locks and shared memory of the parent's connection), so
# they are kept referenced here, never closed, and the child opens its own.
_INHERITED_CONNECTIONS: list[sqlite3.Connection] = []

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS partitions (name TEXT PRIMARY KEY, created_at REAL NOT NULL)",
    # seq: insertion order, so list_keys and claim are first-in first-out.
    """CREATE TABLE IF NOT EXISTS entries (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        partition TEXT NOT NULL,
        key TEXT NOT NULL,
        prompt_uid TEXT NOT NULL,
        is_prompt INTEGER NOT NULL CHECK (is_prompt IN (0, 1)),
        status TEXT NOT NULL CHECK (status IN (%s)),
        global_steps INTEGER NOT NULL CHECK (global_steps >= 0),
        policy_version INTEGER CHECK (policy_version >= 0),
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        UNIQUE (partition, key))""",
    "CREATE INDEX IF NOT EXISTS entries_by_status ON entries (partition, is_prompt, status)",
    "CREATE INDEX IF NOT EXISTS entries_by_prompt ON entries (partition, prompt_uid)",
    """CREATE TABLE IF NOT EXISTS fields (
        partition TEXT NOT NULL,
        key TEXT NOT NULL,
        name TEXT NOT NULL,
        kind TEXT NOT NULL,
        blob BLOB NOT NULL,
        PRIMARY KEY (partition, key, name))""",
)
_SCHEMA = tuple(stmt.replace("%s", ", ".join(f"'{s}'" for s in STATUSES)) for stmt in _SCHEMA)


class QueueKeyError(KeyError):
    """A key, field or partition that is not in the queue (message printed without repr quotes)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnknownPartitionError(QueueKeyError):
    """A read or update on a partition that was never created."""


class DuplicateKeyError(ValueError):
    """`put` of keys that are already present (pass overwrite=True to replace them)."""


# --------------------------------------------------------------------------------------- store


class TransferQueue:
    """The store. See the module docstring for the data model, durability and errors."""

    def __init__(self, path: str | os.PathLike, *, durability: str = "process", busy_timeout_s: float = 60.0):
        path = os.fspath(path)
        if path == ":memory:" or path.startswith("file:"):
            raise ValueError(
                f"TransferQueue path {path!r}: expected a file path (the store is shared by processes)"
            )
        if durability not in DURABILITY_MODES:
            raise ValueError(f"durability={durability!r}: expected one of {sorted(DURABILITY_MODES)}")
        if not busy_timeout_s > 0:
            raise ValueError(f"busy_timeout_s={busy_timeout_s!r}: expected a positive number of seconds")
        self.path = os.path.abspath(path)
        self.durability = durability
        self.busy_timeout_s = float(busy_timeout_s)
        self._setup()
        self._init_schema()

    def _setup(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._opened: list[tuple[int, sqlite3.Connection]] = []
        self._closed = False

    # Pickles as its settings: a spawned worker opens its own connection.
    def __getstate__(self) -> dict:
        return {"path": self.path, "durability": self.durability, "busy_timeout_s": self.busy_timeout_s}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._setup()

    def __repr__(self) -> str:
        return f"TransferQueue({self.path!r}, durability={self.durability!r})"

    def __enter__(self) -> TransferQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every connection this process opened; later calls raise RuntimeError."""
        with self._lock:
            mine = self._own_connections()
            self._opened, self._closed = [], True
        for conn in mine:
            conn.close()

    def _own_connections(self) -> list[sqlite3.Connection]:
        """This process's connections; those inherited through fork are parked, never closed."""
        pid = os.getpid()
        _INHERITED_CONNECTIONS.extend(c for p, c in self._opened if p != pid)
        self._opened = [(p, c) for p, c in self._opened if p == pid]
        return [c for _, c in self._opened]

    # ------------------------------------------------------------------ connections, transactions

    def _conn(self) -> sqlite3.Connection:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        st, pid = self._local, os.getpid()
        if getattr(st, "pid", None) != pid:  # first use in this thread, or first use after a fork
            st.conn, st.pid, st.depth, st.write = self._connect(), pid, 0, False
            with self._lock:
                self._own_connections()
                self._opened.append((pid, st.conn))
        return st.conn

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: no implicit transactions; _txn issues BEGIN / COMMIT itself.
        conn = sqlite3.connect(
            self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
        deadline = time.monotonic() + self.busy_timeout_s
        # Switching to WAL needs a moment with no other connection mid-write; it is persistent, so
        # only the first opener of a new file does it. The busy handler does not cover it: retry.
        while conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
            try:
                conn.execute("PRAGMA journal_mode = WAL")
            except sqlite3.OperationalError as exc:
                if ("locked" not in str(exc) and "busy" not in str(exc)) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        conn.execute(f"PRAGMA synchronous = {DURABILITY_MODES[self.durability]}")
        return conn

    def _init_schema(self) -> None:
        with self._txn(write=False) as c:
            has_meta = c.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'").fetchone()
            row = has_meta and c.execute("SELECT value FROM meta WHERE name='schema_version'").fetchone()
        if not row:
            with self._txn(write=True) as c:
                for stmt in _SCHEMA:
                    c.execute(stmt)
                c.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (SCHEMA_VERSION,))
                row = c.execute("SELECT value FROM meta WHERE name='schema_version'").fetchone()
        if row[0] != SCHEMA_VERSION:
            raise RuntimeError(
                f"{self.path}: queue schema version {row[0]!r}, this code reads {SCHEMA_VERSION!r}"
            )

    @contextlib.contextmanager
    def transaction(self) -> Iterator[TransferQueue]:
        """Run several calls as one atomic write transaction (the write lock is held throughout).

        `with q.transaction(): meta = q.claim("train", 4); q.update_tags("train", meta.keys, policy_version=7)`
        Each call inside stays all-or-nothing on its own (a savepoint), so catching its error
        inside the block keeps the rest of the transaction intact.
        """
        with self._txn(write=True):
            yield self

    @contextlib.contextmanager
    def _txn(self, *, write: bool) -> Iterator[sqlite3.Connection]:
        conn, st = self._conn(), self._local
        if st.depth:
            if write and not st.write:
                raise RuntimeError("a write inside a read-only transaction")
            name = f"sp{st.depth}"
            conn.execute(f"SAVEPOINT {name}")
            st.depth += 1
            try:
                yield conn
            except BaseException:
                conn.execute(f"ROLLBACK TO {name}")
                raise
            finally:
                st.depth -= 1
                conn.execute(f"RELEASE {name}")
            return
        # IMMEDIATE takes the write lock now: a deferred read that later writes can fail at once
        # with SQLITE_BUSY in WAL mode instead of waiting, and two claims must not read the same rows.
        conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        st.depth, st.write = 1, write
        try:
            yield conn
        except BaseException:
            st.depth = 0
            conn.execute("ROLLBACK")
            raise
        st.depth = 0
        try:
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    # ------------------------------------------------------------------------------- partitions

    def create_partition(self, partition: str) -> None:
        """Create an empty partition (no-op when it exists)."""
        check_partition(partition)
        with self._txn(write=True) as c:
            c.execute("INSERT OR IGNORE INTO partitions VALUES (?, ?)", (partition, time.time()))

    def partitions(self) -> list[str]:
        with self._txn(write=False) as c:
            return [r[0] for r in c.execute("SELECT name FROM partitions ORDER BY name")]

    def drop_partition(self, partition: str) -> int:
        """Delete a partition and all its entries; returns how many entries it held."""
        with self._txn(write=True) as c:
            self._require_partition(c, partition)
            c.execute("DELETE FROM fields WHERE partition = ?", (partition,))
            n = c.execute("DELETE FROM entries WHERE partition = ?", (partition,)).rowcount
            c.execute("DELETE FROM partitions WHERE name = ?", (partition,))
        return n

    def _require_partition(self, c: sqlite3.Connection, partition: str) -> None:
        check_partition(partition)
        if c.execute("SELECT 1 FROM partitions WHERE name = ?", (partition,)).fetchone() is None:
            known = [r[0] for r in c.execute("SELECT name FROM partitions ORDER BY name")]
            raise UnknownPartitionError(f"partition {partition!r} does not exist (known: {known})")

    # ------------------------------------------------------------------------------------ writes

    def put(
        self,
        partition: str,
        keys: Sequence[str],
        fields: Mapping[str, Any] | None = None,
        tags: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        *,
        overwrite: bool = False,
    ) -> KVBatchMeta:
        """Insert entries atomically and return their meta.

        `fields`: name -> a tensor / ndarray with first dimension len(keys), or a list of one
        value per key. `tags`: one dict for all keys or one per key; `is_prompt` defaults to the
        key form (and must agree with it), `status` to "pending", `global_steps` to 0,
        `policy_version` to None. Existing keys are a DuplicateKeyError unless `overwrite`, which
        replaces their tags and all their fields (and moves them to the back of the FIFO order).
        """
        check_partition(partition)
        keys = check_keys(keys)
        tag_rows = tags_for_put(keys, tags)
        field_rows = [(partition, *row) for row in codec.encode_fields(keys, fields or {})]
        now = time.time()
        with self._txn(write=True) as c:
            c.execute("INSERT OR IGNORE INTO partitions VALUES (?, ?)", (partition, now))
            present = self._present(c, partition, keys)
            if present and not overwrite:
                raise DuplicateKeyError(
                    f"partition {partition!r}: {len(present)} keys already present, e.g. {present[:5]} "
                    f"(pass overwrite=True to replace them)"
                )
            self._delete_rows(c, partition, present)
            # Column order follows TAG_NAMES: is_prompt, status, global_steps, policy_version.
            entry_rows = [
                (partition, k, prompt_uid_of(k), *(t[name] for name in TAG_NAMES), now, now)
                for k, t in zip(keys, tag_rows, strict=True)
            ]
            c.executemany(
                "INSERT INTO entries (partition, key, prompt_uid, is_prompt, status, global_steps,"
                " policy_version, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                entry_rows,
            )
            c.executemany("INSERT INTO fields VALUES (?, ?, ?, ?, ?)", field_rows)
        return KVBatchMeta(partition, tuple(keys), tuple(tag_rows))

    def put_fields(self, partition: str, keys: Sequence[str], fields: Mapping[str, Any], **tags: Any) -> int:
        """Add or overwrite fields of existing entries (and set `tags` on them) in one transaction.

        `put_fields("train", meta.keys, {"rm_scores": scores}, status="done")`. Returns len(keys).
        """
        check_partition(partition)
        keys = check_keys(keys)
        field_rows = [(partition, *row) for row in codec.encode_fields(keys, fields)]
        with self._txn(write=True) as c:
            self._require_keys(c, partition, keys)
            c.executemany("INSERT OR REPLACE INTO fields VALUES (?, ?, ?, ?, ?)", field_rows)
            if tags:
                self.update_tags(partition, keys, **tags)
            else:
                self._touch(c, partition, keys)
        return len(keys)

    def update_tags(
        self, partition: str, keys: Sequence[str], *, where: Mapping[str, Any] | None = None, **tags: Any
    ) -> int:
        """Set tags (`status`, `global_steps`, `policy_version`) on existing keys.

        `where` (same filters as list_keys) makes it conditional: only the keys that match it at
        commit time change. Returns how many changed. Missing keys are a QueueKeyError.
        """
        check_partition(partition)
        keys = check_keys(keys)
        if not tags:
            raise ValueError("update_tags: give at least one of status=, global_steps=, policy_version=")
        if "is_prompt" in tags:
            raise ValueError(
                "update_tags: is_prompt follows the key form ('<uid>' or '<uid>_<i>') and cannot change"
            )
        values = {name: check_tag(name, v, key=None) for name, v in tags.items()}
        sets = ", ".join(f"{name} = ?" for name in values) + ", updated_at = ?"
        cond, cond_params = _where(where or {})
        changed = 0
        with self._txn(write=True) as c:
            self._require_keys(c, partition, keys)
            for chunk in _chunks(keys):
                sql = f"UPDATE entries SET {sets} WHERE partition = ? AND key IN ({_qs(chunk)}){cond}"
                changed += c.execute(
                    sql, [*values.values(), time.time(), partition, *chunk, *cond_params]
                ).rowcount
        return changed

    def claim(
        self,
        partition: str,
        n: int,
        *,
        from_status: str = "pending",
        to_status: str = "running",
        is_prompt: bool | None = True,
        **filters: Any,
    ) -> KVBatchMeta:
        """Atomically move up to `n` entries (oldest first) from `from_status` to `to_status`.

        Two processes claiming at once never get the same key. `is_prompt=None` claims prompts and
        trajectories alike; `filters` are as in list_keys. Returns the claimed entries (maybe fewer
        than n, maybe none) with their new tags.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"claim: n must be an int >= 0, got {n!r}")
        if "status" in filters:
            raise ValueError("claim: give the current status as from_status=, not status=")
        filters = dict(filters, status=from_status)
        if is_prompt is not None:
            filters["is_prompt"] = is_prompt
        to_status = check_tag("status", to_status, key=None)
        with self._txn(write=True):
            keys = self.list_keys(partition, limit=n, **filters)
            if keys:
                self.update_tags(partition, keys, status=to_status)
            return self.get_meta(partition, keys)

    def delete(self, partition: str, keys: Sequence[str], *, missing_ok: bool = False) -> int:
        """Delete entries and their fields; returns how many existed. Missing keys are a
        QueueKeyError unless `missing_ok`."""
        check_partition(partition)
        keys = check_keys(keys, validate=False)
        with self._txn(write=True) as c:
            self._require_partition(c, partition)
            present = self._present(c, partition, keys)
            if not missing_ok and len(present) != len(keys):
                missing = sorted(set(keys) - set(present))
                raise QueueKeyError(f"partition {partition!r}: cannot delete missing keys {missing[:10]}")
            self._delete_rows(c, partition, present)
        return len(present)

    def delete_trajectories(self, partition: str, prompt_uids: str | Iterable[str]) -> int:
        """Delete every trajectory (`<uid>_<i>`, is_prompt False) of the given prompt ids; the
        prompts themselves stay. Returns how many trajectories were deleted."""
        uids = [prompt_uids] if isinstance(prompt_uids, str) else list(prompt_uids)
        for uid in uids:
            if parse_key(uid)[1] is not None:
                raise ValueError(f"delete_trajectories: {uid!r} is a trajectory key, expected a prompt uid")
        with self._txn(write=True) as c:
            self._require_partition(c, partition)
            doomed = []
            for chunk in _chunks(uids):
                sql = f"SELECT key FROM entries WHERE partition = ? AND is_prompt = 0 AND prompt_uid IN ({_qs(chunk)})"
                doomed += [r[0] for r in c.execute(sql, [partition, *chunk])]
            self._delete_rows(c, partition, doomed)
        return len(doomed)

    # ------------------------------------------------------------------------------------- reads

    def get(
        self, partition: str, keys: Sequence[str], fields: Sequence[str] | None = None, *, stack: bool = False
    ) -> dict[str, Any]:
        """Read fields of keys: `{name: [value per key, in keys order]}`.

        `fields=None` reads every field, which the keys must then all have (else name them).
        `stack=True` returns tensor (ndarray) fields as one `[N, ...]` tensor (array); their per-key
        shapes and dtypes must match. Missing keys or fields are a QueueKeyError.
        """
        check_partition(partition)
        keys = check_keys(keys, validate=False)
        if isinstance(fields, str):
            raise TypeError(f"get: fields must be a list of names, got the string {fields!r}")
        names = None if fields is None else list(dict.fromkeys(fields))
        found: dict[tuple[str, str], tuple[str, bytes]] = {}
        with self._txn(write=False) as c:
            self._require_keys(c, partition, keys)
            if names == []:
                return {}
            name_sql = "" if names is None else f" AND name IN ({_qs(names)})"
            for chunk in _chunks(keys):
                rows = c.execute(
                    f"SELECT key, name, kind, blob FROM fields WHERE partition = ? AND key IN ({_qs(chunk)}){name_sql}",
                    [partition, *chunk, *(names or [])],
                )
                found.update(((k, name), (kind, blob)) for k, name, kind, blob in rows)
        if names is None:
            names = sorted({name for _, name in found})
        out = {}
        for name in names:
            missing = [k for k in keys if (k, name) not in found]
            if missing:
                raise QueueKeyError(
                    f"partition {partition!r}: field {name!r} is missing for {len(missing)} of {len(keys)} keys, "
                    f"e.g. {missing[:5]}"
                    + (" (pass fields=[...] to read a subset)" if fields is None else "")
                )
            values = [codec.decode_value(*found[(k, name)], field=name, key=k) for k in keys]
            out[name] = codec.stack_values(name, values) if stack and values else values
        return out

    def list_keys(self, partition: str, *, limit: int | None = None, **filters: Any) -> list[str]:
        """Keys in insertion order whose tags match every filter.

        A filter is a tag name (or `prompt_uid`) = value; a tuple / list / set means "any of";
        None means unset. `list_keys("train", is_prompt=True, status=("pending", "running"))`.
        """
        cond, params = _where(filters)
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
            raise ValueError(f"list_keys: limit must be None or an int >= 0, got {limit!r}")
        lim = "" if limit is None else f" LIMIT {limit}"
        with self._txn(write=False) as c:
            self._require_partition(c, partition)
            rows = c.execute(
                f"SELECT key FROM entries WHERE partition = ?{cond} ORDER BY seq{lim}", [partition, *params]
            )
            return [r[0] for r in rows]

    def count(self, partition: str, **filters: Any) -> int:
        """How many entries match the filters (as in list_keys)."""
        cond, params = _where(filters)
        with self._txn(write=False) as c:
            self._require_partition(c, partition)
            return c.execute(
                f"SELECT COUNT(*) FROM entries WHERE partition = ?{cond}", [partition, *params]
            ).fetchone()[0]

    def get_tags(self, partition: str, keys: Sequence[str]) -> list[dict[str, Any]]:
        """Tags of each key, in keys order; missing keys are a QueueKeyError."""
        check_partition(partition)
        keys = check_keys(keys, validate=False)
        tags = {}
        with self._txn(write=False) as c:
            self._require_keys(c, partition, keys)
            for chunk in _chunks(keys):
                for k, is_prompt, status, steps, version in c.execute(
                    f"SELECT key, is_prompt, status, global_steps, policy_version FROM entries"
                    f" WHERE partition = ? AND key IN ({_qs(chunk)})",
                    [partition, *chunk],
                ):
                    tags[k] = {
                        "is_prompt": bool(is_prompt),
                        "status": status,
                        "global_steps": steps,
                        "policy_version": version,
                    }
        return [tags[k] for k in keys]

    def get_meta(self, partition: str, keys: Sequence[str]) -> KVBatchMeta:
        """KVBatchMeta of existing keys, with their current tags."""
        return KVBatchMeta(partition, tuple(keys), tuple(self.get_tags(partition, keys)))

    # ---------------------------------------------------------------------------------- helpers

    def _present(self, c: sqlite3.Connection, partition: str, keys: Sequence[str]) -> list[str]:
        present = set()
        for chunk in _chunks(keys):
            rows = c.execute(
                f"SELECT key FROM entries WHERE partition = ? AND key IN ({_qs(chunk)})", [partition, *chunk]
            )
            present.update(r[0] for r in rows)
        return [k for k in keys if k in present]

    def _require_keys(self, c: sqlite3.Connection, partition: str, keys: Sequence[str]) -> None:
        self._require_partition(c, partition)
        present = self._present(c, partition, keys)
        if len(present) != len(keys):
            missing = [k for k in keys if k not in set(present)]
            raise QueueKeyError(
                f"partition {partition!r}: {len(missing)} keys not present, e.g. {missing[:10]}"
            )

    def _delete_rows(self, c: sqlite3.Connection, partition: str, keys: Sequence[str]) -> None:
        for chunk in _chunks(keys):
            c.execute(
                f"DELETE FROM fields WHERE partition = ? AND key IN ({_qs(chunk)})", [partition, *chunk]
            )
            c.execute(
                f"DELETE FROM entries WHERE partition = ? AND key IN ({_qs(chunk)})", [partition, *chunk]
            )

    def _touch(self, c: sqlite3.Connection, partition: str, keys: Sequence[str]) -> None:
        now = time.time()
        for chunk in _chunks(keys):
            c.execute(
                f"UPDATE entries SET updated_at = ? WHERE partition = ? AND key IN ({_qs(chunk)})",
                [now, partition, *chunk],
            )


# --------------------------------------------------------------------------- argument checking


def _where(filters: Mapping[str, Any]) -> tuple[str, list]:
    """SQL ` AND ...` conditions and their parameters for tag filters."""
    sql, params = [], []
    for name, value in filters.items():
        if name not in FILTER_NAMES:
            raise ValueError(f"unknown filter {name!r}: expected one of {FILTER_NAMES}")
        many = isinstance(value, (tuple, list, set, frozenset))
        values = [_check_filter(name, v) for v in (value if many else [value])]
        real = [v for v in values if v is not None]
        parts = [f"{name} IN ({_qs(real)})"] if real else []
        if len(real) != len(values):
            parts.append(f"{name} IS NULL")
        sql.append(" AND (" + " OR ".join(parts) + ")" if parts else " AND 0")
        params += [int(v) if isinstance(v, bool) else v for v in real]
    return "".join(sql), params


def _check_filter(name: str, value: Any) -> Any:
    if name == "prompt_uid":
        if not isinstance(value, str):
            raise ValueError(f"filter prompt_uid={value!r}: expected a str")
        return value
    return check_tag(name, value, key=None)


def _chunks(seq: Sequence) -> Iterator[Sequence]:
    for i in range(0, len(seq), _CHUNK):
        yield seq[i : i + _CHUNK]


def _qs(seq: Sized) -> str:
    return ", ".join("?" * len(seq))
