"""The stage functions of one DAPO step, each a plain call that `fit` runs under a named timer.

Shape legend: B rows (responses, prompt-major), T max_response_length, P prompt width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_dapo.algos.kl import kl_penalty
from megatron_dapo.algos.overlong import overlong_filter_mask
from megatron_dapo.algos.rollout_correction import compute_rollout_correction
from megatron_dapo.data.dataset import PromptRecord
from megatron_dapo.rollout.base import PromptInput, RolloutEngine, SamplingParams, samples_to_batch
from megatron_dapo.trainer.batch import ScoredBatch, token_level
from megatron_dapo.workers.batch import PolicyBatch


def generate(engine: RolloutEngine, records: Sequence[PromptRecord], sampling: SamplingParams, *,
             group_suffix: str, pad_id: int, max_response_length: int):
    """Sample `sampling.n` responses per prompt. The GRPO group id is the prompt uid plus a suffix
    unique to this generation batch, so a prompt drawn twice in one step forms two groups."""
    prompts = [PromptInput(prompt_id=f"{r.uid}@{group_suffix}", token_ids=tuple(r.prompt_ids)) for r in records]
    samples = engine.generate(prompts, sampling)
    return samples_to_batch(samples, pad_id=pad_id, max_response_length=max_response_length)


def score(rollout, records: Sequence[PromptRecord], *, n: int, tokenizer, reward_manager) -> ScoredBatch:
    """Decode the responses and run the reward manager (overlong shaping included)."""
    rows = [records[i // n] for i in range(len(rollout))]
    texts = [tokenizer.decode(rollout.responses[i, : int(rollout.response_length[i])].tolist())
             for i in range(len(rollout))]
    out = reward_manager.score(texts, [r.ground_truth for r in rows], rollout.response_length,
                               data_sources=[r.data_source for r in rows])
    extra = dict(out.extra)
    extra["uid"] = [r.uid for r in rows]
    return ScoredBatch(rollout=rollout, raw_prompt=[r.raw_prompt for r in rows], response_text=texts,
                       ground_truth=[r.ground_truth for r in rows], scores=out.score.float(),
                       rewards=out.reward.float(), extra=extra)


def loss_mask(batch: ScoredBatch, *, overlong_filter: bool, max_response_length: int) -> Tensor:
    """[B, T] response mask; with overlong filtering, truncated responses (no EOS) are excluded."""
    rb = batch.rollout
    mask = rb.response_mask.clone()
    mask[rb.aborted] = 0.0
    if overlong_filter:
        keep = overlong_filter_mask(rb.response_length, max_response_length,
                                    ended_with_eos=torch.tensor([f == "stop" for f in rb.finish_reason]))
        mask = mask * keep.to(mask.dtype).unsqueeze(1)
    return mask


@dataclass(frozen=True)
class Advantages:
    advantages: Tensor  # [B, T]
    returns: Tensor  # [B, T]
    token_level_rewards: Tensor  # [B, T]
    metrics: dict[str, float]


def compute_advantages(batch: ScoredBatch, mask: Tensor, *, adv_fn, estimator: str, norm_adv_by_std_in_grpo: bool,
                       gamma: float, lam: float, kl_in_reward: dict | None, old_log_probs: Tensor | None,
                       ref_log_probs: Tensor | None) -> Advantages:
    """Token-level rewards (the sequence reward on the last token, minus a KL penalty when
    KL is in the reward), then the registered estimator over the non-aborted rows only: an aborted
    response is no sample of its group (it would shift the group's mean and std); its advantage is 0."""
    rb = batch.rollout
    rewards = token_level(batch.rewards, rb.response_length, rb.responses.shape[1])
    metrics: dict[str, float] = {}
    if kl_in_reward is not None:
        kl = kl_penalty(old_log_probs, ref_log_probs, kl_in_reward["kl_penalty"]) * mask
        beta = kl_in_reward["controller"].value
        rewards = rewards - beta * kl
        seq_kl = (kl.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
        kl_in_reward["controller"].update(float(seq_kl), n_steps=len(batch))
        metrics.update({"actor/reward_kl_penalty": float(seq_kl), "actor/reward_kl_penalty_coeff": beta})
    live = torch.nonzero(~rb.aborted).squeeze(1)
    index = [rb.index[i] for i in live.tolist()]
    kwargs = dict(token_level_rewards=rewards[live], response_mask=mask[live])
    if estimator in ("grpo", "grpo_vectorized"):
        kwargs.update(index=index, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
    elif estimator == "rloo":
        kwargs.update(index=index)
    elif estimator == "reinforce_plus_plus":
        kwargs.update(gamma=gamma)
    elif estimator == "gae":
        raise ValueError("algorithm.adv_estimator=gae needs a critic, which this trainer does not build yet")
    adv, ret = torch.zeros_like(rewards), torch.zeros_like(rewards)
    if len(live):
        adv_live, ret_live = adv_fn(**kwargs)
        adv[live], ret[live] = adv_live, ret_live
    return Advantages(adv, ret, rewards, metrics)


def rollout_correction(old_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor, rc: dict):
    """Decoupled mode: IS weights / rejection against the rollout policy, once per batch."""
    kw = {k: rc[k] for k in ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
                             "rollout_rs_threshold")}
    weights, new_mask, metrics = compute_rollout_correction(old_log_probs, rollout_log_probs, mask, **kw)
    return weights, new_mask, {k: float(v) for k, v in metrics.items()}


def policy_batch(batch: ScoredBatch, *, mask: Tensor, old_log_probs: Tensor | None, advantages: Tensor,
                 ref_log_probs: Tensor | None, is_weights: Tensor | None) -> PolicyBatch:
    """old_log_probs None: the update takes them from its own forward (Actor.update_policy_on_policy)."""
    rb = batch.rollout
    old = None if old_log_probs is None else old_log_probs * mask
    return PolicyBatch(prompt_ids=rb.prompt_ids, prompt_length=rb.prompt_length, responses=rb.responses,
                       response_length=rb.response_length, response_mask=mask, old_log_probs=old,
                       advantages=advantages, rollout_log_probs=rb.rollout_log_probs, index=list(rb.index),
                       ref_log_probs=ref_log_probs, rollout_is_weights=is_weights)


def log_prob_mismatch(old_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor) -> dict[str, float]:
    """The first-step invariant: the actor's recomputed log-probs against the engine's."""
    diff = (old_log_probs - rollout_log_probs).abs() * mask
    n = mask.sum().clamp(min=1)
    return {"rollout_corr/log_prob_abs_diff": float(diff.sum() / n),
            "rollout_corr/log_prob_abs_diff_max": float(diff.max()) if diff.numel() else 0.0}
