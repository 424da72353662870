"""The sync trainer with colocated servers it launches itself: stand-ins in memory-saver mode, which die
wherever SGLang 0.5.23 dies on a GPU (a forward over released memory, /health included; a release while
busy; a resume of a tag not released), started through the trainer's own launch path (tests/standin/
sglang_shim), so a killed server is relaunched by the trainer as on a cluster.

    torchrun --nproc_per_node 2 tests/trainer/_mp_colocated.py OUT MODE key=value ...

MODE:
- steady: nothing is killed.
- kills: server 1 is SIGKILLed while the actor trains at step 1 (after the release); the server step
  KILL_GEN_STEP's generation has requests on, while it has them. A generation that ends while a relaunch
  is loading waits for it (rank 0): on a GPU a generation batch outlasts a relaunch by far (tens of
  minutes against a few), here a step takes a second and a relaunch several, and a relaunch still loading
  at the release would be stopped and started again at the next resume (health.py).
- push-hang: server 1 is SIGSTOPped (a wedged GPU) during a weight-sync bucket of version PUSH_KILL_VERSION
  (distributed transport), and SIGKILLed once the run stopped: each rank writes the error it stops with to
  OUT/error.rank<r>.txt.

Rank 0 writes OUT/report.json: per server its URL, the pids it ran as, the pool's events, and at the end
whether each server's tensors equal the actor's own HF export (sha256 per tensor, per TP rank) and the
requests its last process received.
"""

import json
import logging
import os
import signal
import sys
import threading
import time

import requests

from megatron_dapo.config import load_config
from megatron_dapo.trainer.run import build_trainer
from tests.trainer._mp_cluster import actor_export_checksums

KILL_GEN_STEP = 4
PUSH_KILL_VERSION = 2


def _pid(url: str) -> int:
    return requests.get(url + "/_standin/stats", timeout=30).json()["pid"]


def main(out: str, mode: str, overrides: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load_config("configs/tiny_cpu.yaml", overrides + [f"trainer.output_dir={out}"])
    trainer = build_trainer(cfg)
    pgs, rz = trainer.p.pgs, trainer.p.engine
    report: dict = {"kills": []}
    if pgs.rank == 0:
        engine = rz.engine
        urls = list(engine.urls)
        report["pids"] = {u: [_pid(u)] for u in urls}

        def kill(url: str, when: str) -> None:
            pid = _pid(url)
            os.kill(pid, signal.SIGSTOP if mode == "push-hang" else signal.SIGKILL)  # hung, or gone
            report["kills"].append({"url": url, "pid": pid, "when": when, "step": trainer.global_step + 1,
                                    "wall": time.time()})

        if mode == "kills":
            release = rz.release_memory

            def release_then_kill(*a, **k):
                release(*a, **k)
                if trainer.global_step == 0 and not report["kills"]:
                    kill(urls[1], "training")

            rz.release_memory = release_then_kill

            def watch():  # the server step KILL_GEN_STEP's generation has requests on dies
                while True:
                    busy = [u for u in urls if engine._inflight_items[u] > 0]
                    if trainer.global_step == KILL_GEN_STEP - 1 and busy:
                        break
                    time.sleep(0.001)
                kill(busy[0], "generation")

            threading.Thread(target=watch, daemon=True).start()
            def paced(generate):  # the trainer's call (streaming on SGLang) waits for a restarting server
                def paced_generate(*a, **k):
                    out = generate(*a, **k)
                    deadline = time.monotonic() + 300
                    while set(engine.pool.state.values()) & {"down", "restarting"} and time.monotonic() < deadline:
                        time.sleep(0.05)
                    return out
                return paced_generate

            engine.generate_batch = paced(engine.generate_batch)
            engine.generate_batch_streaming = paced(engine.generate_batch_streaming)
        elif mode == "push-hang":
            sync = trainer.sync_weights.sync
            send = sync._send_bucket

            def send_and_kill(bucket, stats):
                if engine.policy_version == PUSH_KILL_VERSION - 1 and stats.buckets == 1 and len(report["kills"]) == 0:
                    threading.Timer(0.01, kill, args=(urls[1], "push")).start()
                return send(bucket, stats)

            sync._send_bucket = send_and_kill
    push = trainer.sync_weights

    def checked_push(version, **kw):
        report.setdefault("push_started", {})[version] = time.time()
        metrics = push(version, **kw)
        if pgs.rank == 0:  # the pids of live servers (a relaunch shows as a new pid)
            for u in rz.engine.urls:
                try:
                    pid = _pid(u)
                except requests.RequestException:
                    continue
                if pid not in report["pids"][u]:
                    report["pids"][u].append(pid)
        return metrics

    checked_push.sync = push.sync
    trainer.sync_weights = trainer.p.sync_weights = checked_push
    try:
        trainer.fit()
        want = actor_export_checksums(trainer)
        if pgs.rank == 0:
            report["states"] = rz.engine.pool.state
            report["requests"] = {u: requests.get(u + "/_standin/requests", timeout=60).json() for u in rz.engine.urls}
            report["weights_equal"] = {}
            for u in rz.engine.urls:
                ranks = requests.get(u + "/_standin/weights", params={"checksum": 1}, timeout=60).json()["ranks"]
                report["weights_equal"][u] = all(
                    {n: c["sha256"] for n, c in r.items()} == {n: c["sha256"] for n, c in want.items()} for r in ranks)
    except Exception as e:
        with open(os.path.join(out, f"error.rank{pgs.rank}.txt"), "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        raise
    finally:
        if pgs.rank == 0:
            for k in report["kills"]:  # a stopped server dies now (a SIGKILL reaches a stopped process)
                if mode == "push-hang":
                    os.kill(k["pid"], signal.SIGKILL)
            report["events"] = [{"kind": e.kind, "url": e.url, "detail": e.detail, "wall": e.wall}
                                for e in rz.engine.pool.events]
            report["urls"] = list(rz.engine.urls)
            report["logs"] = {u: s.log_path.as_posix() for s in rz.servers for u in [s.url]}
            with open(os.path.join(out, "report.json"), "w") as f:
                json.dump(report, f, indent=1)
        from megatron_dapo.trainer.run import close_parts

        close_parts(trainer.p)


if __name__ == "__main__":
    from megatron_dapo.trainer.run import exit_process

    exit_process(main(sys.argv[1], sys.argv[2], sys.argv[3:]))  # as python -m megatron_dapo.train ends
