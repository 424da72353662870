"""A stand-in SGLang server for CPU tests, run as its own process (see server.py for what it emulates).

    from tests.standin import StandinServer

    with StandinServer(toy=True, args=["--enable-deterministic-inference"]) as srv:   # toy model
        SGLangEngine([srv.url]) ...
        srv.requests("/generate")        # bodies received, in arrival order
        srv.knobs(delay_s=0.1)           # test knobs (see state.KNOBS)

    srv = StandinServer(model_path=hf_dir, tp_size=2, log_dir=tmp_path).start()   # an HF model
    srv.checksums()                      # per TP rank: {hf_name: {"sha256", "dtype", "shape", "sum", "sumsq"}}
    srv.stop()

`StandinServer(...)` only describes the server; `start()` launches `python -m tests.standin.server` on
a free loopback port (or `port=`), waits for /health (200 once the model is loaded) and returns self;
`stop()` ends it (SIGTERM, then SIGKILL) and `kill()` SIGKILLs it at once. `command()` gives the argv
(the flags `sglang.server.build_launch_command` would emit, after `launcher`), for tests that go
through `launch_server` themselves. `expected_checksums(named_tensors)` is what `checksums()` reports
for tensors that arrived intact.

Its place beside the real server. tests/sglang_real runs SGLang 0.5.23 itself (the venv of `make
sglang-env`) for what a CPU server shows: the trainer end to end (`python -m megatron_dapo.train`, TP2 /
PP2 / DP2, self-launched TP2 and Qwen3-MoE servers), both weight transports, the request limit, abort,
pause / continue and the colocation check. The stand-in stays for what that server cannot show:

- Releases other than 0.5.23 (routes, flags and payloads per release, protocol.py; the real venv pins
  one): test_sglang_versions, test_sglang_server, test_sglang_drafter (0.5.20's tensor path, pre-0.5.21
  refusal), test_sglang_spec_metrics.
- The MTP drafter and speculative decoding: SGLang's speculative kernels are in its CUDA kernel package,
  which the CPU environment stubs (tests/sglang_env): test_sglang_drafter, _mp_drafter, test_hf_mtp,
  test_sglang_autospec, test_sglang_spec_metrics.
- The memory saver (torch_memory_saver needs libcuda; on CPU release / resume are no-ops): with
  --enable-memory-saver the stand-in dies as SGLang does on a GPU on a forward over released memory
  (/generate or /health's generation), a release while busy and a resume of a tag not released
  (server.py), so test_sglang_control, test_cluster_in_a_box and test_colocated_lifecycle show that
  colocated servers are never driven into those calls.
- Faults on demand (knobs: delays, HTTP errors, malformed replies, a server killed mid-generation or
  mid-sync): test_sglang_engine, test_sglang_control, test_sglang_weights, test_cluster_in_a_box.
- Per-tensor checksums at every TP rank of every server (checksums()), and known outputs (the toy model):
  test_sglang_weights, test_sglang_fit, test_cluster_in_a_box (4 gloo trainer processes and two TP-2
  servers, more processes than 2 cores run real servers for), test_sglang_engine.
- Ray placement (test_ray_sglang, test_ray_pool): a light server per Ray actor.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import requests

from tests.standin.protocol import DEFAULT_VERSION, available_versions
from tests.standin.toy import toy_continuation

__all__ = ["LAUNCHER", "StandinServer", "available_versions", "expected_checksums", "free_port",
           "tensor_checksum", "toy_continuation"]

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = (sys.executable, str(Path(__file__).with_name("server.py")))
"""What replaces `python -m sglang.launch_server` in tests (`python -m tests.standin.server` from the
repository root is the same; the script form works from any directory)."""


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


def free_port(count: int = 1) -> int:
    """A port p with p .. p + count - 1 free on loopback, drawn at random below the kernel's ephemeral range.

    Not a port the OS chose (bind to 0): those come from the ephemeral range, which every outgoing connection
    draws its local port from too, and a server binds its port only after it started (a real SGLang server
    ~40 s later on 2 cores): one test's port was taken by another's connection in between, and its server
    failed with "address already in use". Below the range only an explicit bind can take it."""
    high = _ephemeral_low() - count
    rng = random.Random()  # seeded from the OS: each pytest-xdist worker draws its own ports
    for _ in range(200):
        port = rng.randrange(10000, high)
        socks = []
        try:
            for p in range(port, port + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports below {high + count}")


def tensor_checksum(t) -> dict[str, Any]:
    """The checksum `StandinServer.checksums()` reports for a tensor that arrived intact."""
    from tests.standin.weights import tensor_checksum as checksum

    return checksum(t)


def expected_checksums(named_tensors: Iterable[tuple[str, Any]]) -> dict[str, dict]:
    return {name: tensor_checksum(t) for name, t in named_tensors}


def standin_env() -> dict[str, str]:
    """The environment a stand-in needs: the repository on PYTHONPATH (tests.standin imports)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


class StandinServer:
    def __init__(self, *, model_path: str | None = None, toy: bool = False, tp_size: int = 1,
                 emulate_version: str = DEFAULT_VERSION, args: Sequence[str] = (), port: int | None = None,
                 log_dir: str | os.PathLike | None = None, max_lifetime_s: float = 600.0,
                 startup_timeout_s: float = 120.0):
        if not toy and model_path is None:
            raise ValueError("StandinServer needs model_path (an HF model directory) or toy=True")
        self.model_path = model_path or "toy"
        self.toy, self.tp_size, self.emulate_version = toy, tp_size, emulate_version
        self.args = [str(a) for a in args]
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="standin-"))
        self.log_path = self._log_dir / f"standin_{self.port}.log"
        self.max_lifetime_s, self.startup_timeout_s = max_lifetime_s, startup_timeout_s
        self.process: subprocess.Popen | None = None
        self._session = requests.Session()

    def command(self, launcher: Sequence[str] = LAUNCHER) -> list[str]:
        cmd = [*launcher, "--model-path", self.model_path, "--host", "127.0.0.1", "--port", str(self.port),
               "--tp-size", str(self.tp_size), "--emulate-version", self.emulate_version,
               "--max-lifetime-s", str(self.max_lifetime_s)]
        return cmd + (["--toy"] if self.toy else []) + self.args

    # --------------------------------------------------------------------------- lifecycle

    def start(self) -> StandinServer:
        self._log_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, cwd=str(ROOT), env=standin_env())
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"stand-in exited with code {self.process.returncode} before /health answered "
                                   f"200:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    self.reset()  # the records start empty: the /health polls above are not the test's
                    return self
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"stand-in {self.url} not healthy after {self.startup_timeout_s:.0f} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.05)

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_exit(self, timeout_s: float = 10.0) -> int:
        """The exit code once the process ended by itself (a crash the test provoked)."""
        return self.process.wait(timeout=timeout_s)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout_s)
        self._session.close()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-whatever (connections reset, nothing answers)."""
        if self.is_running():
            self.process.kill()
            self.process.wait(timeout=10)

    def log_tail(self, max_chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-max_chars:]
        except OSError as e:
            return f"<log {self.log_path} unreadable: {e}>"

    def __enter__(self) -> StandinServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    # --------------------------------------------------------------------------- test routes

    def _get(self, route: str, **params) -> Any:
        r = self._session.get(self.url + route, params=params, timeout=30)
        r.raise_for_status()
        return r.json()

    def requests(self, path: str | None = None) -> list:
        """[path, body] of every SGLang request received (only bodies when `path` is given)."""
        rows = self._get("/_standin/requests", **({"path": path} if path else {}))
        return [body for _, body in rows] if path else rows

    def paths(self) -> list[str]:
        return [p for p, _ in self.requests()]

    def stats(self) -> dict:
        return self._get("/_standin/stats")

    def reset(self) -> None:
        """Forget what was received and restore the default knobs (between tests sharing a server)."""
        self._session.post(self.url + "/_standin/reset", timeout=30).raise_for_status()

    def knobs(self, **values) -> dict:
        r = self._session.post(self.url + "/_standin/knobs", json=values, timeout=30)
        if r.status_code != 200:
            raise ValueError(r.text)
        return r.json()

    def checksums(self, role: str = "target") -> list[dict[str, dict]]:
        """Per TP rank (index = tp_rank): {hf_name: checksum} of the tensors it received."""
        return self._get("/_standin/weights", checksum=1, role=role)["ranks"]

    def ignored_fields(self) -> dict[str, list[str]]:
        """Request fields this release does not have (SGLang ignores them silently), per route."""
        return self.stats()["ignored_fields"]
