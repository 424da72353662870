"""Which SGLang servers take work: a server that stops answering leaves the rotation at once, the requests
it held go to the others, and it comes back only with the weights the trainer last pushed.

A server is in one of three states:

- up: takes generation requests.
- down: a request to it failed to connect or lost its connection (the process is gone: SIGKILL, OOM, a
  lost node), or `fail_after` health checks in a row failed (a hung server). It takes nothing; it is
  polled every `interval_s`, and a server the trainer launched is restarted (`restart`, once per failure).
- stale: answers again, but reports another weight version than the one the engine's servers hold (a
  restarted server holds the checkpoint it was launched from). It takes no requests; the next weight sync
  includes it (`sync_targets`), and it is back up once it reports that sync's version (`confirm`).

The poller is one daemon thread: every `interval_s` it probes each server (`probe(url, deep=True)`: /health,
then the weight version from /model_info; `deep=False` reads the version only). With no server up for
`down_timeout_s`, `check_any_up` (from the engine's wait for a server, and `wait_for_targets` before a sync)
raises AllServersDown, naming every server and its last error: the run stops instead of waiting forever.

Every change is an event (`events`, with monotonic and wall-clock times) and counted (`take_counts`): the
trainer logs the counts as metrics each step (docs/metrics.md, rollout/server_*).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from megatron_dapo.rollout.base import RolloutEngineError

log = logging.getLogger(__name__)

UP, DOWN, STALE = "up", "down", "stale"
COUNTERS = ("failures", "reissued_requests", "restarts", "readmitted")
"""What take_counts reports: servers lost, requests re-sent after their server was lost, restarts of
servers the trainer launched, servers back in rotation."""


class AllServersDown(RolloutEngineError):
    """No SGLang server took requests for rollout.server_down_timeout_s; the message names each one."""


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


@dataclass(frozen=True)
class ServerEvent:
    kind: str
    """down, reissue, restart, answering (back, stale), readmitted, refused."""
    url: str
    detail: str
    t: float
    """time.monotonic() of the event."""
    wall: float
    """time.time() of the event."""


class ServerPool:
    """The state of each server (see the module docstring). Thread-safe; `cond` is the engine's condition
    that requests wait on for a free server, notified whenever a server comes up."""

    def __init__(self, urls: Sequence[str], cond: threading.Condition, *, probe: Callable[..., Probe],
                 expected_version: Callable[[], int], interval_s: float = 5.0, down_timeout_s: float = 600.0,
                 fail_after: int = 3, restart: Callable[[str], None] | None = None, model: tuple | None = None):
        """model: the (model_type, architectures) the servers reported at connect; a server that comes back
        serving another model stays down."""
        if not interval_s > 0 or not down_timeout_s > 0 or fail_after < 1:
            raise ValueError(f"ServerPool: interval_s and down_timeout_s must be > 0 and fail_after >= 1, got "
                             f"{interval_s!r}, {down_timeout_s!r}, {fail_after!r}")
        self.urls = list(urls)
        self.cond = cond
        self.probe, self.expected_version, self.restart, self.model = probe, expected_version, restart, model
        self.interval_s, self.down_timeout_s, self.fail_after = float(interval_s), float(down_timeout_s), fail_after
        self.state = dict.fromkeys(self.urls, UP)
        self.last_error = dict.fromkeys(self.urls, "")
        self._misses = dict.fromkeys(self.urls, 0)
        self._none_up_since: float | None = None
        self.events: list[ServerEvent] = []
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.paused = False
        """Generation is paused on the servers (SGLangEngine.pause_generation): /health, which generates a
        token, cannot answer then; failed checks of up servers do not count (a refused connection still does)."""

    # ------------------------------------------------------------------------------------ queries
    def is_up(self, url: str) -> bool:
        return self.state[url] == UP

    def up(self) -> list[str]:
        with self.cond:
            return [u for u in self.urls if self.state[u] == UP]

    def sync_targets(self) -> list[str]:
        """The servers a weight sync feeds: up and stale ones (stale ones come back up with it)."""
        with self.cond:
            return [u for u in self.urls if self.state[u] != DOWN]

    def take_counts(self) -> dict[str, int]:
        """The counters since the last call, and how many servers are up now."""
        with self.cond:
            out, self._counts = self._counts, dict.fromkeys(COUNTERS, 0)
            out["up"] = sum(s == UP for s in self.state.values())
        return out

    def _event(self, kind: str, url: str, detail: str) -> None:
        self.events.append(ServerEvent(kind, url, detail, time.monotonic(), time.time()))
        (log.info if kind in ("answering", "readmitted", "reissue") else log.warning)(
            "SGLang server %s: %s (%s)", url, kind, detail)

    # ------------------------------------------------------------------------------------ changes
    def mark_down(self, url: str, error: str) -> None:
        """Take `url` out of rotation (its process is gone or it stopped answering); restart it when the
        trainer launched it."""
        with self.cond:
            if self.state[url] == DOWN:
                return
            self.state[url], self.last_error[url], self._misses[url] = DOWN, error, 0
            self._counts["failures"] += 1
            self._event("down", url, error)
            if not any(s == UP for s in self.state.values()) and self._none_up_since is None:
                self._none_up_since = time.monotonic()
            self.cond.notify_all()  # requests waiting for a server re-check (and may give up)
            if self.restart is not None:
                self._counts["restarts"] += 1
                self._event("restart", url, "relaunching the server the trainer started")
        if self.restart is not None:
            threading.Thread(target=self._restart, args=(url,), name=f"sglang-restart-{url}", daemon=True).start()

    def _restart(self, url: str) -> None:
        try:
            self.restart(url)
        except Exception as e:  # noqa: BLE001 - the poller keeps it down; logged with the reason
            with self.cond:
                self.last_error[url] = f"restart failed: {type(e).__name__}: {e}"
            log.error("SGLang server %s: restart failed: %s", url, e)

    def note_reissue(self, url: str, survivor: str, requests: int = 1) -> None:
        """A request of the lost server `url` was re-sent to `survivor`."""
        with self.cond:
            self._counts["reissued_requests"] += requests
            self._event("reissue", url, f"request re-sent to {survivor}")

    def mark_up(self, url: str, why: str) -> None:
        with self.cond:
            if self.state[url] == UP:
                return
            self.state[url], self.last_error[url], self._misses[url] = UP, "", 0
            self._counts["readmitted"] += 1
            self._none_up_since = None
            self._event("readmitted", url, why)
            self.cond.notify_all()

    def confirm(self, url: str, version: int) -> None:
        """After a weight sync to `url`: up when it reports `version`, else down (it missed the sync)."""
        p = self.probe(url, deep=False)
        if p.answers and p.weight_version in (None, str(version)):  # None: a release that does not report it
            if self.state[url] != UP:
                self.mark_up(url, f"reports weight version {version} after the sync")
            return
        self.mark_down(url, p.error or f"reports weight version {p.weight_version!r} after the sync of version "
                                        f"{version}")

    # ------------------------------------------------------------------------------------ waiting
    def check_any_up(self) -> None:
        """Raise AllServersDown once no server has been up for down_timeout_s (call with `cond` held)."""
        if any(s == UP for s in self.state.values()):
            self._none_up_since = None
            return
        if self._none_up_since is None:
            self._none_up_since = time.monotonic()
        if time.monotonic() - self._none_up_since >= self.down_timeout_s:
            listed = "; ".join(f"{u} ({self.state[u]}: {self.last_error[u] or 'no error recorded'})"
                               for u in self.urls)
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

    def poll_once(self, pool: ThreadPoolExecutor | None = None) -> None:
        """Probe every server once and apply what it shows (the poller's round; tests call it directly)."""
        results = list(pool.map(self.probe, self.urls)) if pool is not None else [self.probe(u) for u in self.urls]
        for url, p in zip(self.urls, results, strict=True):
            self.observe(url, p)

    def observe(self, url: str, p: Probe) -> None:
        """Apply one probe of `url`: an up server's failures count (a refusal at once), a returning one is
        readmitted with the current weights, else stale until a sync."""
        state = self.state[url]
        if state == UP:
            if p.answers:
                self._misses[url] = 0
                return
            if self.paused and not p.refused:
                return
            self._misses[url] += 1
            if p.refused or self._misses[url] >= self.fail_after:
                self.mark_down(url, p.error or "health check failed")
            return
        if not p.answers:
            with self.cond:
                self.last_error[url] = p.error or self.last_error[url]
            return
        if self.model is not None and p.model is not None and p.model != self.model:
            with self.cond:
                error = f"serves model {p.model}, the others {self.model}"
                if self.last_error[url] != error:
                    self.last_error[url] = error
                    self._event("refused", url, error)
            return
        version = self.expected_version()
        if p.weight_version == str(version):
            self.mark_up(url, f"answers again with weight version {version}")
        elif state == DOWN:
            with self.cond:
                self.state[url] = STALE
                self._event("answering", url, f"answers with weight version {p.weight_version!r}, the servers hold "
                                              f"{version}: back after the next weight sync")
