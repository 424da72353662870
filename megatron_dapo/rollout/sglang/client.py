"""The engine's HTTP client, bounded whatever the batch size: how many requests may be in flight at once
(threads and sockets), one shared connection pool, and the errors that are the client's own.

At the recipes' numbers rank 0 posts 1,536 generation requests per batch (24,576 rows in requests of 16). A
thread and a socket per request would pass the common soft RLIMIT_NOFILE of 1,024: `socket()` then fails with
EMFILE, requests reports a ConnectionError, and a client that reads that as a dead server takes healthy
servers down. So:

- at start the soft file limit is raised to the hard one (`raise_open_file_limit`);
- the requests in flight at once (the engine's worker threads, each holding at most one socket while it
  posts) are capped at half of what the limit leaves after FD_RESERVE for everything else the process
  opens (`request_slots`); the rest of a batch waits in the client's queue, which costs nothing the
  servers would not queue anyway;
- one `requests.Session` shared by the threads keeps at most `per_host(...)` idle connections per server,
  so idle connections too stay within the other half (a connection beyond that is closed after use);
- EMFILE / ENFILE (`is_client_resource_error`) and a refused thread start are the client's errors, named as
  such, never a server's;
- a /generate reply is read in chunks of READ_CHUNK (`post_read`), not requests' 10 KiB: a reply of 16 rows
  is 0.8 MB at 1,000 tokens and 23 MB with R3 routing at 700, read by rank 0's threads under the GIL;
- at most REPLIES_AT_ONCE replies are read and being made rows at once (`ReplySlots`): a thread takes a
  slot when its reply's headers arrive and reads the body only then, so a burst of finished requests
  (the end of a batch, a stop that aborts the rest) holds that many bodies, not one per request in flight;
- a reply of MAPPED_BODY bytes or more is read into its own anonymous memory map, which goes back to the
  system when the reply is dropped. Joined into one bytes object, a body below glibc's 32 MiB mmap ceiling
  comes from the reply thread's malloc arena, which keeps the freed memory: about 0.75 GiB of rank 0's
  peak in bench_rank0.py --r3 (31 MB replies, threads spread over 16 arenas) that held no data.
"""

from __future__ import annotations

import errno
import logging
import mmap
import threading
from collections.abc import Callable

import requests
from requests.adapters import HTTPAdapter

log = logging.getLogger(__name__)

FD_RESERVE = 256
"""File descriptors left for everything but generation requests: checkpoints, logs, the trainer's gloo and
NCCL sockets, shared-memory handles, the control calls and health probes."""
MIN_SLOTS = 16
READ_CHUNK = 1 << 20
"""Bytes per read of a reply body. requests' own 10 KiB (`Response.content`) cost 30-35 ms of client CPU per
23 MB reply (16 rows of 700 tokens with R3 routing at 48 layers x top-8), 1 MiB chunks 11-13 ms: measured
with a local HTTP server and `time.process_time` on the 2-core CI machine."""
MAPPED_BODY = 1 << 20
"""A reply body of at least this many bytes (its Content-Length) is read into an anonymous memory map."""
REPLIES_AT_ONCE = 4
"""Replies read and being made rows at once (`ReplySlots`): the bound of plan/host.py's "replies in parse".
The JSON parse holds the GIL, so more at once would not parse faster; four let R3's routing decode (GIL
released) and body reads overlap the parse of another reply."""


class ReplySlots:
    """At most `n` replies read and being made rows at once in this process. A thread takes a slot when its
    reply's headers arrive (`post_read`'s on_headers), before the body is read, and gives it back once the
    reply is rows or has failed; `give` does nothing for a thread that holds no slot, so every exit may call
    it. `held` counts the slots taken now, `most` the most taken at once (what the planner's term bounds)."""

    def __init__(self, n: int = REPLIES_AT_ONCE):
        if n < 1:
            raise ValueError(f"ReplySlots(n={n}): expected at least one slot")
        self.n, self.held, self.most = n, 0, 0
        self._free = threading.BoundedSemaphore(n)
        self._mine = threading.local()
        self._count = threading.Lock()

    def take(self) -> None:
        self._free.acquire()
        self._mine.held = True
        with self._count:
            self.held += 1
            self.most = max(self.most, self.held)

    def give(self) -> None:
        if getattr(self._mine, "held", False):
            self._mine.held = False
            with self._count:
                self.held -= 1
            self._free.release()


def raise_open_file_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; returns (soft, hard) after."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:  # a container may refuse; the slots then follow the soft limit
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, want, e)
    return soft, hard


def request_slots(max_concurrency: int, num_servers: int, soft_limit: int) -> int:
    """Requests in flight at once: max_concurrency per server, capped by half the open-file limit less
    FD_RESERVE (one socket per request in flight, as many kept idle at most), at least MIN_SLOTS."""
    want = max_concurrency * num_servers
    budget = max(MIN_SLOTS, (soft_limit - FD_RESERVE) // 2) if soft_limit > 0 else want
    if want > budget:
        log.info("SGLang client: %d requests in flight at most (open-file limit %d), not %d", budget, soft_limit,
                 want)
    return min(want, budget)


def per_host(max_concurrency: int, num_servers: int, slots: int) -> int:
    """Idle connections kept per server: its share of the slots, at most max_concurrency."""
    return max(1, min(max_concurrency, -(-slots // max(num_servers, 1))))


def shared_session(num_servers: int, per_host: int) -> requests.Session:
    """One session for every worker thread: a connection pool per server keeping at most `per_host` idle
    connections (more are opened while needed and closed after)."""
    s = requests.Session()
    adapter = HTTPAdapter(pool_connections=max(num_servers, 1), pool_maxsize=max(per_host, 1), max_retries=0)
    s.mount("http://", adapter)
    s.mount("https://", adapter)
    return s


def post_read(session: requests.Session, url: str, payload, *, timeout,
              on_headers: Callable[[], None] | None = None) -> tuple[int, bytes | mmap.mmap]:
    """POST `payload` as JSON and read the whole reply in READ_CHUNK reads: (status code, body); a body of
    MAPPED_BODY bytes or more (by its Content-Length, not compressed) is an mmap.mmap of exactly its bytes
    (`json_bytes` gives the JSON parser a view of it). on_headers is called once the reply's headers are in,
    before its body is read (ReplySlots.take). Raises what `session.post` with the body read would
    (Timeout, ConnectionError, ChunkedEncodingError, also for a body shorter than its Content-Length); the
    connection returns to the pool once the body is read, and is closed when it was not."""
    r = session.post(url, json=payload, stream=True, timeout=timeout)
    try:
        if on_headers is not None:
            on_headers()
        size = r.headers.get("Content-Length", "")
        if size.isdigit() and int(size) >= MAPPED_BODY and "Content-Encoding" not in r.headers:
            return r.status_code, _read_mapped(r, int(size))
        return r.status_code, b"".join(r.iter_content(READ_CHUNK))
    finally:
        r.close()


def _read_mapped(r: requests.Response, size: int) -> mmap.mmap:
    """The body of `r` (stream=True) in an anonymous map of `size` bytes, each chunk copied in as it is read."""
    body, got = mmap.mmap(-1, size), 0
    for chunk in r.iter_content(READ_CHUNK):
        if got + len(chunk) > size:
            raise requests.exceptions.ChunkedEncodingError(f"{r.url}: a body longer than its Content-Length {size}")
        body[got:got + len(chunk)] = chunk
        got += len(chunk)
    if got != size:
        raise requests.exceptions.ChunkedEncodingError(f"{r.url}: the body ended after {got} of its {size} bytes")
    return body


def json_bytes(body: bytes | mmap.mmap) -> bytes | memoryview:
    """What the JSON parser reads of a body from post_read (orjson takes bytes or a memoryview, not a map)."""
    return body if isinstance(body, bytes) else memoryview(body)


def body_text(body: bytes, limit: int) -> str:
    """The first `limit` characters of a body, for an error message."""
    return body[:limit * 4].decode("utf-8", errors="replace")[:limit]


def is_client_resource_error(exc: BaseException) -> bool:
    """The exception (or one it wraps) is this process running out of file descriptors (EMFILE, ENFILE) or
    memory for a socket (ENOBUFS, ENOMEM): the client's limit, not the server's failure."""
    seen = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
            return True
        if "Too many open files" in str(e):
            return True
        stack.extend([e.__cause__, e.__context__, *(a for a in getattr(e, "args", ()) if isinstance(a, BaseException))])
        reason = getattr(e, "reason", None)
        if isinstance(reason, BaseException):
            stack.append(reason)
    return False
