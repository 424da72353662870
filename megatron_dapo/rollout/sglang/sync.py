"""Actor -> SGLang weight sync that reaches every server with every tensor, across processes and nodes.

Who sends (DESIGN.md, "Every tensor reaches every engine"): the first rank of each pipeline stage, the
stage's sender (models.weights.is_stage_sender). `models.hf.iter_stage_hf_tensors` streams the stage's
tensors to it one parameter at a time: TP shards gathered over TP (dist.gather, not all_gather), experts
over expert-TP and then over EP, so the sender also holds the experts of every EP rank. Only senders
ever hold full tensors, and only one parameter plus one bucket at a time. Stages send in turn (stage 0,
then stage 1, ...; a barrier on the gloo control group between them), so a server never has two
updates in flight and the last bucket of the last stage flushes the cache and sets the version.

Two transports, chosen per run (`rollout.weight_transport`):

- "distributed" (disaggregated servers, any node; also colocated on CPU): at start every stage sender
  opens its own weight-update group with every TP rank of every server (SGLang's
  /init_weights_update_group; group `<prefix>_pp<stage>`, the sender is group rank 0 and hosts the
  TCP store on a free port of `host`). Per bucket the sender posts /update_weights_from_distributed
  (names, dtypes, shapes) to every server and broadcasts the bucket's bytes as one tensor (NCCL on CUDA:
  device tensors, no host copy; gloo on CPU).
- "ipc" (colocated: servers on the trainer's GPUs, where NCCL refuses two ranks on one GPU): per
  bucket the sender broadcasts the bucket's bytes over a fan-out group (senders + the first rank of every
  node) and each node's first rank posts /update_weights_from_tensor to the servers on its node, one
  ForkingPickler serialization per server TP rank: CUDA IPC handles on GPU.

Both send a bucket as SGLang's "flattened_bucket" (weights.FLATTENED_BUCKET): the tensors' bytes end to end,
one collective and one shared handle per bucket instead of one per tensor (18,867 tensors per sync at
Qwen3-30B-A3B's structure: 4.4-5.8 s -> 2.1-2.5 s a sync on the CPU benchmark, docs/benchmarks.md). A bucket
whose tensors would not sit at offsets their element sizes divide (mixed dtypes) goes tensor by tensor. On CPU the same path runs
  with torch's "file_system" sharing strategy (shared-memory file names, which any process on the node
  can open, like CUDA IPC handles and unlike the default file descriptors). Handles never leave a node.

A server lost during a sync. With "ipc" every server gets its own POSTs: one that fails (its process died,
or it refuses a bucket) gets nothing more in this sync, the others get everything, and the sync reports it
in `SyncStats.lost` (the same on every rank) for the caller to take it out of rotation; only when every
server is lost does the sync fail. With "distributed" the servers receive in one collective per stage, so
a member that dies mid-bucket leaves the broadcast incomplete for everyone: each bucket is bounded by
`bucket_timeout_s` (well under the group's timeout), after which the sender abandons its group (no NCCL
watchdog teardown) and every rank raises the same WeightSyncError naming the servers that did not answer;
the run resumes from its checkpoint. (The survivors stay blocked in that broadcast until their own group
timeout, so re-forming the group with them at once is not possible.)

Bytes per sync (P parameters of the stage, in the training dtype): the sender of a stage receives
about P_stage*(tp-1)/tp over TP and the experts of the other EP ranks, and sends P_stage once per
server TP rank in distributed mode (a broadcast: once on the wire per receiver with gloo; NCCL's ring
moves it once per link), or once to each node's first rank in ipc mode. Other ranks send their shard
once. `SyncStats` reports what this rank moved.

Shape legend: tensors keep their own shapes; bucket sizes count numel * element_size bytes.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from megatron_dapo.models.arch import ModelArch
from megatron_dapo.models.hf import iter_stage_hf_groups
from megatron_dapo.models.weights import is_stage_sender
from megatron_dapo.parallel import bound_tcp_store
from megatron_dapo.rollout.sglang import weights as sw
from megatron_dapo.rollout.sglang.payloads import post_control

log = logging.getLogger(__name__)

TRANSPORTS = ("distributed", "ipc")
MIB = sw.MIB
JOIN_AFTER_REPLY_S = 30.0
"""How long the group may take to form after every server answered /init_weights_update_group."""


class WeightSyncError(RuntimeError):
    """A weight sync step failed: the message names the server, the route and the stage."""


@dataclass(frozen=True)
class ServerSet:
    """The servers a sync feeds: URLs, their TP sizes, and the trainer node each runs on (ipc transport)."""

    urls: tuple[str, ...]
    tp_sizes: tuple[int, ...]
    nodes: tuple[int, ...] = ()
    """Node index (torchrun GROUP_RANK) of each server; empty = all on node 0."""

    def __post_init__(self):
        if not self.urls or len(self.urls) != len(self.tp_sizes):
            raise ValueError(f"ServerSet: {len(self.urls)} urls but {len(self.tp_sizes)} tp_sizes")
        if self.nodes and len(self.nodes) != len(self.urls):
            raise ValueError(f"ServerSet: {len(self.urls)} urls but {len(self.nodes)} node indices")

    def node_of(self, i: int) -> int:
        return self.nodes[i] if self.nodes else 0


@dataclass
class SyncStats:
    """What one rank did in one sync (bytes in the tensors' dtype)."""

    seconds: float = 0.0
    buckets: int = 0
    flattened_buckets: int = 0
    """Of `buckets`, those sent as one byte tensor (weights.FLATTENED_BUCKET); the others went tensor by tensor."""
    tensors: int = 0
    bytes_sent: int = 0
    """Bytes this rank put on the wire to servers or node leaders."""
    bytes_gathered: int = 0
    """Bytes this rank received from other trainer ranks (TP / EP gathers, ipc fan-out)."""
    names: list[str] = field(default_factory=list)
    lost: dict[str, str] = field(default_factory=dict)
    """ipc: servers that failed a POST of this sync and got nothing after it, with the error (every rank)."""


def post_each(urls: Sequence[str], path: str, bodies: Sequence[Any], *, timeout_s: float) -> dict[str, str | None]:
    """POST bodies[i] to urls[i] concurrently; {url: error text or None}."""
    with ThreadPoolExecutor(max_workers=max(min(len(urls), 32), 1)) as pool:
        errors = list(pool.map(lambda u, b: post_control(u, path, b, timeout_s=timeout_s), urls, bodies))
    return dict(zip(urls, errors, strict=True))


def post_all(urls: Sequence[str], path: str, bodies: Sequence[Any], *, timeout_s: float) -> None:
    """POST bodies[i] to urls[i] concurrently; raise WeightSyncError naming every server that failed
    (an HTTP status other than 200, or a JSON `success: false`)."""
    errors = post_each(urls, path, bodies, timeout_s=timeout_s)
    failed = [f"{u}{path}: {e}" for u, e in errors.items() if e is not None]
    if failed:
        raise WeightSyncError("; ".join(failed))


def reachable_address(urls: Sequence[str]) -> str:
    """The local address the servers can reach this process at: loopback when every server is on
    loopback, else the address of the interface that routes to the first server."""
    hosts = [urlparse(u).hostname or "" for u in urls]
    if all(h in ("127.0.0.1", "localhost", "::1") for h in hosts):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((hosts[0], 1))  # no packet is sent: this only picks the outgoing interface
        return s.getsockname()[0]


def _open_group(servers: ServerSet, *, host: str, group_name: str, backend: str, timeout_s: float):
    """Sender side of one weight-update group (rank 0, hosting the store); the servers join through
    /init_weights_update_group, posted concurrently because they block until every rank has joined.
    A server that refuses fails this at once with its own message, not after the timeout."""
    from torch.distributed import distributed_c10d as c10d

    offsets, world_size = sw.weight_group_layout(list(servers.tp_sizes))
    timeout = timedelta(seconds=timeout_s)
    store = bound_tcp_store(host, world_size, timeout=timeout, wait_for_workers=False)  # on `host` only
    bodies = [sw.init_weights_update_group_payload(master_address=host, master_port=store.port, rank_offset=off,
                                                   world_size=world_size, group_name=group_name, backend=backend)
              for off in offsets]
    posting = _in_daemon_thread(post_all, servers.urls, "/init_weights_update_group", bodies, timeout_s=timeout_s)
    joining = _in_daemon_thread(c10d._new_process_group_helper, world_size, 0, [], c10d.Backend(backend),
                                c10d.PrefixStore(group_name, store), group_name=group_name, timeout=timeout)
    deadline, replied_at = time.monotonic() + timeout_s, None
    while not joining.done():
        if posting.done() and posting.exception() is not None:
            raise WeightSyncError(f"weight-update group {group_name!r} at {host}:{store.port}: "
                                  f"{posting.exception()}") from posting.exception()
        if posting.done() and replied_at is None:
            replied_at = time.monotonic()
        # SGLang answers /init_weights_update_group once its ranks have joined: a reply without a join
        # means the servers use another group, address or port.
        if replied_at is not None and time.monotonic() - replied_at > JOIN_AFTER_REPLY_S:
            raise WeightSyncError(f"weight-update group {group_name!r} at {host}:{store.port}: every server replied "
                                  f"to /init_weights_update_group but they did not join within "
                                  f"{JOIN_AFTER_REPLY_S:g} s")
        if time.monotonic() > deadline:
            raise WeightSyncError(f"weight-update group {group_name!r} at {host}:{store.port}: the servers did not "
                                  f"join within {timeout_s:g} s (rollout.weight_sync_timeout_s)")
        time.sleep(0.01)
    pg, _ = joining.result()
    posting.result()
    return pg, store


def _in_daemon_thread(fn: Callable, *args, **kwargs) -> Future:
    """fn(*args, **kwargs) in a daemon thread. After a failed join the group's thread stays blocked until
    the store's timeout; a daemon thread lets the process exit with its WeightSyncError at once (a
    ThreadPoolExecutor's workers are joined at interpreter exit, which held it for that timeout)."""
    future: Future = Future()

    def run():
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
            future.set_exception(e)

    threading.Thread(target=run, name=f"weight-sync-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return future


class SGLangWeightSync:
    """Set up once (`setup`, a collective of every trainer rank), then `sync(version)` every step."""

    def __init__(self, servers: ServerSet, *, pgs, chunks: Sequence, arch: ModelArch, transport: str,
                 bucket_bytes: int, timeout_s: float = 600.0, bucket_timeout_s: float | None = None,
                 host: str | None = None,
                 group_prefix: str = "megatron_dapo_w", drop_mtp: bool = True,
                 session: Callable[[str], None] | None = None, node: int | None = None,
                 node_leader: bool | None = None, selector: str | None = None, flatten: bool = True):
        """chunks: this rank's unwrapped model chunks (virtual stages in order). session(event): called on
        rank 0 with "begin" before the first bucket and "end" after the last (SGLang's weight-update
        session, for the releases that have one). node / node_leader: this rank's node index and
        whether it is the node's first rank (default: torchrun's GROUP_RANK and LOCAL_RANK == 0).
        drop_mtp=False sends the MTP layers too, under the drafter's names; selector: the `selector` of
        every update body (SGLang 0.5.21+: "all" loads into the target and the drafter), None = absent
        (rollout/sglang/drafter.py decides both). timeout_s: joining a group; bucket_timeout_s (default
        timeout_s): one bucket, from its first POST to the last server's reply (module docstring).
        flatten: each bucket travels as one byte tensor (SGLang's flattened_bucket load format,
        weights.FLATTENED_BUCKET), else tensor by tensor."""
        if transport not in TRANSPORTS:
            raise ValueError(f"rollout.weight_transport must be one of {TRANSPORTS}, got {transport!r}")
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be an int >= 1, got {bucket_bytes!r}")
        self.servers, self.pgs, self.chunks, self.arch = servers, pgs, list(chunks), arch
        self.transport, self.bucket_bytes, self.timeout_s = transport, bucket_bytes, timeout_s
        self.bucket_timeout_s = timeout_s if bucket_timeout_s is None else bucket_timeout_s
        if not 0 < self.bucket_timeout_s <= timeout_s:
            raise ValueError(f"bucket_timeout_s must be in (0, timeout_s={timeout_s:g}], got {bucket_timeout_s!r}")
        self.host = host or reachable_address(servers.urls)
        self.group_prefix, self.drop_mtp, self.session = group_prefix, drop_mtp, session
        self.selector, self.flatten = selector, flatten
        self.node = int(os.environ.get("GROUP_RANK", 0)) if node is None else node
        self.node_leader = int(os.environ.get("LOCAL_RANK", 0)) == 0 if node_leader is None else node_leader
        self.sender = is_stage_sender(pgs)
        if self.sender and pgs.rank != pgs.pp_rank * (pgs.world_size // pgs.pp_size):
            raise WeightSyncError(f"rank {pgs.rank} sends stage {pgs.pp_rank} but is not its first rank: "
                                  "the parallel layout is not Megatron's tp-cp-ep-dp-pp order")
        self.backend = "nccl" if pgs.device.type == "cuda" else "gloo"
        self._group = None  # distributed: this sender's weight-update group
        self._store = None
        self._token = ""  # distributed: this trainer start's part of the group names
        self._regroups = 0
        self._set_active(tuple(range(len(servers.urls))))
        self._fanout = None  # ipc: senders + node leaders
        self._fanout_ranks: list[int] = []
        self._leaders: dict[int, int] = {}  # node -> global rank of its first rank
        self._error: str | None = None  # this rank's first failure of the current collective step
        self._lost: dict[str, str] = {}  # ipc: servers this rank saw fail in the current sync
        self._epochs: dict[str, int] | None = None  # the targets' epochs when the groups were last formed
        self._abandoned: list = []  # groups of buckets that did not complete (kept, never destroyed: _abandon_group)
        self._flush = True  # the current sync flushes the servers' cache with its version (sync())
        self.last_stats: SyncStats | None = None  # this rank's SyncStats of the last sync

    # ------------------------------------------------------------------------------------ set-up
    def setup(self) -> None:
        pgs = self.pgs
        if self.transport == "distributed":
            # A name of its own per trainer start: servers that outlive a crashed run still hold its groups.
            token = [os.urandom(4).hex()]
            if pgs.world_size > 1:
                dist.broadcast_object_list(token, src=0, group=pgs.ctrl)
            self._token = token[0]
            self._open_groups()
            return
        # ipc: every rank learns who the senders and node leaders are, then all create the fan-out group.
        roles = [None] * pgs.world_size
        dist.all_gather_object(roles, (self.sender, self.node_leader, self.node), group=pgs.ctrl)
        self._leaders = {node: r for r, (_, leader, node) in enumerate(roles) if leader}
        missing = sorted({self.servers.node_of(i) for i in range(len(self.servers.urls))} - set(self._leaders))
        if missing:
            raise WeightSyncError(f"servers run on nodes {missing}, which have no trainer rank")
        self._fanout_ranks = sorted({r for r, (sender, leader, _) in enumerate(roles) if sender or leader})
        group = dist.new_group(ranks=self._fanout_ranks, backend=self.backend)
        self._fanout = group if pgs.rank in self._fanout_ranks else None
        if self.backend == "gloo":
            # CPU tensors crossing to an unrelated process must travel by shared-memory file name
            # (the default file descriptors open only in the sender's own children).
            torch.multiprocessing.set_sharing_strategy("file_system")

    def _set_active(self, active: tuple[int, ...]) -> None:
        """The servers the syncs feed from now on: `active` (indices into `servers`) and their ServerSet."""
        s = self.servers
        self.active = active
        self.active_servers = ServerSet(urls=tuple(s.urls[i] for i in active),
                                        tp_sizes=tuple(s.tp_sizes[i] for i in active),
                                        nodes=tuple(s.nodes[i] for i in active) if s.nodes else ())

    def _open_groups(self) -> None:
        """distributed: each stage's sender opens its weight-update group with the active servers, stages
        in turn (a server joins one group at a time); a collective of all ranks."""
        pgs, servers = self.pgs, self.active_servers
        suffix = f"_r{self._regroups}" if self._regroups else ""
        for stage in range(pgs.pp_size):
            if pgs.pp_rank == stage and self.sender:
                name = f"{self.group_prefix}_{self._token}_pp{stage}{suffix}"

                def open_group(name=name):
                    self._group, self._store = _open_group(servers, host=self.host, group_name=name,
                                                           backend=self.backend, timeout_s=self.timeout_s)
                    self._group_name = name

                self._guard(open_group, f"open the weight-update group of stage {stage}")
            self._agree()

    def _regroup(self, active: tuple[int, ...]) -> None:
        """distributed: the servers changed (one left, or came back restarted): every sender leaves its
        group (the servers that stay in it are told to destroy it; a lost one is not contacted) and opens
        a new one, under a new name, with the servers now active."""
        self._leave_group([self.servers.urls[i] for i in self.active if i in active])
        self._set_active(active)
        self._regroups += 1
        self._open_groups()

    # ------------------------------------------------------------------------------------ one sync
    def sync(self, version: int, targets: Sequence[str] | None = None, *, flush_cache: bool = True,
             epochs: Sequence[int] | None = None) -> SyncStats:
        """Every tensor of every stage to every server (or to `targets`, the URLs of the servers to feed,
        the same list on every rank), then the version; a collective of all ranks. With the distributed
        transport a change of targets re-forms the weight-update groups first (`_regroup`), as does a
        change of `epochs` (per target, how often its server went down: a new process has no groups).

        flush_cache=False keeps the servers' KV cache: for a sync into generation paused in place (the
        running requests keep their cache and continue under the new weights; SGLang fails an update that
        asks for a flush while requests run). The servers then need --disable-radix-cache, or new
        requests would reuse prefixes cached under older weights.

        A failure on one rank (a server refusing a bucket, a dead server) never leaves the others
        waiting: that rank keeps taking part in its stage's gathers and fan-out without sending, and at
        the end of the stage every rank raises the same WeightSyncError naming the rank and the server."""
        t0 = time.perf_counter()
        stats, pgs = SyncStats(), self.pgs
        self._error, self._flush, self._lost = None, flush_cache, {}
        if targets is not None:
            unknown = sorted(set(targets) - set(self.servers.urls))
            if unknown or not targets:
                raise WeightSyncError(f"sync targets {list(targets)} are not a non-empty subset of {self.servers.urls}")
            active = tuple(i for i, u in enumerate(self.servers.urls) if u in set(targets))
            born = None if epochs is None else dict(zip(targets, epochs, strict=True))
            renewed = born is not None and self._epochs is not None and any(
                born[self.servers.urls[i]] != self._epochs.get(self.servers.urls[i]) for i in active)
            if active != self.active or renewed:
                if self.transport == "distributed":
                    self._regroup(active)
                else:
                    self._set_active(active)
            if born is not None:
                self._epochs = born
        traffic: dict[str, int] = {}
        if pgs.rank == 0 and self.session is not None:
            self._guard(lambda: self.session("begin"), "begin the weight-update session")
        self._agree()
        for stage in range(pgs.pp_size):
            in_stage = pgs.pp_rank == stage
            buckets = self._stage_buckets(stats, traffic) if in_stage else iter(())
            if self.transport == "distributed":
                for bucket in buckets:
                    if self.sender and self._error is None:
                        self._guard(lambda b=bucket: self._send_bucket(b, stats), f"stage {stage}")
                if in_stage and self.sender and stage == pgs.pp_size - 1 and self._error is None:
                    # flush the cache, set the version
                    self._guard(lambda: self._post_distributed([], version=version), f"stage {stage}")
            elif self._fanout is not None or in_stage:
                self._fan_out(buckets, stage=stage, version=version, last_stage=stage == pgs.pp_size - 1,
                              stats=stats)
            self._agree()
        if pgs.rank == 0 and self.session is not None:
            self._guard(lambda: self.session("end"), "end the weight-update session")
        self._agree()
        stats.lost = self._agree_lost()
        stats.bytes_gathered += traffic.get("received", 0)
        stats.bytes_sent += traffic.get("sent", 0)
        stats.seconds = time.perf_counter() - t0
        self.last_stats = stats
        return stats

    def _guard(self, fn, what: str) -> None:
        """Run fn; keep its error (the first) for _agree instead of leaving the collectives."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - raised on every rank by _agree
            if self._error is None:
                self._error = f"rank {self.pgs.rank} ({what}): {type(e).__name__}: {e}"

    def _agree(self) -> None:
        """A barrier that also carries errors: every rank raises the same WeightSyncError."""
        if self.pgs.world_size == 1:
            errors = [self._error]
        else:
            errors = [None] * self.pgs.world_size
            dist.all_gather_object(errors, self._error, group=self.pgs.ctrl)
        failed = [e for e in errors if e is not None]
        if failed:
            raise WeightSyncError("weight sync failed: " + "; ".join(failed))

    def _agree_lost(self) -> dict[str, str]:
        """ipc: the servers any rank lost in this sync, known on every rank; WeightSyncError when that is
        every server fed (no server holds the new weights)."""
        if self.pgs.world_size == 1:
            merged = dict(self._lost)
        else:
            parts = [None] * self.pgs.world_size
            dist.all_gather_object(parts, self._lost, group=self.pgs.ctrl)
            merged = {u: e for part in parts for u, e in part.items()}
        if merged:
            log.warning("weight sync: %d of %d servers lost: %s", len(merged), len(self.active), merged)
        if merged and set(merged) >= set(self.active_servers.urls):
            raise WeightSyncError("weight sync failed on every server: " + "; ".join(
                f"{u}: {e}" for u, e in merged.items()))
        return merged

    def _stage_buckets(self, stats: SyncStats, traffic: dict):
        """Buckets of whole parameters (a parameter's HF pieces stay together), cut at bucket_bytes by
        the sizes every rank of the stage knows, so every rank of the stage cuts the same buckets; a
        parameter larger than a bucket travels alone. Pieces exist on the sender only."""
        bucket: list = []
        size = 0
        for chunk in self.chunks:
            for name, pieces, nbytes in iter_stage_hf_groups(chunk, pgs=self.pgs, arch=self.arch,
                                                             drop_mtp=self.drop_mtp, traffic=traffic):
                if bucket and size + nbytes > self.bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
                bucket.append((name, pieces, nbytes))
                size += nbytes
                if pieces is not None:
                    stats.tensors += len(pieces)
                    stats.names.extend(n for n, _ in pieces)
        if bucket:
            yield bucket

    def _post_distributed(self, tensors: list[tuple[str, torch.Tensor]], *, version: int | None = None,
                          replied: dict | None = None, flattened: bool = False) -> None:
        """POST one bucket's update to every active server (`replied`: filled with each server's answer, as
        it comes, for the deadline's message; `flattened`: the bucket travels as one byte tensor)."""
        body = sw.distributed_update_payload(tensors, group_name=self._group_name,
                                             flush_cache=version is not None and self._flush,
                                             weight_version=None if version is None else str(version),
                                             load_format=sw.FLATTENED_BUCKET if flattened else None)
        if self.selector is not None:
            body["selector"] = self.selector
        urls = self.active_servers.urls

        def post(url: str) -> str | None:
            err = post_control(url, "/update_weights_from_distributed", body, timeout_s=self.bucket_timeout_s)
            if replied is not None:
                replied[url] = err
            return err

        with ThreadPoolExecutor(max_workers=max(min(len(urls), 32), 1)) as pool:
            errors = dict(zip(urls, pool.map(post, urls), strict=True))
        failed = [f"{u}/update_weights_from_distributed: {e}" for u, e in errors.items() if e is not None]
        if failed:
            raise WeightSyncError(f"pipeline stage {self.pgs.pp_rank}: " + "; ".join(failed))

    def _send_bucket(self, bucket: list, stats: SyncStats) -> None:
        """Post the bucket's names / dtypes / shapes, broadcast its tensors in that order, wait for every
        server's reply (the servers wait in the broadcasts meanwhile), all within bucket_timeout_s. A server
        that fails or does not answer in time breaks the collective for every member: the group is
        abandoned (`_abandon_group`) and the error names the servers that did not answer."""
        tensors = [(n, t.detach().contiguous()) for _, pieces, _ in bucket for n, t in pieces]
        flat = sw.flattened_bytes([t for _, t in tensors]) if self.flatten and tensors else None
        replied: dict[str, str | None] = {}
        deadline = time.monotonic() + self.bucket_timeout_s
        posting = _in_daemon_thread(self._post_distributed, tensors, replied=replied, flattened=flat is not None)
        works = [self._group.broadcast([t], dist.BroadcastOptions())
                 for t in ([flat] if flat is not None else [t for _, t in tensors])]
        while not (posting.done() and all(w.is_completed() for w in works)):
            if posting.done() and posting.exception() is not None:
                self._abandon_group()
                raise posting.exception()
            if time.monotonic() > deadline:
                silent = [u for u in self.active_servers.urls if u not in replied]
                self._abandon_group()
                raise WeightSyncError(
                    f"pipeline stage {self.pgs.pp_rank}: a bucket of {len(tensors)} tensors did not complete within "
                    f"{self.bucket_timeout_s:g} s (rollout.weight_sync_bucket_timeout_s); no answer from "
                    f"{silent or 'none (the broadcast did not complete)'}; answered: "
                    f"{ {u: e or 'ok' for u, e in replied.items()} }")
            time.sleep(0.002)
        posting.result()
        for w in works:
            w.wait()  # a broadcast that ended in an error raises it here
        stats.buckets += 1
        stats.flattened_buckets += flat is not None
        stats.bytes_sent += sum(self.active_servers.tp_sizes) * sum(sw.tensor_nbytes(t) for _, t in tensors)

    def _fan_out(self, buckets, *, stage: int, version: int, last_stage: bool, stats: SyncStats) -> None:
        """ipc: stage `stage`'s sender broadcasts each bucket to the fan-out group (senders + node leaders);
        every leader posts it to its node's servers. Ranks of the stage outside the group only run the
        stage's gathers; members outside the stage follow the sender until its end-of-stage marker."""
        pgs = self.pgs
        member = self._fanout is not None
        src = self._fanout_ranks.index(self._stage_first(stage)) if member else None
        is_src = pgs.rank == self._stage_first(stage)
        mine = [i for i in self.active if self.servers.node_of(i) == self.node]
        post_here = self.node_leader and bool(mine)

        def deliver(spec, tensors, *, final: bool, flat: torch.Tensor | None = None) -> None:
            live = [i for i in mine if self.servers.urls[i] not in self._lost]
            if not post_here or not live or self._error is not None:
                return
            flush = final and last_stage
            if flat is not None:  # one byte tensor: one shared handle per server TP rank, not one per tensor
                entry = sw.flattened_entry([(n, shape, getattr(torch, dt)) for n, shape, dt in spec], flat)
                serialize, load_format = (lambda: sw.serialize_flattened(entry)), sw.FLATTENED_BUCKET
            else:
                named = [(name, t) for (name, _, _), t in zip(spec, tensors, strict=True)]
                serialize, load_format = (lambda: sw.serialize_named_tensors(named)), None
            bodies = [sw.tensor_update_payload([serialize() for _ in range(self.servers.tp_sizes[i])],
                                               flush_cache=flush and self._flush,
                                               weight_version=str(version) if flush else None,
                                               load_format=load_format)
                      for i in live]
            if self.selector is not None:
                bodies = [{**b, "selector": self.selector} for b in bodies]
            urls = [self.servers.urls[i] for i in live]
            # Each server on its own: one that fails gets nothing more this sync (SyncStats.lost).
            for url, err in post_each(urls, "/update_weights_from_tensor", bodies, timeout_s=self.timeout_s).items():
                if err is not None:
                    self._lost[url] = f"stage {stage}, node {self.node}: /update_weights_from_tensor: {err}"
            # The servers replied: they hold their own copies (or device views they opened), so the
            # bucket's tensors may be freed when this returns.

        def exchange(bucket: list | None) -> bool:
            """One bucket over the fan-out group (None: the end marker); False at the end."""
            box = [None]
            flat = None
            if is_src and bucket is not None:
                tensors = [t.detach().contiguous() for _, pieces, _ in bucket for _, t in pieces]
                flat = sw.flattened_bytes(tensors) if self.flatten and tensors else None
                box = [([(n, tuple(t.shape), sw.dtype_name(t.dtype)) for _, pieces, _ in bucket for n, t in pieces],
                        flat is not None)]
            dist.broadcast_object_list(box, group_src=src, group=self._fanout)
            if box[0] is None:
                deliver([], [], final=True)
                return False
            spec, flattened = box[0]
            if flattened:  # one broadcast of the bucket's bytes instead of one per tensor
                if not is_src:
                    flat = torch.empty(sum(math.prod(shape) * getattr(torch, dt).itemsize for _, shape, dt in spec),
                                       dtype=torch.uint8, device=pgs.device)
                dist.broadcast(flat, group_src=src, group=self._fanout)
                tensors, nbytes = [], flat.numel()
            else:
                if not is_src:
                    tensors = [torch.empty(shape, dtype=getattr(torch, dt), device=pgs.device)
                               for _, shape, dt in spec]
                for t in tensors:
                    dist.broadcast(t, group_src=src, group=self._fanout)
                nbytes = sum(sw.tensor_nbytes(t) for t in tensors)
            if is_src:
                stats.buckets += 1
                stats.flattened_buckets += flattened
                stats.bytes_sent += nbytes * (len(self._fanout_ranks) - 1)
            else:
                stats.bytes_gathered += nbytes
            deliver(spec, tensors, final=False, flat=flat if flattened else None)
            return True

        if pgs.pp_rank == stage:
            for bucket in buckets:
                if member:
                    exchange(bucket)
            if member:
                exchange(None)
        else:
            while exchange(None):
                pass

    def _stage_first(self, stage: int) -> int:
        """Global rank of stage `stage`'s sender: pipeline parallelism is Megatron's outermost dimension,
        so stage s holds the ranks [s * W / PP, (s + 1) * W / PP)."""
        return stage * (self.pgs.world_size // self.pgs.pp_size)

    def close(self) -> None:
        """Leave the weight-update group (servers first, then this side); idempotent."""
        self._leave_group(self.active_servers.urls)

    def _abandon_group(self) -> None:
        """After a bucket that did not complete: abort this side of the weight-update group where the backend
        can (NCCL: no watchdog teardown of the sending rank later) and forget it; the servers are not asked
        to destroy it (they are stuck in the broadcast or gone)."""
        group, self._group = self._group, None
        self._store = None
        for target in (group, getattr(group, "_get_backend", lambda _d: None)(torch.device(
                "cuda" if self.backend == "nccl" else "cpu"))):
            abort = getattr(target, "abort", None)
            if abort is not None:
                try:
                    abort()
                    break
                except (RuntimeError, AttributeError) as e:
                    log.debug("aborting %s: %s", self._group_name, e)
        self._abandoned.append(group)  # not destroyed: a gloo group joins its worker threads on destruction,
        # which a broadcast still waiting on a dead peer would hold until the group's timeout

    def _leave_group(self, urls) -> None:
        """distributed: the servers at `urls` destroy this sender's group (a lost one is not contacted), then
        this side shuts it down; a no-op without a group."""
        if self._group is None:
            return
        if urls:
            try:
                post_all(urls, "/destroy_weights_update_group", [{"group_name": self._group_name}] * len(urls),
                         timeout_s=30.0)
            except WeightSyncError as e:
                log.warning("leaving weight-update group %s: %s", self._group_name, e)
        # The group was built outside torch's world registry (as the servers build theirs), so
        # destroy_process_group does not know it: shut the backend down directly.
        try:
            self._group.shutdown()
        except (AttributeError, RuntimeError) as e:
            log.debug("shutting down %s: %s", self._group_name, e)
        self._group = self._store = None
