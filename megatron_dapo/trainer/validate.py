"""Validation on the held-out prompts: mean@n and pass@n per data source, with `rollout.val_kwargs`.

mean@n is the mean accuracy over all n samples of all prompts; pass@n the fraction of prompts with
at least one correct sample among their n (for n=1 both are the accuracy). The score mean is
reported too (math_dapo scores are +-1, the arithmetic reward 0/1). The accuracy's and the score's
mean@n are also logged under verl's names, `val-core/<source>/acc/mean@n` and `val-aux/<source>/score/mean@n`.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.trainer import stages


def validate(engine, dataset, cfg, *, tokenizer, reward_manager, seed: int, batch_prompts: int = 256,
             group=None, expect_policy_version: int | None = None) -> dict[str, float]:
    """group: the ranks sharing the work (`pgs.ctrl`; rewards are sharded and gathered, see stages.score);
    expect_policy_version: checked on every generated row (stages.generate)."""
    vk = cfg.rollout.val_kwargs
    sampling = SamplingParams(max_new_tokens=cfg.data.max_response_length, n=vk.n, temperature=vk.temperature,
                              top_p=vk.top_p, top_k=vk.top_k, stop_token_ids=(tokenizer.eos_id,), seed=seed)
    acc_by_prompt: dict[tuple[str, str], list[bool]] = defaultdict(list)
    scores_by_source: dict[str, list[float]] = defaultdict(list)
    lengths: list[int] = []
    records = list(dataset)
    for start in range(0, len(records), batch_prompts):
        chunk = records[start:start + batch_prompts]
        rollout = stages.generate(engine, chunk, sampling, group_suffix="val", pad_id=tokenizer.pad_id,
                                  max_response_length=cfg.data.max_response_length,
                                  expect_policy_version=expect_policy_version)
        scored = stages.score(rollout, chunk, n=vk.n, tokenizer=tokenizer, reward_manager=reward_manager, group=group)
        for i in range(len(scored)):
            rec = chunk[i // vk.n]
            acc_by_prompt[(rec.data_source, rec.uid)].append(bool(scored.extra["acc"][i]))
            scores_by_source[rec.data_source].append(float(scored.scores[i]))
        lengths.extend(rollout.response_length.tolist())
    out: dict[str, float] = {}
    for source in sorted(scores_by_source):
        accs = [a for (s, _), v in acc_by_prompt.items() if s == source for a in v]
        passes = [any(v) for (s, _), v in acc_by_prompt.items() if s == source]
        out[f"val/{source}/acc/mean@{vk.n}"] = sum(accs) / len(accs)
        out[f"val/{source}/acc/pass@{vk.n}"] = sum(passes) / len(passes)
        out[f"val/{source}/score/mean@{vk.n}"] = float(torch.tensor(scores_by_source[source]).mean())
        # verl's names for the same two means, so a run overlays on verl's curves (its val-core is the
        # accuracy's mean@n; its best@n and maj@n are bootstrap estimates, not logged here)
        out[f"val-core/{source}/acc/mean@{vk.n}"] = out[f"val/{source}/acc/mean@{vk.n}"]
        out[f"val-aux/{source}/score/mean@{vk.n}"] = out[f"val/{source}/score/mean@{vk.n}"]
    out["val/response_length/mean"] = float(sum(lengths) / max(len(lengths), 1))
    return out
