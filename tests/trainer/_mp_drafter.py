"""The sync trainer with an MTP layer against speculative SGLang stand-ins (see test_sglang_drafter.py).

    python tests/trainer/_mp_drafter.py OUT key=value ...                       (one process)
    torchrun --nproc_per_node 2 tests/trainer/_mp_drafter.py OUT key=value ...

After every weight sync (the one at start included) rank 0 compares, at every TP rank of every server,
the target's tensors with the actor's HF export without the MTP layer and the drafter's with the
export of the MTP layer under its drafter names (sha256 of the bytes). Writes OUT/report.json: per sync
the version, the counts compared, every mismatch and a digest of the MTP export; and OUT/metrics.json: rank 0's logged metrics by step.
"""

import hashlib
import logging
import sys

import requests
import torch.distributed as dist

from megatron_dapo.config import load_config
from megatron_dapo.models.config_arch import model_arch
from megatron_dapo.models.forward import unwrap_model
from megatron_dapo.models.hf import iter_hf_tensors
from megatron_dapo.trainer.run import build_trainer
from tests.standin import tensor_checksum
from tests.trainer._mp_cluster import fit_and_report


def actor_export(trainer) -> dict | None:
    """{HF name: checksum} of the actor's export with the MTP layer, on rank 0 (None elsewhere). A collective."""
    p = trainer.p
    arch = model_arch(trainer.cfg, vocab_size=p.tokenizer.vocab_size)
    mine = {name: tensor_checksum(t) for chunk in p.actor.policy.chunks
            for name, t in iter_hf_tensors(unwrap_model(chunk), pgs=p.pgs, arch=arch, drop_mtp=False)}
    if p.pgs.world_size == 1:
        return mine
    parts = [None] * p.pgs.world_size if p.pgs.rank == 0 else None
    dist.gather_object(mine, parts, dst=0, group=p.pgs.ctrl)
    return None if parts is None else {k: v for part in parts for k, v in part.items()}


def compare(want: dict, urls: list[str], role: str) -> tuple[int, list[str]]:
    mismatch, compared = [], 0
    for url in urls:
        ranks = requests.get(url + "/_standin/weights", params={"checksum": 1, "role": role}, timeout=60).json()["ranks"]
        for tp_rank, got in enumerate(ranks):
            for name in sorted(set(want) | set(got)):
                compared += 1
                if got.get(name, {}).get("sha256") != want.get(name, {}).get("sha256"):
                    mismatch.append(f"{url} tp{tp_rank} {role} {name}")
    return compared, mismatch


def main(out: str, overrides: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load_config("configs/tiny_cpu.yaml", overrides + [f"trainer.output_dir={out}"])
    trainer = build_trainer(cfg)
    pgs, urls = trainer.p.pgs, list(cfg.rollout.sglang_urls)
    push, report, logged = trainer.sync_weights, [], {}

    def checked_push(version):
        push(version)
        export = actor_export(trainer)
        if pgs.rank == 0:
            target = {n: c for n, c in export.items() if not n.startswith("mtp.")}
            draft = {n: c for n, c in export.items() if n.startswith("mtp.")}
            digest = hashlib.sha256("".join(draft[n]["sha256"] for n in sorted(draft)).encode()).hexdigest()
            entry = {"version": version, "mtp_tensors": len(draft), "target_tensors": len(target), "mtp_digest": digest}
            entry["target_compared"], entry["target_mismatch"] = compare(target, urls, "target")
            entry["draft_compared"], entry["draft_mismatch"] = compare(draft, urls, "draft")
            report.append(entry)

    trainer.sync_weights = checked_push
    if trainer.p.logger is not None:
        log_one = trainer.p.logger.log
        trainer.p.logger.log = lambda metrics, step: logged.setdefault(step, {}).update(log_one(metrics, step)) or {}
    fit_and_report(trainer, out, report=report, metrics=logged)


if __name__ == "__main__":
    from megatron_dapo.trainer.run import exit_process

    exit_process(main(sys.argv[1], sys.argv[2:]))  # as python -m megatron_dapo.train ends
