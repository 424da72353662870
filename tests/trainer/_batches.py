"""Hand-made scored batches for the trainer tests."""

import torch

from megatron_dapo.rollout.base import Sample, samples_to_batch
from megatron_dapo.trainer.batch import ScoredBatch


def scored(groups: dict[str, list[float]], *, T: int = 4, aborted: frozenset = frozenset()) -> ScoredBatch:
    """One scored batch: group id -> per-response acc (0/1), in the given order; `aborted` holds the
    (group id, sample index) pairs the engine aborted."""
    samples, accs = [], []
    for gid, vals in groups.items():
        for j, acc in enumerate(vals):
            L = 1 + (j % T)
            samples.append(Sample(prompt_id=gid, sample_index=j, prompt_token_ids=(1, 2, 3)[: 1 + j % 3],
                                  response_token_ids=tuple([5] * L), rollout_log_probs=tuple([-0.5] * L),
                                  finish_reason="abort" if (gid, j) in aborted else "stop", policy_version=0))
            accs.append(acc)
    rb = samples_to_batch(samples, pad_id=0, max_response_length=T)
    s = torch.tensor(accs, dtype=torch.float32)
    return ScoredBatch(rollout=rb, raw_prompt=[f"p-{i}" for i in rb.index], response_text=["r"] * len(samples),
                       ground_truth=["g"] * len(samples), scores=s, rewards=s - 0.1,
                       extra={"acc": [bool(a) for a in accs], "score": accs, "uid": list(rb.index)})
