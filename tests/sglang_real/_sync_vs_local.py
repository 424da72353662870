"""One weight transport against real SGLang servers, checked by greedy generation against the local engine.

    python tests/sglang_real/_sync_vs_local.py OUT TRANSPORT key=value ...

Builds the trainer's parts as `python -m megatron_dapo.train` would (one process; rollout.sglang_urls
given), with rollout.weight_transport=TRANSPORT. Then twice, at version 0 (the actor as loaded) and at
version 1 (every actor parameter moved by seeded noise): sync the actor to the servers with the
trainer's own push, and generate greedily from each server alone and from a LocalEngine on the actor's
model for the same prompts. Writes OUT/sync_vs_local.json: per version the sync seconds, the local
engine's tokens and each server's tokens and reported weight version.
"""

import json
import logging
import sys
import time

import torch

from megatron_dapo.config import load_config
from megatron_dapo.models.forward import unwrap_model
from megatron_dapo.rollout.base import PromptInput, SamplingParams
from megatron_dapo.rollout.local_engine import LocalEngine
from megatron_dapo.rollout.sglang.engine import SGLangEngine
from megatron_dapo.trainer.run import build_parts, close_parts

PROMPTS = [PromptInput(f"p{i}", tuple([1] + ids)) for i, ids in enumerate([
    [4, 13, 5, 16, 7], [17, 9, 14, 3, 15, 11], [16, 6, 8], [10, 12, 17, 4, 5, 6, 7, 8], [3, 3, 3, 3],
    [11, 13, 15, 17, 5, 9, 7]])]
"""Six prompts over the arithmetic vocabulary (ids 1..17), of different lengths."""
GREEDY = SamplingParams(max_new_tokens=20, min_new_tokens=8, temperature=0.0)
NOISE_STD = 0.02


def greedy(engine) -> dict[str, dict]:
    return {s.prompt_id: {"tokens": list(s.response_token_ids), "version": s.policy_version}
            for s in engine.generate(PROMPTS, GREEDY)}


def main(out: str, transport: str, overrides: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load_config("configs/tiny_cpu.yaml", overrides + [f"rollout.weight_transport={transport}",
                                                            f"trainer.output_dir={out}"])
    parts = build_parts(cfg)
    model = unwrap_model(parts.actor.policy.chunks[0])
    local = LocalEngine(model, pgs=parts.pgs, eos_token_id=parts.tokenizer.eos_id, pad_token_id=parts.tokenizer.pad_id)
    report = []
    try:
        for version in (0, 1):
            if version:
                g = torch.Generator().manual_seed(7)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(NOISE_STD * torch.randn(p.shape, generator=g).to(p.dtype))
            t0 = time.perf_counter()
            parts.sync_weights(version)
            last = parts.sync_weights.sync.last_stats
            entry = {"version": version, "sync_s": time.perf_counter() - t0, "local": greedy(local), "servers": {},
                     "buckets": last.buckets, "flattened_buckets": last.flattened_buckets}
            for url in cfg.rollout.sglang_urls:
                with SGLangEngine([url]) as one:
                    entry["servers"][url] = greedy(one)
            report.append(entry)
    finally:
        close_parts(parts)
    with open(f"{out}/sync_vs_local.json", "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    from megatron_dapo.trainer.run import exit_process

    exit_process(main(sys.argv[1], sys.argv[2], sys.argv[3:]))  # as python -m megatron_dapo.train ends
