"""The Megatron actor: the DAPO policy update on top of `workers.policy.PolicyModel`.

Shape legend:
    B  rows (responses) of the batch, prompt-major   T  response width
    log_probs, entropy, response_mask, advantages: [B, T] at the edges (PolicyBatch, LogProbs)
    b, W  one micro-batch's rows and its longest response: the loss works on [b, W] per-row tensors
    N  the micro-batch's real response tokens: what the LM head and the kernel see

Data parallelism is SPMD: every rank holds the whole batch, works on its DP shard of the rows and
the results are reduced across DP. The loss of every micro-batch is normalised by the *global*
token count (or sequence count) of its mini-batch, computed once from the whole mini-batch before
the micro-batch loop (STYLE.md rule 7), so the objective does not depend on how a mini-batch is
split into micro-batches or DP ranks: each rank sorts and packs its rows freely, and fillers
(micro-batches without rows, which keep the count equal across DP ranks) add nothing. Megatron's
schedule divides each micro-batch loss by the number of micro-batches and DDP averages gradients
over DP; `_loss_func` undoes the first and the `dp_size` factor of `agg_loss` undoes the second.
(Megatron's MoE aux loss and MTP loss are per micro-batch by design: their weight per micro-batch is
1 / micro-batch count, fillers included.)

Every actor config field reaches the loss by keyword (STYLE.md rule 2; tested).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_dapo.algos.kl import kl_penalty
from megatron_dapo.algos.policy_loss import agg_loss, get_policy_loss_fn
from megatron_dapo.algos.rollout_correction import compute_rollout_correction
from megatron_dapo.config.schema import ActorConfig
from megatron_dapo.workers.batch import PolicyBatch
from megatron_dapo.workers.microbatch import MicroBatch
from megatron_dapo.workers.policy import LogProbs, PassPlan, PolicyModel, dp_shard_rows

__all__ = ["Actor", "LogProbs", "PolicyModel", "dp_shard_rows"]


class Actor:
    """The policy: PolicyModel + Megatron optimizer + LR scheduler + the DAPO loss."""

    def __init__(self, policy: PolicyModel, *, optimizer, scheduler, cfg: ActorConfig, loss_fn, n: int,
                 balance_batch: bool, bypass_correction: dict | None = None):
        """bypass_correction: in bypass mode (old log-probs := rollout log-probs), the rollout-correction
        keywords (rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold) applied per
        micro-batch to the current (detached) log-probs against the rollout's, e.g. bypass_pg_is."""
        self.policy, self.optimizer, self.scheduler = policy, optimizer, scheduler
        self.cfg, self.loss_fn, self.n, self.balance_batch = cfg, loss_fn, n, balance_batch
        self.bypass_correction = bypass_correction
        self.pgs = policy.pgs
        self.offload = None  # workers.memory.OptimizerOffload with actor.offload_optimizer (colocated SGLang)

    def compute_log_prob(self, *args, **kwargs) -> LogProbs:
        return self.policy.compute_log_prob(*args, **kwargs)

    def _loss_func(self, batch: PolicyBatch, totals: dict, denom: dict, num_mbs: int, record: dict | None,
                   plan: PassPlan, mb: MicroBatch, output):
        """record (update_policy_on_policy): {"buf": [K, N_local] this rank's token buffer receiving the
        detached log-probs (and sum p^2 when "sq"), "sq": bool}; old_log_prob is then logp.detach()."""
        cfg = self.cfg
        if not mb.token_index.numel():
            # A filler (or rows without a response token): no loss, no token, no share of any
            # denominator; the backward still runs (MoE all-to-all and pipeline partners).
            return output.sum() * 0.0, {}
        rows = mb.rows
        want_sq = record is not None and record["sq"]
        lp_tok, ent_tok, sq_tok = self.policy.token_stats(output, mb, weight=self.policy.lm_head_weight(),
                                                          entropy=True, sum_sq=want_sq)
        if record is not None:
            dest = plan.dest[id(mb)].to(record["buf"].device)
            record["buf"][0, dest] = lp_tok.detach()
            if want_sq:
                record["buf"][1, dest] = sq_tok
        logp, ent = mb.to_rows(lp_tok), mb.to_rows(ent_tok)  # [b, W]
        W = mb.width
        dev = logp.device
        take = lambda t: None if t is None else t.index_select(0, rows)[:, :W].to(dev)  # noqa: E731
        mask = take(batch.response_mask)
        is_weights = take(batch.rollout_is_weights)
        if self.bypass_correction is not None:
            # Weights of the current policy against the rollout policy; rejected tokens get weight 0
            # (the mask, and with it the global token count, stays as computed before the loop).
            w, kept, _ = compute_rollout_correction(logp.detach(), take(batch.rollout_log_probs), mask,
                                                    rollout_is_batch_normalize=False, **self.bypass_correction)
            is_weights = kept if w is None else w * kept
        norm = dict(dp_size=self.pgs.dp_size, batch_num_tokens=denom["tokens"], global_batch_size=denom["seqs"])
        pg_loss, pg_metrics = self.loss_fn(
            old_log_prob=logp.detach() if record is not None else take(batch.old_log_probs), log_prob=logp, advantages=take(batch.advantages),
            response_mask=mask, loss_agg_mode=cfg.loss_agg_mode, clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
            rollout_is_weights=is_weights, **norm)
        loss = pg_loss
        ent_mat = ent if cfg.entropy_coeff > 0 else ent.detach()
        entropy = agg_loss(ent_mat, mask, cfg.loss_agg_mode, **norm)
        if cfg.entropy_coeff > 0:
            loss = loss - cfg.entropy_coeff * entropy
        if cfg.use_kl_loss:
            kl = kl_penalty(logp, take(batch.ref_log_probs), cfg.kl_loss_type)
            kl_loss = agg_loss(kl, mask, cfg.loss_agg_mode, **norm)
            loss = loss + cfg.kl_loss_coef * kl_loss
            totals["actor/kl_loss"] += kl_loss.detach() / self.pgs.dp_size
        # Mini-batch totals: losses are already normalised globally (x dp_size); token metrics are
        # masked means of this micro-batch, weighted back by its token count.
        n_tok = mask.sum()
        totals["actor/pg_loss"] += pg_loss.detach() / self.pgs.dp_size
        totals["actor/entropy"] += entropy.detach() / self.pgs.dp_size
        for k, v in pg_metrics.items():
            totals[k] += v.detach() * n_tok
        totals["_tokens"] += n_tok.detach()
        # Megatron divides by the number of micro-batches (legacy 2-tuple loss); undo it.
        return loss * num_mbs, {}

    def update_policy(self, batch: PolicyBatch) -> dict[str, float]:
        """ppo_epochs x mini-batches of ppo_mini_batch_size prompts; one optimizer step per mini-batch."""
        cfg = self.cfg
        rows_per_mini = cfg.ppo_mini_batch_size * self.n
        B = len(batch)
        self._check_update_batch(batch)
        if B % rows_per_mini:
            raise ValueError(f"batch of {B} rows is not a multiple of ppo_mini_batch_size*n = {rows_per_mini}")
        self._begin_training_step()
        for m in self.policy.chunks:
            m.train()
        history: list[dict[str, Tensor]] = []
        for _epoch in range(cfg.ppo_epochs):
            for start in range(0, B, rows_per_mini):
                mini = list(range(start, start + rows_per_mini))
                history.append(self._update_mini(batch, mini))
        keys = history[0].keys()
        return {k: float(sum(float(h[k]) for h in history) / len(history)) for k in keys}

    def update_policy_on_policy(self, batch: PolicyBatch, *, with_sum_sq: bool = False) -> tuple[dict[str, float], LogProbs]:
        """One optimizer step on the whole batch with old_log_prob := the update forward's own
        log-probs, detached (`batch.old_log_probs` must be None). Before the step the weights are the
        ones a separate old_log_prob forward would use, so the ratio is exactly 1 and the loss and
        gradient are those of the recomputed path, one forward cheaper (trainer: actor.old_log_prob_from_update).

        Returns the metrics and those log-probs ([B, T] on every rank, like compute_log_prob), with the
        per-token sum of squared probabilities when `with_sum_sq`.
        """
        if batch.old_log_probs is not None:
            raise ValueError("update_policy_on_policy: batch.old_log_probs must be None (it is taken from the update)")
        if self.cfg.ppo_epochs != 1 or len(batch) != self.cfg.ppo_mini_batch_size * self.n:
            raise ValueError(
                f"update_policy_on_policy needs exactly one optimizer step: ppo_epochs=1 (got {self.cfg.ppo_epochs}) "
                f"and a batch of ppo_mini_batch_size*n = {self.cfg.ppo_mini_batch_size * self.n} rows (got {len(batch)})")
        self._check_update_batch(batch)
        record = {"sq": with_sum_sq}
        self._begin_training_step()
        for m in self.policy.chunks:
            m.train()
        out = self._update_mini(batch, list(range(len(batch))), record=record)
        stacked = self.policy.gather_tokens(record["plan"], record["buf"], batch.response_length,
                                            batch.responses.shape[1])
        lp = LogProbs(stacked[0] * batch.response_mask, None, stacked[1] if with_sum_sq else None)
        return {k: float(v) for k, v in out.items()}, lp

    def _begin_training_step(self) -> None:
        """Advance the LR schedule by one training step (every mini-batch of the step shares its lr)."""
        self.scheduler.step(increment=1)

    def _check_update_batch(self, batch: PolicyBatch) -> None:
        if self.cfg.use_kl_loss and batch.ref_log_probs is None:
            raise ValueError("actor.use_kl_loss is on but the batch has no ref_log_probs (is the reference built?)")

    def supervised_step(self, batch: PolicyBatch, *, lr: float) -> dict[str, float]:
        """One NLL step on all rows, outside the RL schedule (the supervised warm-up).

        REINFORCE with advantages 1 is exactly the token-mean negative log-likelihood."""
        saved = self.loss_fn
        self.loss_fn = get_policy_loss_fn("reinforce")
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for m in self.policy.chunks:
            m.train()
        try:
            out = self._update_mini(batch, list(range(len(batch))), replay_routing=False)
        finally:
            self.loss_fn = saved
            self.scheduler.step(increment=0)  # restore the RL schedule's learning rate
        return {k: float(v) for k, v in out.items()}

    def reset_optimizer_state(self) -> None:
        """Forget Adam moments (after the warm-up, so RL starts from a fresh optimizer)."""
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            opt.optimizer.state.clear()

    def _update_mini(self, batch: PolicyBatch, mini: list[int], *, record: dict | None = None,
                     replay_routing: bool = True) -> dict[str, Tensor]:
        """One optimizer step on the rows `mini` (record: see _loss_func; it receives "plan" and "buf").
        replay_routing: with actor.router_replay, replay the routing compute_log_prob recorded for the batch
        (off for the supervised warm-up: no behaviour policy, no recorded routing)."""
        mask = batch.response_mask[mini]
        denom = {"tokens": mask.sum().to(self.pgs.device),
                 "seqs": (mask.sum(-1) > 0).sum().to(self.pgs.device)}
        plan = self.policy.plan(batch.prompt_ids, batch.prompt_length, batch.responses, batch.response_length, [mini])
        if record is not None:
            record["plan"] = plan
            record["buf"] = torch.zeros(1 + record["sq"], plan.num_local_tokens, device=self.pgs.device)
        zero = lambda: torch.zeros((), device=self.pgs.device)  # noqa: E731
        totals = {k: zero() for k in ("actor/pg_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl",
                                      "actor/pg_clipfrac_lower", "_tokens")}
        if self.cfg.use_kl_loss:
            totals["actor/kl_loss"] = zero()
        for chunk in self.policy.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss_func = partial(self._loss_func, batch, totals, denom, plan.counts(), record, plan)
        replay = self.policy.replay(batch.responses) if self.policy.router_replay and replay_routing else None
        try:
            self.policy.run(plan.microbatches, loss_func, forward_only=False,
                            before_forward=replay.before_forward if replay is not None else None)
        finally:
            if replay is not None:
                replay.remove()
        replayed = replay.metrics(self.pgs) if replay is not None else {}
        ok, grad_norm, _ = self.optimizer.step()
        return {**self._reduce(totals, grad_norm, ok), **replayed}

    def _reduce(self, totals: dict[str, Tensor], grad_norm, ok: bool) -> dict[str, Tensor]:
        keys = list(totals)
        vec = torch.stack([totals[k].float() for k in keys])
        if self.pgs.pp_size > 1:
            dist.broadcast(vec, src=dist.get_global_rank(self.pgs.pp, self.pgs.pp_size - 1), group=self.pgs.pp)
        if self.pgs.dp_size > 1:
            dist.all_reduce(vec, group=self.pgs.dp)
        out = dict(zip(keys, vec.cpu()))
        tokens = out.pop("_tokens").clamp(min=1)
        for k in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
            out[k] = out[k] / tokens
        out["actor/grad_norm"] = torch.tensor(float(grad_norm) if grad_norm is not None else 0.0)
        out["actor/lr"] = torch.tensor(float(self.optimizer.param_groups[0]["lr"]))
        out["actor/update_skipped"] = torch.tensor(0.0 if ok else 1.0)
        return out
