"""The sync trainer in a recipe layout (scaled down) against SGLang stand-in servers in their own processes.

    torchrun --nproc_per_node 4 tests/trainer/_mp_cluster.py OUT key=value ...

Runs `fit` as `python -m megatron_dapo.train` would (build_trainer), and after every weight sync checks
that every HF tensor at every TP rank of every server equals the actor's own HF export of that step
(sha256 of the bytes; the export is gathered over TP / PP / EP to its writer ranks, then to rank 0).
Writes OUT/report.json (rank 0: per sync, the tensors compared and the mismatches),
OUT/sync_stats.rank<r>.json (per sync: seconds, buckets, tensors sent, bytes sent and gathered) and
OUT/memory_events.rank<r>.json (the rank's colocation memory calls in order: the servers' release and
resume as the rank made them, the optimizer's offload / reload and steps, gc.collect, empty_cache).
"""

import json
import logging
import sys

import requests
import torch.distributed as dist

from megatron_dapo.config import load_config
from megatron_dapo.models.config_arch import model_arch
from megatron_dapo.models.forward import unwrap_model
from megatron_dapo.models.hf import iter_hf_tensors
from megatron_dapo.trainer.run import build_trainer, close_parts
from tests.standin import tensor_checksum


def actor_export_checksums(trainer) -> dict | None:
    """{HF name: checksum} of the actor's own HF export, on rank 0 (None elsewhere). A collective."""
    return actor_export(trainer, tensor_checksum)


def actor_export(trainer, fn=lambda t: t.detach().clone()) -> dict | None:
    """{HF name: fn(tensor)} of the actor's own HF export (gathered over TP / PP / EP to its writer
    ranks, then to rank 0), on rank 0 (None elsewhere). A collective."""
    p = trainer.p
    arch = model_arch(trainer.cfg, vocab_size=p.tokenizer.vocab_size)
    mine = {}
    for chunk in p.actor.policy.chunks:
        for name, t in iter_hf_tensors(unwrap_model(chunk), pgs=p.pgs, arch=arch):
            mine[name] = fn(t)
    parts = [None] * p.pgs.world_size if p.pgs.rank == 0 else None
    dist.gather_object(mine, parts, dst=0, group=p.pgs.ctrl)
    if p.pgs.rank != 0:
        return None
    out = {}
    for part in parts:
        dup = set(out) & set(part)
        assert not dup, f"tensors exported by two ranks: {sorted(dup)[:3]}"
        out.update(part)
    return out


def fit_and_report(trainer, out: str, **rank0_files) -> None:
    """Run `fit`, release the trainer's parts whatever happens, then write each of `rank0_files` as
    OUT/<name>.json on rank 0 (what the hooks recorded during the run) and wait for every rank."""
    try:
        trainer.fit()
    finally:
        close_parts(trainer.p)
    pgs = trainer.p.pgs
    if pgs.rank == 0:
        for name, data in rank0_files.items():
            with open(f"{out}/{name}.json", "w") as f:
                json.dump(data, f, indent=1)
    if pgs.world_size > 1:
        dist.barrier(group=pgs.ctrl)


def record_memory_calls(events: list) -> None:
    """Append each colocation memory call of this process to `events`, in the order made (patched before
    the trainer is built, since the weight push binds free_for_rollout then)."""
    from megatron_dapo.rollout.rank0 import RankZeroEngine
    from megatron_dapo.workers import memory

    def wrap(owner, name, label):
        real = getattr(owner, name)

        def recorded(*args, **kwargs):
            events.append(label(*args, **kwargs) if callable(label) else label)
            return real(*args, **kwargs)

        setattr(owner, name, recorded)

    def effective(verb, want_released):
        def label(engine, tags=None):
            tags = [t for t in (tags or engine.MEMORY_TAGS) if (t in engine.released) == want_released]
            return f"{verb}:{','.join(tags)}" if tags else f"{verb}:none"
        return label

    wrap(RankZeroEngine, "release_memory", effective("release", False))
    wrap(RankZeroEngine, "resume_memory", effective("resume", True))
    wrap(memory.OptimizerOffload, "offload", "offload")
    wrap(memory.OptimizerOffload, "reload", "reload")
    wrap(memory, "empty_cache", "empty_cache")
    gc_collect = memory.gc.collect
    memory.gc = type("RecordedGC", (), {"collect": staticmethod(lambda: events.append("gc.collect") or gc_collect())})


def main(out: str, overrides: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load_config("configs/tiny_cpu.yaml", overrides + [f"trainer.output_dir={out}"])
    events: list = []
    record_memory_calls(events)
    trainer = build_trainer(cfg)
    optimizer_step = trainer.p.actor.optimizer.step
    trainer.p.actor.optimizer.step = lambda *a, **k: events.append("optimizer.step") or optimizer_step(*a, **k)
    pgs, urls = trainer.p.pgs, list(cfg.rollout.sglang_urls)
    sync = trainer.sync_weights.sync
    stats, report = [], []
    real_sync = sync.sync

    def recorded_sync(version, targets=None, **kw):
        s = real_sync(version, targets, **kw)
        stats.append({"version": version, "seconds": s.seconds, "buckets": s.buckets, "tensors": s.tensors,
                      "bytes_sent": s.bytes_sent, "bytes_gathered": s.bytes_gathered})
        return s

    sync.sync = recorded_sync
    push = trainer.sync_weights

    def checked_push(version):
        push(version)
        want = actor_export_checksums(trainer)
        if pgs.rank == 0:
            entry = {"version": version, "expected": len(want), "mismatch": []}
            for url in urls:
                ranks = requests.get(url + "/_standin/weights", params={"checksum": 1}, timeout=60).json()["ranks"]
                for tp_rank, got in enumerate(ranks):
                    for name in sorted(set(want) | set(got)):
                        if got.get(name, {}).get("sha256") != want.get(name, {}).get("sha256"):
                            entry["mismatch"].append(f"{url} tp{tp_rank} {name}")
                entry[url] = [len(r) for r in ranks]
            report.append(entry)

    trainer.sync_weights = checked_push
    try:
        trainer.fit()
    finally:
        close_parts(trainer.p)
    with open(f"{out}/sync_stats.rank{pgs.rank}.json", "w") as f:
        json.dump(stats, f)
    with open(f"{out}/memory_events.rank{pgs.rank}.json", "w") as f:
        json.dump(events, f)
    if pgs.rank == 0:
        with open(f"{out}/report.json", "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier(group=pgs.ctrl)


if __name__ == "__main__":
    from megatron_dapo.trainer.run import exit_process

    exit_process(main(sys.argv[1], sys.argv[2:]))  # as python -m megatron_dapo.train ends
