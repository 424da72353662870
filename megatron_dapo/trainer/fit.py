"""The sync DAPO trainer: `fit` reads top to bottom, one named stage per timer (DESIGN.md).

    gen + reward (+ dynamic sampling over generation batches) -> old_log_prob (or bypass)
    -> ref -> values (no critic) -> adv -> update_critic (no critic) -> update_actor
    -> weight sync -> metrics -> rollout dump -> validation -> checkpoint

Data parallelism is SPMD: every rank generates and scores the same batch (the local engine is
deterministic under per-sample seeds), and the actor splits rows over DP ranks. Only rank 0
writes logs, dumps and the trainer state.

With algorithm.filter_groups.streaming a generation batch stops as soon as the step's informative groups
are complete; the cut groups' prompts go back to the sampler's front (trainer/dynamic_sampling.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from megatron_dapo.config import Config, resolve_rollout_correction
from megatron_dapo.metrics import (
    MoELoadBalanceAccumulator,
    StageTimer,
    compute_data_metrics,
    compute_overlong_metrics,
    compute_spec_decode_metrics,
    compute_throughout_metrics,
    compute_timing_metrics,
    compute_variance_proxy_metrics,
    reward_extra_metrics,
)
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.ragged import share_kept_rows
from megatron_dapo.trainer import checkpoint as ckpt
from megatron_dapo.trainer import faults, stages
from megatron_dapo.trainer.dynamic_sampling import GroupBuffer, StopWhenFull, finished_groups
from megatron_dapo.trainer.mismatch import MismatchAlarm
from megatron_dapo.trainer.preemption import Preempted, PreemptionWatch
from megatron_dapo.trainer.replay import provide_rollout_routing
from megatron_dapo.trainer.validate import validate
from megatron_dapo.workers import memory
from megatron_dapo.workers.batch import select_record

if TYPE_CHECKING:  # annotations only: importing these here would load Megatron for every trainer import
    from megatron_dapo.data.dataset import PromptDataset
    from megatron_dapo.data.sampler import ResumableSampler
    from megatron_dapo.data.tokenizer import Tokenizer
    from megatron_dapo.metrics.logger import MetricsLogger
    from megatron_dapo.parallel import ParallelGroups
    from megatron_dapo.rewards.manager import RewardManager
    from megatron_dapo.rollout.base import RolloutEngine
    from megatron_dapo.workers.actor import Actor, PolicyModel

log = logging.getLogger(__name__)


class KLController(Protocol):
    """algos.kl.FixedKLController / AdaptiveKLController."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...


@dataclass
class TrainerParts:
    """Everything `fit` drives, built by `trainer/run.py` (or by a test with its own parts)."""

    actor: Actor
    engine: RolloutEngine
    tokenizer: Tokenizer
    reward_manager: RewardManager
    train_data: PromptDataset
    val_data: PromptDataset | None
    sampler: ResumableSampler
    logger: MetricsLogger | None  # None on ranks > 0
    pgs: ParallelGroups
    reference: PolicyModel | None = None  # built only when a KL term is used
    adv_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None  # algos.advantage registry entry
    kl_ctrl: KLController | None = None
    sync_weights: Callable[[int], dict | None] | None = None  # sync_weights(policy_version): actor -> engine


def old_log_prob_from_update(cfg: Config, rc: dict, actor) -> bool:
    """Whether old_log_prob comes from the update's own forward (`actor.old_log_prob_from_update`): only
    when that forward sees the very weights a separate pass would, and nothing needs old before the
    update (rollout correction, KL in the reward, router replay, MoE routing counts)."""
    a = cfg.actor
    return (a.old_log_prob_from_update and a.ppo_epochs == 1 and a.ppo_mini_batch_size == cfg.data.train_batch_size
            and not rc["bypass_mode"] and not rc["rollout_is"] and not rc["rollout_rs"]
            and not cfg.algorithm.use_kl_in_reward and a.router_replay == "off" and not actor.policy.is_moe)


class DAPOTrainer:
    def __init__(self, cfg: Config, parts: TrainerParts):
        self.cfg, self.p = cfg, parts
        self.rc = resolve_rollout_correction(cfg)
        self.global_step = 0
        self.is_rank0 = parts.pgs.rank == 0
        fg = cfg.algorithm.filter_groups
        self.buffer = GroupBuffer(enable=fg.enable, metric=fg.metric, max_num_gen_batches=fg.max_num_gen_batches,
                                  on_exhausted=fg.on_exhausted, train_batch_size=cfg.data.train_batch_size,
                                  n=cfg.rollout.n, ppo_mini_batch_size=cfg.actor.ppo_mini_batch_size,
                                  pad_id=parts.tokenizer.pad_id)
        self.loss_history: list[tuple[int, float]] = []
        self._saved_step: int | None = None  # the step of the checkpoint this process last wrote or read
        self._pending_save: ckpt.PendingSave | None = None  # trainer.async_save: shards still being written
        self._inflight_parts = 0  # the kept-group parts of the step in progress already on disk (_save_inflight)
        self.mismatch_alarm = MismatchAlarm(cfg.rollout.mismatch_alarm, is_rank0=self.is_rank0)
        # actor -> engine, with the policy version (default: a colocated engine sharing the weights)
        self.sync_weights = parts.sync_weights or (lambda v: parts.engine.update_weights(None, policy_version=v))
        self.last_val: dict[str, float] = {}
        self.first_val: tuple[int, dict[str, float]] | None = None  # (step, metrics) of this process's first validation
        self.old_from_update = old_log_prob_from_update(cfg, self.rc, parts.actor)
        # The planner's peak = max(training, rollout) holds only if colocated servers release their memory
        # between generation and the update; the weight push (rollout/sglang/build.py) takes it back.
        self.colocated_servers = cfg.rollout.engine == "sglang" and cfg.rollout.mode == "colocate"

    # ---------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Train to trainer.total_training_steps (or trainer.total_epochs); raises Preempted after a checkpoint when a stop signal
        came (trainer/preemption.py)."""
        self.watch = PreemptionWatch(self.cfg.trainer.exit_signals, group=self.p.pgs.ctrl,
                                     world_size=self.p.pgs.world_size, on_signal=self._cut_generation)
        try:
            out = self._fit()
            self._finish_save()
            return out
        finally:
            if self._pending_save is not None:  # failed or interrupted: the torn directory stays for the next start
                self._pending_save.abandon()
            self.watch.close()

    def _stop_if_signalled(self, *, saved: bool) -> None:
        """A safe point (trainer/preemption.py): when a rank got a stop signal, make sure a checkpoint of
        the step reached exists (unless `saved`, or before the first step) and raise Preempted."""
        name = self.watch.requested()
        if name is None:
            return
        if not saved and self.global_step > 0 and self._saved_step != self.global_step:
            self._save()
        self._finish_save()
        raise Preempted(name, self.global_step)

    def _cut_generation(self) -> None:
        """On the first stop signal (its own thread): abort the generation in flight, so the batch returns at
        once and `_collect` keeps its complete groups (trainer/preemption.py). Only where the abort cannot
        split the ranks: an engine rank 0 drives (SGLang servers), or a single process; the local engine
        of a multi-process run decodes in lockstep with its peers and finishes its (short) batch."""
        from megatron_dapo.rollout.rank0 import RankZeroEngine

        if self.p.pgs.world_size == 1 or (isinstance(self.p.engine, RankZeroEngine) and self.is_rank0):
            log.warning("stop signal: the generation in flight is aborted; its complete groups are kept")
            self.p.engine.abort()

    def _fit(self) -> dict[str, float]:
        cfg = self.cfg
        self._resume()
        self.start_step = self.global_step  # where this process began (the checkpoint's step, or 0)
        if cfg.trainer.val_before_train and self.global_step == 0 and self._val_enabled():
            self._log(self._validate(), step=0)
        while not self._done():
            step = self.global_step + 1
            timer, t0 = StageTimer(), time.perf_counter()
            batch, metrics = self._collect(step, timer)  # gen + reward + dynamic sampling
            if self.colocated_servers:  # SGLang on the trainer's GPUs: free its weights and KV cache
                self.p.engine.release_memory()
                memory.reclaim_for_training(self.p.actor.offload)  # the optimizer back (actor.offload_optimizer)
            if batch is not None:
                metrics.update(self._train_on(batch, step, timer))
            with timer("weight_sync"):
                metrics.update(self.sync_weights(step) or {})  # rollout.speculative.auto reports here
            self.global_step = step
            timings = {**timer.timings_s, "step": time.perf_counter() - t0}
            if batch is not None:
                metrics.update(self._perf_metrics(batch, timings))
                self._dump(batch, step)
            last = self._done()
            if self._val_enabled() and (step % cfg.trainer.test_freq == 0 or last):
                metrics.update(self._validate())
            self._log(metrics, step)
            self._finish_save(block=False)  # an asynchronous save whose writers are done completes here
            saved = cfg.trainer.save_freq > 0 and (step % cfg.trainer.save_freq == 0) or last
            if saved:
                self._save()
            if not last:
                self._stop_if_signalled(saved=saved)
        return self.last_val

    def _done(self) -> bool:
        """Training is over: trainer.total_training_steps ran, or the sampler has drawn every prompt of
        trainer.total_epochs epochs (a step in progress then completes; dynamic sampling may draw its last
        prompts from the next epoch's order)."""
        cfg, sampler = self.cfg, self.p.sampler
        if self.global_step >= cfg.trainer.total_training_steps:
            return True
        if sampler.epoch >= cfg.trainer.total_epochs and not sampler.front:
            if not getattr(self, "_told_epochs", False) and self.is_rank0:
                log.info("trainer.total_epochs=%d reached at step %d: training ends", cfg.trainer.total_epochs,
                         self.global_step)
            self._told_epochs = True
            return True
        return False

    # -- gen + reward + dynamic sampling -----------------------------------------------------------
    def _collect(self, step: int, timer):
        cfg, p = self.cfg, self.p
        sampling = lambda k: SamplingParams(  # noqa: E731
            max_new_tokens=cfg.data.max_response_length, n=cfg.rollout.n, temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, stop_token_ids=(p.tokenizer.eos_id,),
            min_new_tokens=cfg.rollout.min_new_tokens,
            seed=cfg.trainer.seed * 1_000_003 + step * 1009 + k)
        while True:
            if self.buffer.num_parts and self.buffer.ready():  # resumed with the step's groups already kept
                break
            k = self.buffer.num_gen_batches
            drawn = p.sampler.next_batch()
            records = [p.train_data[i] for i in drawn]
            stop = self._streaming_callback(records, f"{step}.{k}")
            with timer("gen"):
                rollout = stages.generate(p.engine, records, sampling(k), group_suffix=f"{step}.{k}",
                                          pad_id=p.tokenizer.pad_id, max_response_length=cfg.data.max_response_length,
                                          expect_policy_version=self.global_step, on_groups_done=stop)
            faults.maybe_crash("generation", step)
            generated, cut = int(rollout.response_length.sum()), 0
            stopping = self.watch.requested() is not None  # every rank: a stop signal cut this batch
            if stopping and not cfg.algorithm.filter_groups.enable:  # nothing kept: the batch is drawn again
                p.sampler.push_front(drawn)
                rollout, records = None, []
            elif cfg.algorithm.filter_groups.streaming or stopping:  # cut groups leave the batch; their prompts
                # go back to the sampler
                rollout, records, cut = self._keep_finished(rollout, records, drawn)
            scored = None
            if records:
                with timer("reward"):
                    if stop is None:
                        scored = stages.score(rollout, records, n=cfg.rollout.n, tokenizer=p.tokenizer,
                                              reward_manager=p.reward_manager, group=p.pgs.ctrl)
                    else:  # the callback's scores, once per group (stages.score_streamed)
                        scored = stages.score_streamed(rollout, records, stop.scored, n=cfg.rollout.n,
                                                       tokenizer=p.tokenizer, reward_manager=p.reward_manager,
                                                       group=p.pgs.ctrl)
            faults.maybe_crash("after_reward", step)
            if scored is not None or not stopping:
                self.buffer.add(scored, generated_tokens=generated, cut_groups=cut)
            if stopping:  # the kept groups on disk, then the checkpoint and the stop (trainer/preemption.py)
                self._save_inflight(step)
                self._stop_if_signalled(saved=False)
            if self.buffer.ready() or not self.buffer.check_budget():
                break
            self._save_inflight(step)  # a crash from here on resumes without regenerating these groups
            self._stop_if_signalled(saved=False)
        batch, metrics = self.buffer.take()
        if batch is not None:  # the kept rows, every one on every rank, the training batch (ragged.to_training)
            batch = dataclasses.replace(batch, rollout=share_kept_rows(batch.rollout, group=p.pgs.ctrl))
        ckpt.clear_inflight(self.cfg.ckpt_dir) if self.is_rank0 else None
        self._inflight_parts = 0
        return batch, metrics

    def _streaming_callback(self, records, group_suffix: str) -> StopWhenFull | None:
        """The engine's callback for one generation batch, or None: with streaming dynamic sampling, the
        stop once the groups the step still needs are in; on SGLang servers without it, scoring each group
        on rank 0 as it completes (the servers generate the rest meanwhile), which never stops the batch."""
        cfg, p = self.cfg, self.p
        scorer = stages.group_scorer(records, group_suffix=group_suffix, n=cfg.rollout.n, tokenizer=p.tokenizer,
                                     reward_manager=p.reward_manager)
        fg = cfg.algorithm.filter_groups
        # R3: routing of dropped groups and of those past the ones the step takes is released when scored
        drops = dict(drops_constant=fg.enable, keep=self.buffer.needed if fg.enable else None,
                     positions={stages.group_id(r, group_suffix): i for i, r in enumerate(records)}
                     if fg.enable else None)
        if fg.streaming:
            return StopWhenFull(need=self.buffer.needed, metric=fg.metric, score_groups=scorer, **drops)
        if cfg.rollout.engine == "sglang":
            return StopWhenFull.scoring_only(metric=fg.metric, score_groups=scorer, **drops)
        return None

    def _keep_finished(self, rollout, records, drawn: list[int]):
        """The complete groups' rows and records, and how many were cut; the cut prompts go back to the front
        of the sampler (in their order), so they are drawn next and neither lost nor trained twice."""
        n = self.cfg.rollout.n
        complete, cut = finished_groups(rollout, n)
        self.p.sampler.push_front([drawn[g] for g in cut])
        if cut:
            rows = [g * n + j for g in complete for j in range(n)]
            rollout, records = select_record(rollout, rows), [records[g] for g in complete]
        return rollout, records, len(cut)

    # -- old_log_prob, ref, adv, update --------------------------------------------------------------
    def _train_on(self, batch, step: int, timer) -> dict[str, float]:
        cfg, p = self.cfg, self.p
        rb = batch.rollout
        mask = stages.loss_mask(batch, overlong_filter=cfg.reward.overlong_filter,
                                max_response_length=cfg.data.max_response_length)
        metrics: dict[str, float] = {}
        sum_sq = None
        with timer("old_log_prob"):
            if cfg.actor.router_replay == "r3":  # the engine's routing, to the ranks that train each row
                metrics.update(provide_rollout_routing(
                    rb, [p.actor.policy] + ([p.reference] if p.reference is not None else []), pgs=p.pgs))
            if self.rc["bypass_mode"]:
                old = rb.rollout_log_probs
            elif self.old_from_update:
                old = None  # the update's own forward provides it (actor.old_log_prob_from_update)
            else:
                lp = p.actor.compute_log_prob(rb.prompt_ids, rb.prompt_length, rb.responses, rb.response_length,
                                              with_sum_sq=True)
                old, sum_sq = lp.log_probs, lp.sum_sq_probs
                metrics.update(stages.log_prob_mismatch(old, rb.rollout_log_probs, mask))
                self._check_mismatch(step, metrics, old, batch, mask)
                if p.actor.policy.last_replay_metrics:  # r3: the old_log_prob pass replayed the rollout's routing
                    metrics["router_replay/rollout_mismatch_frac"] = float(
                        p.actor.policy.last_replay_metrics["router_replay/mismatch_frac"])
                if lp.routed_counts is not None:
                    MoELoadBalanceAccumulator.from_counts(lp.routed_counts).add_to_metrics(metrics)
        faults.maybe_crash("after_old_log_prob", step)
        metrics.update(self._train_from_old(batch, mask, old, sum_sq, step, timer, rc=self.rc))
        return metrics

    def _train_from_old(self, batch, mask, old, sum_sq, step: int, timer, *, rc: dict) -> dict[str, float]:
        """Everything after old_log_prob: rollout correction, ref, values, adv, update_critic, update_actor
        (shared by the sync and the queue trainer)."""
        cfg, p = self.cfg, self.p
        rb = batch.rollout
        metrics: dict[str, float] = {}
        is_weights = None
        if not rc["bypass_mode"] and (rc["rollout_is"] or rc["rollout_rs"]):
            is_weights, mask, rc_metrics = stages.rollout_correction(old, rb.rollout_log_probs, mask, rc)
            metrics.update(rc_metrics)
        ref = None
        with timer("ref"):
            if p.reference is not None:
                ref = p.reference.compute_log_prob(rb.prompt_ids, rb.prompt_length, rb.responses,
                                                   rb.response_length).log_probs
        with timer("values"):
            pass  # no critic: GRPO-family estimators need no values
        with timer("adv"):
            kl_in_reward = ({"kl_penalty": cfg.algorithm.kl_penalty, "controller": p.kl_ctrl}
                            if cfg.algorithm.use_kl_in_reward else None)
            adv = stages.compute_advantages(
                batch, mask, adv_fn=p.adv_fn, estimator=cfg.algorithm.adv_estimator,
                norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo, gamma=cfg.algorithm.gamma,
                lam=cfg.algorithm.lam, kl_in_reward=kl_in_reward, old_log_probs=old, ref_log_probs=ref)
            metrics.update(adv.metrics)
        with timer("update_critic"):
            pass  # no critic
        if cfg.trainer.critic_warmup <= step:  # the current step, as verl compares
            pb = stages.policy_batch(batch, mask=mask, old_log_probs=old, advantages=adv.advantages,
                                     ref_log_probs=ref if cfg.actor.use_kl_loss else None, is_weights=is_weights)
            with timer("update_actor"):
                if old is None:
                    actor_metrics, lp = p.actor.update_policy_on_policy(pb, with_sum_sq=True)
                    old, sum_sq = lp.log_probs, lp.sum_sq_probs
                    actor_metrics.update(stages.log_prob_mismatch(old, rb.rollout_log_probs, mask))
                    self._check_mismatch(step, actor_metrics, old, batch, mask)
                else:
                    actor_metrics = p.actor.update_policy(pb)
            faults.maybe_crash("after_update_actor", step)
            metrics.update(actor_metrics)
            self.loss_history.append((step, actor_metrics["actor/pg_loss"]))
            if sum_sq is not None:
                metrics.update(compute_variance_proxy_metrics(
                    old_log_probs=old, sum_sq_probs=sum_sq, response_mask=mask, advantages=adv.advantages,
                    is_weights=is_weights, grad_norm=actor_metrics.get("actor/grad_norm")))
        metrics.update(compute_data_metrics(
            scores=batch.scores, rewards=batch.rewards, advantages=adv.advantages, returns=adv.returns,
            response_mask=mask, response_length=rb.response_length, prompt_length=rb.prompt_length,
            max_response_length=cfg.data.max_response_length, aborted=rb.aborted,
            max_prompt_length=cfg.data.max_prompt_length))
        if cfg.reward.overlong_buffer.log:
            metrics.update(compute_overlong_metrics(overlong_reward=batch.extra["overlong_reward"],
                                                    overlong=batch.extra["overlong"], aborted=rb.aborted))
        metrics["critic/acc/mean"] = float(torch.tensor([float(a) for a in batch.extra["acc"]]).mean())
        metrics["reward/num_errors"] = float(sum(bool(e) for e in batch.extra.get("error", [])))
        metrics.update(reward_extra_metrics(batch.extra.get("reward_extra")))
        metrics.update(compute_spec_decode_metrics(rb.meta))
        return metrics

    def _check_mismatch(self, step: int, metrics: dict[str, float], old, batch, mask) -> None:
        """rollout.mismatch_alarm on this step's contract metrics (trainer/mismatch.py)."""
        self.mismatch_alarm.check(step, metrics, actor_log_probs=old, engine_log_probs=batch.rollout.rollout_log_probs,
                                  mask=mask, data_sources=batch.extra.get("data_source"))

    def _perf_metrics(self, batch, timings: dict[str, float]) -> dict[str, float]:
        rb = batch.rollout
        n_prompt, n_resp = int(rb.prompt_length.sum()), int(rb.response_length.sum())
        out = compute_timing_metrics(timings_s=timings, num_prompt_tokens=n_prompt, num_response_tokens=n_resp)
        out.update(compute_throughout_metrics(total_num_tokens=n_prompt + n_resp, time_per_step_s=timings["step"],
                                              num_devices=self.p.pgs.world_size))
        return out

    # -- validation, logging, dumps ----------------------------------------------------------------
    def _val_enabled(self) -> bool:
        return self.cfg.trainer.test_freq > 0 and self.p.val_data is not None

    def _validate(self) -> dict[str, float]:
        self.last_val = validate(self.p.engine, self.p.val_data, self.cfg, tokenizer=self.p.tokenizer,
                                 reward_manager=self.p.reward_manager, seed=self.cfg.trainer.seed + self.global_step,
                                 group=self.p.pgs.ctrl, expect_policy_version=self.global_step)
        if self.first_val is None:
            self.first_val = (self.global_step, self.last_val)
        return self.last_val

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.p.logger is not None:
            self.p.logger.log(metrics, step=step)

    def _dump(self, batch, step: int, *, min_versions: torch.Tensor | None = None) -> None:
        """The step's trained rows as trainer.rollout_data_dir/step_<k>.jsonl (rank 0). min_versions [B]: the
        oldest weights that made a token of each row, when the rows may span versions (the queue trainer)."""
        out_dir = self.cfg.trainer.rollout_data_dir
        if not out_dir or not self.is_rank0:
            return
        os.makedirs(out_dir, exist_ok=True)
        rb, extra = batch.rollout, batch.extra.get("reward_extra")
        with open(os.path.join(out_dir, f"step_{step}.jsonl"), "w") as f:
            for i in range(len(batch)):
                f.write(json.dumps({
                    "step": step, "prompt_uid": batch.extra["uid"][i], "group": rb.index[i],
                    "sample_index": int(rb.sample_index[i]), "prompt": batch.raw_prompt[i],
                    "response": batch.response_text[i], "ground_truth": batch.ground_truth[i],
                    "score": float(batch.scores[i]), "reward": float(batch.rewards[i]),
                    "acc": bool(batch.extra["acc"][i]), "finish_reason": rb.finish_reason[i],
                    "policy_version": int(rb.policy_version[i]),
                    **({} if min_versions is None else {"min_policy_version": int(min_versions[i])}),
                    **({"reward_extra": extra[i]} if extra and extra[i] else {})}, default=str) + "\n")

    # -- checkpoints -------------------------------------------------------------------------------
    def _trainer_state(self) -> dict:
        return {"global_step": self.global_step, "sampler": self.p.sampler.state_dict(),
                "scheduler": self.p.actor.scheduler.state_dict(),
                "kl_coef": float(self.p.kl_ctrl.value) if self.p.kl_ctrl is not None else 0.0,
                "torch_rng": torch.get_rng_state(), "loss_history": [list(x) for x in self.loss_history],
                "optimizer_stepped": ckpt.optimizer_has_state(self.p.actor.optimizer)}

    def _save(self) -> None:
        """A checkpoint of the step reached; with trainer.async_save its shards are written in the background
        (a save still in flight completes first)."""
        self._finish_save()
        self._saved_step = self.global_step
        out = ckpt.save_checkpoint(self.cfg.ckpt_dir, self.global_step, actor=self.p.actor,
                                   trainer_state=self._trainer_state(), keep=self.cfg.trainer.max_ckpt_to_keep,
                                   is_rank0=self.is_rank0, background=self.cfg.trainer.async_save)
        if isinstance(out, ckpt.PendingSave):
            self._pending_save = out

    def _finish_save(self, *, block: bool = True) -> None:
        """Complete the asynchronous save in flight: at once (block), or only if every rank's writer is done
        (a collective either way)."""
        pending = self._pending_save
        if pending is None or not (block or pending.done()):
            return
        self._pending_save = None
        pending.finish()

    def _save_inflight(self, step: int) -> None:
        """The step's kept groups so far: only the generation batches not written yet, then the counters."""
        if self.is_rank0:
            first = self._inflight_parts
            ckpt.save_inflight(self.cfg.ckpt_dir, {"step": step, "buffer": self.buffer.counters(),
                                                   "sampler": self.p.sampler.state_dict()},
                               self.buffer.parts(first), first=first)
        self._inflight_parts = self.buffer.num_parts

    def _resume(self) -> None:
        """Restore the latest (or the named) checkpoint, then push the actor's weights to the engine:
        always, resumed or not, since servers may hold another run's weights (and a fresh server
        reports no version the per-row check could compare against)."""
        self._restore()
        self.sync_weights(self.global_step)

    def _restore(self) -> None:
        mode, root = self.cfg.trainer.resume_mode, self.cfg.ckpt_dir
        if self.is_rank0:
            ckpt.remove_torn(root)
        if mode == "disable":
            return
        path = None
        if mode == "auto":  # the newest checkpoint that verifies against its manifest, whatever `latest` says
            path = ckpt.newest_verified(root)
        else:
            path = mode
            if not os.path.isdir(path):
                raise FileNotFoundError(f"trainer.resume_mode={mode!r}: no such checkpoint directory")
            problem = ckpt.verify_checkpoint(path)
            if problem not in (None, "no manifest"):
                raise ckpt.CheckpointCorrupt(f"trainer.resume_mode={mode!r}: {problem}")
        if path is not None:
            state = ckpt.load_checkpoint(path, actor=self.p.actor)
            self.global_step = self._saved_step = int(state["global_step"])
            self.p.sampler.load_state_dict(state["sampler"])
            self.p.actor.scheduler.load_state_dict(state["scheduler"])
            self.p.actor.scheduler.step(0)  # its LR into the optimizer (a checkpoint before any step has no optimizer state)
            if self.p.kl_ctrl is not None:
                self.p.kl_ctrl.value = float(state["kl_coef"])
            torch.set_rng_state(state["torch_rng"])
            self.loss_history = [(int(s), float(v)) for s, v in state["loss_history"]]
            log.info("resumed from %s at step %d", path, self.global_step)
        inflight = ckpt.load_inflight(root) if os.path.isdir(root) else None
        if inflight is not None and int(inflight[0]["step"]) == self.global_step + 1:
            state, parts = inflight
            self.buffer.load_state_dict({**state["buffer"], "kept": parts})
            self.p.sampler.load_state_dict(state["sampler"])
            self._inflight_parts = len(parts)
            log.info("restored %d kept groups of step %d from %s", self.buffer.num_prompts, self.global_step + 1,
                     ckpt.INFLIGHT)
