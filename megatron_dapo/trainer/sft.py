"""A short supervised warm-up before RL (the embedded default uses it).

A randomly initialised model never answers the arithmetic task right, so every group would have a
constant accuracy and dynamic sampling would have nothing to keep. A few NLL steps on correct
answers give a policy that is sometimes right. The warmed-up weights are cached under
`trainer.output_dir/sft_warmup/<key>`, the key a hash of everything that determines them, so a re-run, or a
new `trainer.experiment_name` with the same warm-up settings, skips it.

How far to go: the tiny model learns to carry and borrow in a sharp phase (held-out accuracy goes
0.1 -> 0.9 within a few hundred steps), and DAPO lifts a policy that is sometimes right but cannot find
the algorithm from one that never is. Where that phase starts depends on the seed, so a fixed step count
can stop before it. `trainer.sft_warmup_target_acc` > 0 stops at the first check where the accuracy on
the first PROBE_SIZE training problems reaches the target, at most `sft_warmup_steps` steps. Training
problems, never the held-out ones. The checks come closer together as the accuracy nears the target
(PROBE_GAPS, in examples): far from it a check every 6,400 examples costs little, near it one every 1,600 keeps the stop
from overshooting (the accuracy can jump 0.33 -> 0.44 within 50 steps of the phase).

The learning rate: `sft_warmup_lr_warmup_steps` ramp up linearly, then `sft_warmup_lr_decay_style`.
Measured on the embedded default: the 100-step ramp brought the carry phase in from past the
3000-step cap (seed 42, constant lr from step 1) to step 1900 (seed 1: 2050). A cosine decay reached the target
sooner (1000-1700 steps) but left a policy DAPO could not lift (held-out 0.33 -> 0.16 after 50 RL
steps at lr 3e-4, flat at 1e-4): a decayed learning rate ends in a sharper minimum. Batch 128 reached
it in 650-1100 steps, but RL from there plateaued (seed 1: 0.42 -> 0.56 in 300 steps, with half the
groups all-wrong or all-right); with today's RL (64 x 4, lr 1e-3, beta2 0.98) it reached the target in
550 steps (seed 42) and RL fell from 0.33 to 0.22 in 100 steps, 0.42 at step 250.

What decides whether DAPO (lr 1e-3) lifts the warmed-up policy is how noisy the warm-up's steps were, not
how soon it got there (seed 42, 2026-12-03): batch 64 at lr 1e-3 reached the target in 1550 steps instead
of 2000, and RL from there fell 0.36 -> 0.13 in 150 steps. From the batch-128 policy at lr 2e-3, RL whose lr
ramped over 100 steps rose 0.33 -> 0.43 in 50 steps and fell back to 0.28 as its lr reached 1e-3; RL at a
constant 5e-4 held but rose slowly (0.59 at step 300). lr 3e-3 at batch 64 tracked 2e-3 (probe 0.135
against 0.143 at step 1450). Batch 128 at lr 2.8e-3, batch 64 at 2e-3 under Adam's square-root scaling
(the same gradient noise per example), reached the target in 386-635 steps (seeds 42 and 1) and RL lifted
it at lr 1e-3 (the embedded default; docs/embedded-default.md). torch.compile of the training forward (inductor, with the
engine's SDPA core attention and outside CudaToCpuMode) took a step from 112 to 92 ms after 72 s of
compilation: less than it costs over a 2000-step warm-up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random

import torch

from megatron_dapo.models.forward import unwrap_model
from megatron_dapo.workers.batch import PolicyBatch

log = logging.getLogger(__name__)

# Training examples to the next accuracy check (trainer.sft_warmup_target_acc), by the fraction of the target
# the last check reached: (below this fraction, examples); the first check comes after PROBE_GAPS[0][1]
# examples. In examples, not steps: how far the accuracy moves between checks follows the examples seen, so
# a batch of 128 checks every 12 steps near the target, where 64 checks every 25.
PROBE_GAPS = ((0.25, 6400), (0.6, 3200), (float("inf"), 1600))
PROBE_SIZE = 256  # training problems the check samples


def _cache_key(cfg, num_examples: int) -> str:
    a = cfg.actor  # the warm-up steps the actor's own optimizer
    parts = {"model": cfg.model.__dict__, "parallel": cfg.parallel.__dict__, "data": cfg.data.arithmetic.__dict__,
             "steps": cfg.trainer.sft_warmup_steps, "lr": cfg.trainer.sft_warmup_lr, "seed": cfg.trainer.seed,
             "n": num_examples, "batch": cfg.trainer.sft_warmup_batch_size,
             "schedule": [cfg.trainer.sft_warmup_lr_warmup_steps, cfg.trainer.sft_warmup_lr_decay_style],
             "optim": [a.adam_beta1, a.adam_beta2, a.adam_eps, a.weight_decay, a.clip_grad]}
    if cfg.trainer.sft_warmup_target_acc > 0:  # the probe's sampling decides where the warm-up stops
        parts |= {"target": cfg.trainer.sft_warmup_target_acc, "probe": cfg.rollout.val_kwargs.__dict__,
                  "probe_gaps": PROBE_GAPS, "probe_size": PROBE_SIZE}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def next_probe_gap(acc: float | None, target: float, batch_size: int) -> int:
    """Warm-up steps of `batch_size` examples until the next accuracy check, after a check that read `acc`
    (None: none yet)."""
    frac = 0.0 if acc is None else acc / target
    return max(1, round(next(gap for below, gap in PROBE_GAPS if frac < below) / batch_size))


def warmup_lr(t, step: int) -> float:
    """The learning rate of warm-up step `step` (1-based) under trainer config `t`: a linear ramp over
    sft_warmup_lr_warmup_steps, then constant or cosine down to 0 at sft_warmup_steps."""
    ramp = t.sft_warmup_lr_warmup_steps
    if step <= ramp:
        return t.sft_warmup_lr * step / ramp
    if t.sft_warmup_lr_decay_style == "constant":
        return t.sft_warmup_lr
    frac = (step - ramp) / max(1, t.sft_warmup_steps - ramp)
    return t.sft_warmup_lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> PolicyBatch:
    B = len(examples)
    P = max(len(p) for p, _ in examples)
    T = max(len(r) for _, r in examples)
    prompt_ids = torch.full((B, P), pad_id, dtype=torch.long)
    responses = torch.full((B, T), pad_id, dtype=torch.long)
    for i, (p, r) in enumerate(examples):
        prompt_ids[i, :len(p)] = torch.tensor(p)
        responses[i, :len(r)] = torch.tensor(r)
    response_length = torch.tensor([len(r) for _, r in examples])
    mask = (torch.arange(T)[None] < response_length[:, None]).float()
    zeros = torch.zeros(B, T)
    return PolicyBatch(prompt_ids=prompt_ids, prompt_length=torch.tensor([len(p) for p, _ in examples]),
                       responses=responses, response_length=response_length, response_mask=mask,
                       old_log_probs=zeros, advantages=mask.clone(), rollout_log_probs=zeros,
                       index=[str(i) for i in range(B)])


def sft_warmup(actor, examples, cfg, *, pad_id: int, rank: int, probe=None) -> dict[str, float]:
    """Run (or load from the cache) the NLL steps; returns the last step's metrics.

    probe: () -> accuracy of the current policy, the same on every rank (required when
    `trainer.sft_warmup_target_acc` > 0); called after next_probe_gap steps, the warm-up stops once it
    reaches the target."""
    target = cfg.trainer.sft_warmup_target_acc
    if target > 0 and probe is None:
        raise ValueError("trainer.sft_warmup_target_acc > 0 needs a probe of the policy's accuracy")
    steps = cfg.trainer.sft_warmup_steps
    if steps <= 0:
        return {}
    # beside the experiments, not inside one: every experiment of the output directory shares it
    cache_dir = os.path.join(cfg.trainer.output_dir, "sft_warmup", _cache_key(cfg, len(examples)))
    path = os.path.join(cache_dir, f"model_rank{rank}.pt")
    chunks = [unwrap_model(c) for c in actor.policy.chunks]
    if os.path.exists(path):
        state = torch.load(path, weights_only=True)
        for i, c in enumerate(chunks):
            c.load_state_dict(state[i])
        log.info("supervised warm-up loaded from %s", path)
        return {"sft/cached": 1.0}
    rng = random.Random(cfg.trainer.seed)
    metrics: dict[str, float] = {}
    done, acc = 0, None
    batch_size = min(cfg.trainer.sft_warmup_batch_size, len(examples))
    next_probe = next_probe_gap(None, target, batch_size) if target > 0 else 0
    while done < steps:
        done += 1
        rows = rng.sample(examples, batch_size)
        metrics = actor.supervised_step(_batch(rows, pad_id), lr=warmup_lr(cfg.trainer, done))
        if target > 0 and done == next_probe:
            acc = float(probe())
            log.info("supervised warm-up step %d: probe accuracy %.3f (target %.3f)", done, acc, target)
            if acc >= target:
                break
            next_probe = done + next_probe_gap(acc, target, batch_size)
    actor.reset_optimizer_state()
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"  # two experiments of one output directory may write it at once
    torch.save([c.state_dict() for c in chunks], tmp)
    os.replace(tmp, path)
    out = {"sft/nll": metrics.get("actor/pg_loss", 0.0), "sft/steps": float(done)}  # REINFORCE, A = 1: the NLL
    return out if acc is None else out | {"sft/probe_acc": acc}
