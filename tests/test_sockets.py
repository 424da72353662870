"""A single-process run listens on loopback only (parallel.bound_tcp_store): torch's own store, given only a
port, listens on every interface, where anyone on the network could read and set the rendezvous keys."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROBE = """
import json, psutil
from megatron_dapo.parallel import init_parallel
init_parallel(backend="gloo")
me = psutil.Process()
print(json.dumps(sorted({c.laddr.ip for c in me.net_connections("inet") if c.status == psutil.CONN_LISTEN})))
"""


def test_a_world_of_one_listens_on_loopback_only():
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert r.returncode == 0, r.stderr[-3000:]
    listening = json.loads(r.stdout.strip().splitlines()[-1])
    assert listening and set(listening) <= {"127.0.0.1", "::1"}, listening


def test_a_store_bound_to_an_address_listens_there_only():
    import datetime

    import psutil

    from megatron_dapo.parallel import bound_tcp_store

    store = bound_tcp_store("127.0.0.1", 1, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    store.set("k", "v")
    assert store.get("k") == b"v"
    mine = [c for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN
            and c.laddr.port == store.port]
    assert [c.laddr.ip for c in mine] == ["127.0.0.1"]
