"""One state per SGLang server, owned by the pool: which servers take work, what their memory holds, and
every control call that changes either. No call SGLang 0.5.23 would crash on can be made through it.

The states (`state[url]`):

- up: takes generation requests.
- paused: /pause_generation holds its scheduler (a push into running generation); takes no new requests.
- released: some of its memory tags are released (/release_memory_occupation: colocated servers while the
  actor trains); `released[url]` says which. It takes no requests and gets no generating probe.
- down: a request or control call to it failed to connect or lost its connection (the process is gone:
  SIGKILL, OOM, a lost node), or it failed `fail_after` checks in a row (hung). It takes nothing.
- restarting: a server the trainer launched is being relaunched (`restart`, once per failure).
- stale: answers, but with another weight version than the other servers (a restarted one holds the
  checkpoint it was launched from). It takes no requests; the next weight sync feeds it (`sync_targets`)
  and it is up once it reports that sync's version (`confirm`).

What SGLang 0.5.23 does that the states rule out (read in its source; tests/standin mirrors each rule):

- /health *is* a one-token generation when the scheduler is idle (entrypoints/http_server.py:721-785,
  SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION defaults to true in srt/environ.py:344; the scheduler skips it
  only when busy, managers/scheduler.py:2241), and /health_generate always is. A forward over released
  weights or KV cache reads memory torch_memory_saver unmapped: the scheduler dies. So a released or
  paused server is probed by /model_info only (the tokenizer manager answers it, no forward); the
  generating probe (/health_generate) runs only on servers that hold all their memory; and the servers
  the trainer launches answer /health without generating (server.SERVER_DEFAULTS), so a launcher's or a
  relaunch's readiness wait never runs a forward either.
- /release_memory_occupation asserts the scheduler is fully idle
  (managers/scheduler_components/weight_updater.py:338-341): a release waits until the server has no
  generation request and no generating probe in flight (the probe's own generation counts), and new
  probes of it stop generating before the wait starts.
- /resume_memory_occupation removes each tag from `offload_tags` (weight_updater.py:383-390): a tag that
  was not released is a KeyError and the scheduler dies. A resume sends each server only the tags it
  released; a restarted server holds nothing released.

Colocated restarts. Between a release and the next resume the actor trains at its peak on the servers'
GPUs: a server that dies then is relaunched only when the rollout phase begins (the first resume, after
the trainer gave back what the servers were planned without). A relaunch still loading when the next
release comes (it would take the actor's memory) is stopped there (`stop`) and started again at the next
resume. A relaunched server that answers while the others are released is released at once; one that
answers in the rollout phase is released with the others at its end. Either way it joins a weight sync
after a release and resume it went through. Disaggregated servers (never released) are relaunched at once.

Control calls (pause, continue, release, resume) go to every live server; one that fails is marked down
(and restarted when launched here) and the call goes on with the rest. Only when every server failed does
it raise AllServersDown, naming each.

The poller is one daemon thread: every `interval_s` it probes each server (`probe(url, deep=...)`; deep:
/health_generate, then the weight version from /model_info). With no server up for `down_timeout_s`,
`check_any_up` (from the engine's wait for a server, and `wait_for_targets` before a sync) raises
AllServersDown, naming every server and its last error: the run stops instead of waiting forever.

Every change is an event (`events`, with monotonic and wall-clock times) and counted (`take_counts`): the
trainer logs the counts as metrics each step (docs/metrics.md, rollout/server_*).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from megatron_dapo.rollout.base import RolloutEngineError

log = logging.getLogger(__name__)

UP, PAUSED, RELEASED, DOWN, RESTARTING, STALE = "up", "paused", "released", "down", "restarting", "stale"
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""SGLang's GPU_MEMORY_ALL_TYPES: what a release or resume with tags=None means."""
COUNTERS = ("failures", "reissued_requests", "restarts", "readmitted")
"""What take_counts reports: servers lost, requests re-sent after their server was lost, restarts of
servers the trainer launched, servers back in rotation."""
IDLE_WAIT_S = 60.0
"""Longest wait, before a release, for a server's generation requests and generating probe to return."""


class AllServersDown(RolloutEngineError):
    """No SGLang server took requests for rollout.server_down_timeout_s, or a control call failed on every
    server; the message names each one."""


@dataclass(frozen=True)
class Probe:
    """One health check of one server."""

    answers: bool
    weight_version: str | None = None
    """What /model_info reports (None: not asked or not reported)."""
    error: str = ""
    refused: bool = False
    """The connection was refused or reset: the process is gone, no need to wait for more failures."""
    model: tuple | None = None
    """(model_type, architectures) from /model_info; None: not read."""
    info: dict | None = field(default=None, compare=False)
    """The /model_info reply as read."""


@dataclass(frozen=True)
class ServerEvent:
    kind: str
    """down, reissue, restart, restart_deferred, restart_stopped, answering (back, stale), readmitted, refused,
    released."""
    url: str
    detail: str
    t: float
    """time.monotonic() of the event."""
    wall: float
    """time.time() of the event."""


@dataclass
class _Server:
    """What the pool knows of one server (guarded by the pool's `cond`)."""

    life: str = UP
    """UP, STALE, DOWN or RESTARTING: is the process there, and with which weights."""
    released: frozenset = frozenset()
    """Memory tags released and not resumed (kept while down: the same process may answer again)."""
    paused: bool = False
    probing: int = 0
    """Generating probes in flight."""
    misses: int = 0
    last_error: str = ""
    restart_due: bool = False
    """Died while the actor trained: relaunched when the rollout phase begins."""
    epoch: int = 0
    """How many times it went down: a weight-update group formed with an earlier process is gone."""

    @property
    def state(self) -> str:
        if self.life in (DOWN, RESTARTING):
            return self.life
        if self.released:
            return RELEASED
        return PAUSED if self.paused else self.life


class ServerPool:
    """The state of each server (see the module docstring). Thread-safe; `cond` is the engine's condition
    that requests wait on for a free server, notified whenever a server's state changes."""

    def __init__(self, urls: Sequence[str], cond: threading.Condition, *, probe: Callable[..., Probe],
                 expected_version: Callable[[], int], interval_s: float = 5.0, down_timeout_s: float = 600.0,
                 fail_after: int = 3, restart: Callable[[str], None] | None = None, model: tuple | None = None,
                 post: Callable[[str, str, object], str | None] | None = None,
                 busy: Callable[[str], bool] = lambda url: False, stop: Callable[[str], None] | None = None,
                 report: Callable[..., None] | None = None):
        """model: the (model_type, architectures) the servers reported at connect; a server that comes back
        serving another model stays down. post(url, path, body): one control request, None on success else
        the error text. busy(url): the server has generation requests in flight (the engine's count).
        stop(url): end a relaunch in progress (a release stops one still loading; None: left to load).
        report: a follower's line to its leader (`follow`), called outside the lock as report("down", url,
        error) when this pool takes a live server down and report("reissue", url, survivor, requests) when
        requests of a lost server were re-sent."""
        if not interval_s > 0 or not down_timeout_s > 0 or fail_after < 1:
            raise ValueError(f"ServerPool: interval_s and down_timeout_s must be > 0 and fail_after >= 1, got "
                             f"{interval_s!r}, {down_timeout_s!r}, {fail_after!r}")
        self.urls = list(urls)
        self.cond = cond
        self.probe, self.expected_version, self.restart, self.model = probe, expected_version, restart, model
        self.post, self.busy, self.stop_server = post, busy, stop
        self.interval_s, self.down_timeout_s, self.fail_after = float(interval_s), float(down_timeout_s), fail_after
        self._s = {u: _Server() for u in self.urls}
        self._phase_tags: frozenset = frozenset()
        """Tags released on the servers now (the actor trains in that memory); empty in the rollout phase."""
        self._deferring = False
        """From a release to the next resume: restarts of colocated servers wait for the rollout phase."""
        self._none_up_since: float | None = None
        self.events: list[ServerEvent] = []
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.report = report
        self._leader_epoch: dict[str, int] = {}
        """Following (`follow`): each server's epoch in the leader's last states."""
        self._down_here: dict[str, int] = {}
        """Following: servers this pool took down itself, with the leader's epoch for each at that moment."""

    # ------------------------------------------------------------------------------------ queries
    @property
    def state(self) -> dict[str, str]:
        with self.cond:
            return {u: s.state for u, s in self._s.items()}

    @property
    def released(self) -> dict[str, frozenset]:
        with self.cond:
            return {u: s.released for u, s in self._s.items()}

    @property
    def last_error(self) -> dict[str, str]:
        with self.cond:
            return {u: s.last_error for u, s in self._s.items()}

    def is_up(self, url: str) -> bool:
        """Takes generation requests now."""
        return self._s[url].state == UP

    def up(self) -> list[str]:
        with self.cond:
            return [u for u in self.urls if self._s[u].state == UP]

    def live(self) -> list[str]:
        """The servers whose process answers, whatever their memory or pause (not down, not restarting)."""
        with self.cond:
            return [u for u in self.urls if self._s[u].life in (UP, STALE)]

    def sync_targets(self) -> list[str]:
        """The servers a weight sync feeds: every live one (stale ones come back up with it)."""
        return self.live()

    def only_released(self) -> bool:
        """Some server runs the current weights, and every such server has memory released: generation now
        is the caller's error (resume first), not a fault to wait out (call with `cond` held)."""
        current = [s for s in self._s.values() if s.life == UP]
        return bool(current) and all(s.released for s in current)

    def take_counts(self) -> dict[str, int]:
        """The counters since the last call, and how many servers are up now."""
        with self.cond:
            out, self._counts = self._counts, dict.fromkeys(COUNTERS, 0)
            out["up"] = sum(s.life == UP for s in self._s.values())
        return out

    def _event(self, kind: str, url: str, detail: str) -> None:
        self.events.append(ServerEvent(kind, url, detail, time.monotonic(), time.time()))
        (log.info if kind in ("answering", "readmitted", "reissue", "released") else log.warning)(
            "SGLang server %s: %s (%s)", url, kind, detail)

    # ------------------------------------------------------------------------------------ failures
    def mark_down(self, url: str, error: str) -> None:
        """Take `url` out of rotation (its process is gone or it stopped answering); restart it when the
        trainer launched it: now, or when the rollout phase begins if the actor is training."""
        start = False
        with self.cond:
            s = self._s[url]
            if s.life in (DOWN, RESTARTING):
                return
            s.life, s.last_error, s.misses = DOWN, error, 0
            s.epoch += 1
            if url in self._leader_epoch:
                self._down_here[url] = self._leader_epoch[url]
            self._counts["failures"] += 1
            self._event("down", url, error)
            if not any(x.life == UP for x in self._s.values()) and self._none_up_since is None:
                self._none_up_since = time.monotonic()
            self.cond.notify_all()  # requests waiting for a server re-check (and may give up)
            if self.restart is not None:
                self._counts["restarts"] += 1
                if self._deferring:
                    s.restart_due = True
                    self._event("restart_deferred", url, "the actor trains on its GPUs: relaunched when the "
                                                         "rollout phase begins")
                else:
                    start = self._begin_restart(url)
        if start:
            self._spawn_restart(url)
        if self.report is not None:
            self.report("down", url, error)

    def _begin_restart(self, url: str) -> bool:
        """(cond held) The old process goes: a relaunched one holds all its memory and is not paused."""
        s = self._s[url]
        s.life, s.released, s.paused, s.restart_due = RESTARTING, frozenset(), False, False
        self._event("restart", url, "relaunching the server the trainer started")
        return True

    def _spawn_restart(self, url: str) -> None:
        threading.Thread(target=self._restart, args=(url,), name=f"sglang-restart-{url}", daemon=True).start()

    def _restart(self, url: str) -> None:
        """The relaunch, in its own thread; once the launcher's readiness wait returns, the new process is
        probed (no generation) and joins at once (released first while the actor trains) instead of at the
        poller's next round. (The launcher's wait runs no generation: server.SERVER_DEFAULTS.)"""
        try:
            self.restart(url)
        except Exception as e:  # noqa: BLE001 - the poller keeps it down; logged with the reason
            with self.cond:
                s = self._s[url]
                if s.restart_due:  # stopped by a release: relaunched at the next resume
                    return
                if s.life == RESTARTING:
                    s.life = DOWN
                s.last_error = f"restart failed: {type(e).__name__}: {e}"
            log.error("SGLang server %s: restart failed: %s", url, e)
            return
        with self.cond:
            stopped = self._s[url].restart_due
        if stopped:  # a release came as it finished loading: it goes, and comes again at the next resume
            self.stop_server(url)
            return
        p = self.probe(url, deep=False)
        with self.cond:
            if self._s[url].life == RESTARTING:
                self._s[url].life = DOWN  # answering or not, the poller and observe take it from here
        self.observe(url, p)

    def note_reissue(self, url: str, survivor: str, requests: int = 1) -> None:
        """A request of the lost server `url` was re-sent to `survivor`."""
        with self.cond:
            self._counts["reissued_requests"] += requests
            self._event("reissue", url, f"request re-sent to {survivor}")
        if self.report is not None:
            self.report("reissue", url, survivor, requests)

    def mark_up(self, url: str, why: str) -> None:
        """Back with the current weights (its memory and pause state unchanged)."""
        with self.cond:
            s = self._s[url]
            if s.life == UP:
                return
            s.life, s.last_error, s.misses = UP, "", 0
            self._counts["readmitted"] += 1
            self._none_up_since = None
            self._event("readmitted", url, why)
            self.cond.notify_all()

    def confirm(self, url: str, version: int) -> None:
        """After a weight sync to `url`: up when it reports `version`, else down (it missed the sync)."""
        p = self.probe(url, deep=False)
        if p.answers and p.weight_version in (None, str(version)):  # None: a release that does not report it
            self.mark_up(url, f"reports weight version {version} after the sync")
            return
        self.mark_down(url, p.error or f"reports weight version {p.weight_version!r} after the sync of version "
                                        f"{version}")

    # ------------------------------------------------------------------------------------ control calls
    def _post_each(self, path: str, bodies: dict[str, object], timeout_what: str) -> dict[str, str | None]:
        """POST bodies[url] to each url concurrently; {url: error or None}. A failure marks the server down;
        AllServersDown when every one failed."""
        if not bodies:
            return {}
        with ThreadPoolExecutor(max_workers=min(len(bodies), 32), thread_name_prefix="sglang-control") as ex:
            errors = dict(zip(bodies, ex.map(lambda u: self.post(u, path, bodies[u]), bodies), strict=True))
        for url, err in errors.items():
            if err is not None:
                self.mark_down(url, f"{path}: {err}")
        if all(err is not None for err in errors.values()):
            listed = "; ".join(f"{u}{path}: {e}" for u, e in errors.items())
            raise AllServersDown(f"{timeout_what} failed on every server: {listed}")
        return errors

    def pause(self, mode: str) -> None:
        """/pause_generation on every live server. Paused servers take no requests and get no generating
        probe (a paused scheduler cannot answer one)."""
        with self.cond:
            urls = [u for u in self.urls if self._s[u].life in (UP, STALE)]
            for u in urls:
                self._s[u].paused = True
        self._post_each("/pause_generation", dict.fromkeys(urls, {"mode": mode}), "pause_generation")

    def resume_generation(self) -> None:
        """/continue_generation on every live server (harmless on one not paused, and a trainer that restarts
        does not know which servers the killed one left paused)."""
        with self.cond:
            urls = [u for u in self.urls if self._s[u].life in (UP, STALE)]
        errors = self._post_each("/continue_generation", dict.fromkeys(urls, {}), "continue_generation")
        with self.cond:
            for u, err in errors.items():
                if err is None:
                    self._s[u].paused = False
            self.cond.notify_all()

    def release(self, tags: Sequence[str] | None) -> None:
        """/release_memory_occupation of `tags` (None: all) on every live server that holds them, each once
        it is idle: no generation request and no generating probe in flight. From here on the servers take
        no requests and get no generating probe, and a server that dies is relaunched only when the rollout
        phase begins (`resume`)."""
        want = frozenset(MEMORY_TAGS if tags is None else tags)
        with self.cond:
            self._deferring = True
            self._phase_tags |= want
            loading = [u for u, s in self._s.items() if s.life == RESTARTING] if self.stop_server else []
            for u in loading:
                s = self._s[u]
                s.life, s.restart_due, s.last_error = DOWN, True, "relaunch stopped: the actor trains"
                self._event("restart_stopped", u, "still loading at the release: relaunched at the next resume")
            todo = {u: want - s.released for u, s in self._s.items() if s.life in (UP, STALE) and want - s.released}
            self._mark_released_when_idle(todo)
        for u in loading:
            self.stop_server(u)
        self._post_each("/release_memory_occupation", {u: {"tags": sorted(t)} for u, t in todo.items()},
                        "release_memory_occupation")

    def resume(self, tags: Sequence[str] | None) -> None:
        """/resume_memory_occupation of `tags` (None: all), each server only the ones it released. The first
        resume after a release begins the rollout phase: the relaunches deferred meanwhile start now (the
        trainer has given back the memory the servers were planned with)."""
        want = frozenset(MEMORY_TAGS if tags is None else tags)
        with self.cond:
            due = []
            if self._deferring:
                self._deferring = False
                due = [u for u, s in self._s.items() if s.restart_due and s.life == DOWN and self._begin_restart(u)]
            self._phase_tags -= want
            todo = {u: want & s.released for u, s in self._s.items()
                    if s.life in (UP, STALE) and want & s.released}
        for u in due:
            self._spawn_restart(u)
        errors = self._post_each("/resume_memory_occupation", {u: {"tags": sorted(t)} for u, t in todo.items()},
                                 "resume_memory_occupation")
        with self.cond:
            for u, err in errors.items():
                if err is None:
                    self._s[u].released -= todo[u]
            self.cond.notify_all()

    def _mark_released_when_idle(self, todo: dict[str, frozenset]) -> None:
        """(cond held) Count `todo`'s tags as released from now on (no new request, no new generating
        probe), then wait until those servers have no request and no generating probe in flight; on a
        timeout nothing was posted, so the marks are undone and RolloutEngineError raised."""
        for u, new in todo.items():
            self._s[u].released |= new
        self.cond.notify_all()
        deadline = time.monotonic() + IDLE_WAIT_S
        while any(self._s[u].probing or self.busy(u) for u in todo):
            left = deadline - time.monotonic()
            if left <= 0:
                for u, new in todo.items():
                    self._s[u].released -= new
                stuck = [u for u in todo if self._s[u].probing or self.busy(u)]
                raise RolloutEngineError(f"release_memory: servers {stuck} still run requests after "
                                         f"{IDLE_WAIT_S:g} s; SGLang kills a server released while busy")
            self.cond.wait(min(left, 0.05))

    def _join_phase(self, url: str) -> bool:
        """A server that answers again while the others are released (a relaunch slower than the rollout
        phase): release what they released, so it holds no memory the actor trains in. False: it failed."""
        with self.cond:
            s = self._s[url]
            new = self._phase_tags - s.released if self._deferring else frozenset()
            if not new:
                return True
            try:
                self._mark_released_when_idle({url: new})
            except RolloutEngineError as e:
                log.warning("SGLang server %s: not released yet: %s", url, e)
                return False
        err = self.post(url, "/release_memory_occupation", {"tags": sorted(new)})
        if err is not None:
            self.mark_down(url, f"/release_memory_occupation: {err}")
            return False
        with self.cond:
            self._event("released", url, f"answered while the actor trains: released {sorted(new)}")
        return True

    # ------------------------------------------------------------------------------------ following
    def leader_states(self) -> dict[str, tuple[str, bool, frozenset, int]]:
        """Each server's (life, paused, released, epoch): what a follower pool takes (`follow`)."""
        with self.cond:
            return {u: (s.life, s.paused, s.released, s.epoch) for u, s in self._s.items()}

    def follow(self, states: dict[str, tuple[str, bool, frozenset, int]]) -> None:
        """Take the states of a leader pool: the pool of the engine in another process that probes,
        restarts, pauses and releases the servers, while this one (not started: no poller, no restarts)
        only sends generation requests (sglang/follower.py). A server this pool took down itself (a
        request's connection failed; `report` told the leader) stays down until the leader's epoch for it
        passes the one it had then: the leader saw the failure, or the server failed and came back since."""
        with self.cond:
            for url, (life, paused, released, epoch) in states.items():
                s = self._s[url]
                self._leader_epoch[url] = epoch
                if url in self._down_here:
                    if epoch <= self._down_here[url]:
                        continue
                    del self._down_here[url]
                s.life, s.paused, s.released = life, paused, frozenset(released)
            if any(s.life == UP for s in self._s.values()):
                self._none_up_since = None
            elif self._none_up_since is None:
                self._none_up_since = time.monotonic()
            self.cond.notify_all()

    # ------------------------------------------------------------------------------------ waiting
    def check_any_up(self) -> None:
        """Raise AllServersDown once no server has been up for down_timeout_s (call with `cond` held)."""
        if any(s.life == UP for s in self._s.values()):
            self._none_up_since = None
            return
        if self._none_up_since is None:
            self._none_up_since = time.monotonic()
        if time.monotonic() - self._none_up_since >= self.down_timeout_s:
            listed = "; ".join(f"{u} ({s.state}: {s.last_error or 'no error recorded'})" for u, s in self._s.items())
            raise AllServersDown(f"no SGLang server took requests for {self.down_timeout_s:g} s "
                                 f"(rollout.server_down_timeout_s): {listed}")

    def remaining_s(self) -> float:
        """Seconds until check_any_up gives up (call with `cond` held; the full timeout when one is up)."""
        if self._none_up_since is None:
            return self.down_timeout_s
        return max(0.0, self.down_timeout_s - (time.monotonic() - self._none_up_since))

    def wait_for_targets(self) -> list[str]:
        """The sync targets; with none, wait (polling) until one answers or raise AllServersDown."""
        while True:
            targets = self.sync_targets()
            if targets:
                return targets
            with self.cond:
                self.check_any_up()
                self.cond.wait(min(self.interval_s, self.remaining_s()) + 0.01)

    # ------------------------------------------------------------------------------------ polling
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._poll_loop, name="sglang-health", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)  # a daemon: a probe still waiting on a hung server does not hold close()

    def _poll_loop(self) -> None:
        with ThreadPoolExecutor(max_workers=min(len(self.urls), 32), thread_name_prefix="sglang-probe") as pool:
            while not self._stop.wait(self.interval_s):
                try:
                    self.poll_once(pool)
                except Exception as e:  # noqa: BLE001 - the poller must outlive one bad round
                    log.error("SGLang health poll failed: %s", e)

    def check(self, url: str) -> Probe:
        """One probe of `url`, generating (/health) only when the server holds all its memory and is not
        paused; a release waits for a generating probe in flight to return."""
        with self.cond:
            s = self._s[url]
            deep = not s.released and not s.paused
            if deep:
                s.probing += 1
        try:
            return self.probe(url, deep=deep)
        finally:
            if deep:
                with self.cond:
                    s.probing -= 1
                    self.cond.notify_all()

    def epochs(self, urls: Sequence[str]) -> list[int]:
        """Each server's count of times down (a weight sync re-forms its groups when one changed)."""
        with self.cond:
            return [self._s[u].epoch for u in urls]

    def poll_once(self, pool: ThreadPoolExecutor | None = None) -> None:
        """Probe every server once and apply what it shows (the poller's round; tests call it directly). A
        probe whose server changed state while the round ran is dropped: it shows the server as it was (a
        refusal from before a relaunch, applied after the relaunch was readmitted, would stop a healthy
        server); the next round sees it as it is."""
        with self.cond:
            before = {u: (self._s[u].life, self._s[u].epoch) for u in self.urls}
        results = list(pool.map(self.check, self.urls)) if pool is not None else [self.check(u) for u in self.urls]
        for url, p in zip(self.urls, results, strict=True):
            with self.cond:
                changed = (self._s[url].life, self._s[url].epoch) != before[url]
            if not changed:
                self.observe(url, p)

    def observe(self, url: str, p: Probe) -> None:
        """Apply one probe of `url`: a live server's failures count (a refusal at once); a returning one
        joins the phase (released when the others are), then is readmitted with the current weights, else
        stale until a sync."""
        s = self._s[url]
        if s.life in (UP, STALE):
            if p.answers:
                s.misses = 0
                return
            s.misses += 1
            if p.refused or s.misses >= self.fail_after:
                self.mark_down(url, p.error or "health check failed")
            return
        if not p.answers:
            with self.cond:
                s.last_error = p.error or s.last_error
            return
        if self.model is not None and p.model is not None and p.model != self.model:
            with self.cond:
                error = f"serves model {p.model}, the others {self.model}"
                if s.last_error != error:
                    s.last_error = error
                    self._event("refused", url, error)
            return
        if not self._join_phase(url):
            return
        version = self.expected_version()
        if p.weight_version == str(version):
            self.mark_up(url, f"answers again with weight version {version}")
            return
        with self.cond:
            if s.life in (DOWN, RESTARTING):
                s.life, s.misses = STALE, 0
                self._event("answering", url, f"answers with weight version {p.weight_version!r}, the servers hold "
                                              f"{version}: back after the next weight sync")
