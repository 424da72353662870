"""The sync trainer while a real SGLang server dies: the server is SIGKILLed (its whole process tree, as a
lost node or an OOM kill ends it) while step KILL_STEP's generation has requests on it.

    torchrun --nproc_per_node 2 tests/sglang_real/_server_death.py OUT MODE key=value ...

With queue.enable=true the queue trainer runs instead (the probe follows each paused push); its producer
process sends the requests, so the kill waits for a prefill in the victim's log instead of rank 0's count.

MODE "restart": the trainer launched two servers and restarts the one that died; before the sync of
version REJOIN_VERSION rank 0 waits until the restarted server answers /health (a restart takes ~40 s on
these CPUs, several steps), so that sync must re-form the weight-update group with it and bring it back.
After each sync rank 0 compares every server's log-probs of a fixed probe with the actor's own HF
export of that version (as _mp_train.py does). Writes OUT/report.json (per sync: version, pool states,
per server its weight version and max |log-prob diff|), OUT/events.json (the pool's events and the
kill time) and OUT/used.json (per step: the servers that took generation requests).

MODE "kill:<pid>": the one server was given by rollout.sglang_urls; <pid> is its process, killed with
its children. The run is expected to stop with AllServersDown on every rank: each rank writes the error
it raised to OUT/error.rank<r>.txt.
"""

import json
import logging
import os
import signal
import sys
import threading
import time

import psutil
import requests

from megatron_dapo.config import load_config
from megatron_dapo.trainer.run import build_trainer
from tests.sglang_real._mp_train import export_logprobs, server_logprobs
from tests.trainer._mp_cluster import actor_export, fit_and_report

KILL_STEP = 2
REJOIN_VERSION = 3


def kill_tree(pid: int) -> None:
    """SIGKILL a process and everything it spawned (children first listed, then killed together)."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def start_killer(trainer, busy, url: str, pid: int, events: dict) -> None:
    """A thread that kills `pid` once step KILL_STEP's generation has sequences on `url` (busy())."""

    def watch():
        while not (trainer.global_step == KILL_STEP - 1 and busy()):
            time.sleep(0.001)
        kill_tree(pid)
        events["killed_at"], events["killed_url"] = time.time(), url

    threading.Thread(target=watch, daemon=True).start()


def prefilled_since_step(trainer, log_path):
    """busy() for requests the queue trainer's producer process sends (rank 0's engine sends none): the
    server's log shows a prefill (a request started) after step KILL_STEP - 1 was reached."""
    state = {"at": None}

    def busy() -> bool:
        if state["at"] is None:
            state["at"] = log_path.stat().st_size
            return False
        with open(log_path, "rb") as f:
            f.seek(state["at"])
            return b"Prefill batch" in f.read()
    return busy


def main(out: str, mode: str, overrides: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load_config("configs/tiny_cpu.yaml", overrides + [f"trainer.output_dir={out}"])
    trainer = build_trainer(cfg)
    pgs, rz = trainer.p.pgs, trainer.p.engine
    events, report, used = {}, [], {}
    if pgs.rank == 0:
        engine = rz.engine
        if mode == "restart":
            victim = rz.servers[1]
            if cfg.queue.enable and cfg.queue.max_staleness > 0:  # the producer process sends the requests
                busy = prefilled_since_step(trainer, victim.log_path)
            else:
                busy = lambda: engine._inflight_items[victim.url] > 0  # noqa: E731
            start_killer(trainer, busy, victim.url, victim.process.pid, events)
        else:
            url = engine.urls[0]
            start_killer(trainer, lambda: engine._inflight_items[url] > 0, url, int(mode.split(":", 1)[1]), events)
        acquire = engine._acquire_url

        def recorded_acquire(items=1):
            url = acquire(items)
            used.setdefault(trainer.global_step + 1, []).append(url)
            return url

        engine._acquire_url = recorded_acquire
    push = trainer.sync_weights

    def rejoin_wait(version):
        if pgs.rank == 0 and mode == "restart" and version == REJOIN_VERSION:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                try:
                    if requests.get(rz.servers[1].url + "/health", timeout=30).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                time.sleep(0.5)

    def probe(version, metrics):
        tensors = actor_export(trainer)
        if pgs.rank == 0:
            want = export_logprobs(cfg.model.hf_path, tensors)
            entry = {"version": version, "states": dict(rz.engine.pool.state), "metrics": metrics, "servers": {}}
            for url in rz.engine.pool.up():
                try:
                    got, reported = server_logprobs(url)
                except requests.ConnectionError:
                    # the victim killed while its probe ran (the pool has not seen it go yet): not probed
                    deadline = time.monotonic() + 10
                    while events.get("killed_url") != url and time.monotonic() < deadline:
                        time.sleep(0.05)
                    if events.get("killed_url") != url:
                        raise
                    entry["servers"][url] = {"lost_during_probe": True}
                    continue
                entry["servers"][url] = {"weight_version": reported,
                                         "max_abs_diff": max(abs(a - b) for a, b in zip(got, want, strict=True))}
            report.append(entry)

    def checked_push(version, **kw):
        rejoin_wait(version)
        metrics = push(version, **kw)
        if not cfg.queue.enable or version == 0:  # the queue trainer's pushes run inside a pause: probed after
            probe(version, metrics)
        return metrics

    trainer.sync_weights = checked_push
    if cfg.queue.enable:  # the push with the pause around it (queue_trainer._sync_weights)
        sync_paused = trainer._sync_weights

        def probed_sync(*args):
            metrics = sync_paused(*args)
            probe(trainer.global_step, metrics)
            return metrics

        trainer._sync_weights = probed_sync
    try:
        fit_and_report(trainer, out, report=report, used=used)
    except Exception as e:
        with open(os.path.join(out, f"error.rank{pgs.rank}.txt"), "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        raise
    finally:
        if pgs.rank == 0:
            pool_events = [{"kind": e.kind, "url": e.url, "detail": e.detail, "wall": e.wall}
                           for e in rz.engine.pool.events]
            with open(os.path.join(out, "events.json"), "w") as f:
                json.dump({**events, "pool": pool_events}, f, indent=1)


if __name__ == "__main__":
    from megatron_dapo.trainer.run import exit_process

    exit_process(main(sys.argv[1], sys.argv[2], sys.argv[3:]))  # as python -m megatron_dapo.train ends
