"""The stage functions of one DAPO step, each a plain call that `fit` runs under a named timer.

Shape legend: B rows (responses, prompt-major), T max_response_length, P prompt width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_dapo.algos.kl import kl_penalty
from megatron_dapo.algos.overlong import overlong_filter_mask
from megatron_dapo.algos.rollout_correction import compute_rollout_correction
from megatron_dapo.data.dataset import PromptRecord
from megatron_dapo.rollout.base import (
    GroupsDone,
    PromptInput,
    RolloutEngine,
    SamplingParams,
)
from megatron_dapo.rollout.ragged import RaggedRows
from megatron_dapo.trainer.batch import ScoredBatch, token_level
from megatron_dapo.trainer.mismatch import mismatch_metrics
from megatron_dapo.workers.batch import PolicyBatch


class RewardScoringError(RuntimeError):
    """The reward manager raised on some rank; every rank raises this, with each failing rank's message."""


class PolicyVersionError(RuntimeError):
    """A rollout row was generated with other weights than the trainer synced last."""


def group_id(record: PromptRecord, group_suffix: str) -> str:
    """The GRPO group id of a prompt in one generation batch."""
    return f"{record.uid}@{group_suffix}"


def generate(engine: RolloutEngine, records: Sequence[PromptRecord], sampling: SamplingParams, *,
             group_suffix: str, pad_id: int, max_response_length: int, expect_policy_version: int | None = None,
             on_groups_done: GroupsDone | None = None):
    """Sample `sampling.n` responses per prompt. The GRPO group id is the prompt uid plus a suffix
    unique to this generation batch, so a prompt drawn twice in one step forms two groups.

    expect_policy_version: the version of the weights last synced to the engine; a row generated
    with any other version raises PolicyVersionError naming it (the servers missed a sync).
    on_groups_done: stream (`RolloutEngine.generate_streaming`): the engine stops when it says so."""
    prompts = [PromptInput(prompt_id=group_id(r, group_suffix), token_ids=tuple(r.prompt_ids)) for r in records]
    if on_groups_done is None:
        batch = engine.generate_batch(prompts, sampling, pad_id=pad_id, max_response_length=max_response_length)
    else:
        batch = engine.generate_batch_streaming(prompts, sampling, pad_id=pad_id,
                                                max_response_length=max_response_length, on_groups_done=on_groups_done)
    if expect_policy_version is not None:
        bad = torch.nonzero(batch.policy_version != expect_policy_version).squeeze(1)
        if len(bad):
            r = int(bad[0])
            raise PolicyVersionError(
                f"rollout row {r} (group {batch.index[r]!r}) was generated with policy version "
                f"{int(batch.policy_version[r])}, expected {expect_policy_version} ({len(bad)} of {len(batch)} rows "
                "differ): the engine did not receive the last weight sync")
    return batch


def response_tokens(rollout, i: int) -> Tensor:
    """Row i's response tokens, from a dense or a ragged batch (rollout/ragged.py)."""
    if isinstance(rollout.responses, RaggedRows):
        return rollout.responses.row(i)
    return rollout.responses[i, : int(rollout.response_length[i])]


def score(rollout, records: Sequence[PromptRecord], *, n: int, tokenizer, reward_manager, group=None) -> ScoredBatch:
    """Decode the responses and run the reward manager (overlong shaping included).

    group: the ranks that share this batch (`pgs.ctrl`). Each scores its share of the rows (row r on
    rank r % world) and the results are all-gathered, so every rank holds the same rewards and takes
    the same dynamic-sampling decision whatever its reward timeouts did; the decoded texts are
    gathered to rank 0 only (dumps), other ranks hold "" for rows they did not score."""
    rows = [records[i // n] for i in range(len(rollout))]
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    mine = list(range(rank, len(rollout), world))  # the rows rollout/rank0.py sent this rank
    # Only this rank's rows, and only their real tokens, become Python ints (the padded matrix as lists
    # would cost 40 B per element: ~19 GiB per rank at 24,576 x 20,480).
    texts = [tokenizer.decode(response_tokens(rollout, i)) for i in mine]
    shard: dict = {"rows": mine, "score": [], "reward": [], "extra": {}, "error": None}
    try:
        if mine:
            out = reward_manager.score(texts, [rows[i].ground_truth for i in mine], rollout.response_length[mine],
                                       data_sources=[rows[i].data_source for i in mine],
                                       extra_infos=[rows[i].extra_info for i in mine])
            shard.update(score=out.score.float().tolist(), reward=out.reward.float().tolist(), extra=dict(out.extra))
    except Exception as e:  # noqa: BLE001 - raised on every rank below, never on one rank alone
        if world == 1:
            raise
        shard["error"] = f"{type(e).__name__}: {e}"
    if world > 1:
        shards: list = [None] * world
        dist.all_gather_object(shards, shard, group=group)
        text_shards: list | None = [None] * world if rank == 0 else None
        dist.gather_object(texts, text_shards, dst=dist.get_global_rank(group, 0), group=group)
    else:
        shards, text_shards = [shard], [texts]
    failed = [(k, sh["error"]) for k, sh in enumerate(shards) if sh["error"] is not None]
    if failed:
        raise RewardScoringError("reward scoring failed on " + "; ".join(f"rank {k}: {e}" for k, e in failed))
    texts_of = (lambda k: text_shards[k]) if text_shards is not None else (lambda k: [""] * len(shards[k]["rows"]))
    return _scored_batch(rollout, rows, [(sh["rows"], sh, texts_of(k)) for k, sh in enumerate(shards)])


def _scored_batch(rollout, rows: Sequence[PromptRecord], parts) -> ScoredBatch:
    """The ScoredBatch of `rollout` from parts (row positions, {"score", "reward", "extra"}, texts) that
    together cover every row; rows: the record of each row."""
    B = len(rollout)
    score_t, reward_t = torch.zeros(B), torch.zeros(B)
    extra: dict[str, list] = {k: [None] * B for _, sh, _ in parts for k in sh["extra"]}
    all_texts = [""] * B
    for positions, sh, texts in parts:
        idx = torch.tensor(positions, dtype=torch.long)
        score_t[idx], reward_t[idx] = torch.tensor(sh["score"], dtype=torch.float32), torch.tensor(
            sh["reward"], dtype=torch.float32)
        for key, vals in sh["extra"].items():
            for i, v in zip(positions, vals, strict=True):
                extra[key][i] = v
        for i, t in zip(positions, texts, strict=True):
            all_texts[i] = t
    extra["uid"] = [r.uid for r in rows]
    return ScoredBatch(rollout=rollout, raw_prompt=[r.raw_prompt for r in rows], response_text=all_texts,
                       ground_truth=[r.ground_truth for r in rows], scores=score_t, rewards=reward_t, extra=extra)


def score_streamed(rollout, records: Sequence[PromptRecord], scored: dict[str, tuple[ScoredBatch, int]], *, n: int,
                   tokenizer, reward_manager, group=None) -> ScoredBatch:
    """`score` for a streaming generation batch of complete groups, reusing the scores the streaming
    callback computed: scored = {group id: (its ScoredBatch, first row of the group in it)}, filled on the
    rank that ran the callback (rank 0 of `group`). That rank scores only the groups the callback did not
    (reported after a stop, left pending, or whose reward failed), then sends every row's values, not the
    texts, to the other ranks (their response_text is "", as with `score`), so each complete group is
    scored once. An error raises RewardScoringError on every rank."""
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    parts, error = None, None
    if rank == 0:
        try:
            parts = _streamed_parts(rollout, records, scored, n=n, tokenizer=tokenizer, reward_manager=reward_manager)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            if world == 1:
                raise
            error = f"{type(e).__name__}: {e}"
    if world > 1:
        box = [([(rows, values, None) for rows, values, _ in parts or []], error)]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        if rank != 0:
            parts = [(rows, values, [""] * len(rows)) for rows, values, _ in box[0][0]]
        error = box[0][1]
    if error is not None:
        raise RewardScoringError(f"reward scoring failed on rank 0: {error}")
    return _scored_batch(rollout, [records[i // n] for i in range(len(rollout))], parts)


def _streamed_parts(rollout, records, scored, *, n: int, tokenizer, reward_manager) -> list:
    from megatron_dapo.workers.batch import select_record

    parts, missing = [], []
    for g in range(len(records)):
        gid = rollout.index[g * n]
        if gid not in scored:
            missing.append(g)
            continue
        chunk, first = scored[gid]
        if list(chunk.rollout.index[first:first + n]) != [gid] * n:
            raise RuntimeError(f"streamed scores of group {gid!r} do not line up with its rows")
        at = range(first, first + n)
        parts.append((list(range(g * n, g * n + n)),
                      {"score": chunk.scores[first:first + n].tolist(), "reward": chunk.rewards[first:first + n].tolist(),
                       "extra": {k: [v[i] for i in at] for k, v in chunk.extra.items() if k != "uid"}},
                      [chunk.response_text[i] for i in at]))
    if missing:
        rows = [g * n + j for g in missing for j in range(n)]
        fresh = score(select_record(rollout, rows), [records[g] for g in missing], n=n, tokenizer=tokenizer,
                      reward_manager=reward_manager)
        parts.append((rows, {"score": fresh.scores.tolist(), "reward": fresh.rewards.tolist(),
                             "extra": {k: v for k, v in fresh.extra.items() if k != "uid"}}, fresh.response_text))
    return parts


def group_scorer(records: Sequence[PromptRecord], *, group_suffix: str, n: int, tokenizer, reward_manager):
    """score_groups(batch) -> ScoredBatch for the streaming callback: a ragged batch of complete groups (n
    rows each, prompt-major) of `records`, scored on the calling rank alone."""
    by_id = {group_id(r, group_suffix): r for r in records}

    def score_groups(rollout):
        return score(rollout, [by_id[rollout.index[g]] for g in range(0, len(rollout), n)], n=n,
                     tokenizer=tokenizer, reward_manager=reward_manager)

    return score_groups


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
    """The first-step invariant: the actor's recomputed log-probs against the engine's, with the contract
    metrics of trainer/mismatch.py."""
    diff = (old_log_probs - rollout_log_probs).abs() * mask
    n = mask.sum().clamp(min=1)
    return {"rollout_corr/log_prob_abs_diff": float(diff.sum() / n),
            "rollout_corr/log_prob_abs_diff_max": float(diff.max()) if diff.numel() else 0.0,
            **mismatch_metrics(old_log_probs, rollout_log_probs, mask)}
