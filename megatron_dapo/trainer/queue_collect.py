"""The queue trainer's collection on global rank 0 (queue_trainer.py's module docstring): the finished,
scored groups of the queue, dynamic sampling over them, the staleness check, and the train groups' batch
read back from the queue. `QueueCollection` is a part of `QueueTrainer` (a mixin: it reads the trainer's
queue, config, parts and pools); it runs inside `QueueTrainer._rank0`, on rank 0 only.

Shape legend: B rows (n per prompt, prompt-major).
"""

from __future__ import annotations

import logging
import time

import torch

from megatron_dapo.algos.dynamic_sampling import select_informative_groups
from megatron_dapo.queue import QueueKeyError, spool, trajectory_key
from megatron_dapo.rollout.base import PromptInput, ragged_batch
from megatron_dapo.trainer import stages
from megatron_dapo.trainer.batch import ScoredBatch
from megatron_dapo.trainer.dynamic_sampling import DynamicSamplingExhausted
from megatron_dapo.trainer.producer import TRAIN_PARTITION, prompt_key, reissue_claims

log = logging.getLogger(__name__)

TRAIN = TRAIN_PARTITION
STATE = "trainer"  # one entry, "sampler": the sampler position after the last issued generation batch
SWEEP_GRACE_S = 600.0  # R3 routing files: a claim's transaction commits well within this after its files
TRAJ_FIELDS = ("prompts", "responses", "rollout_log_probs", "finish_reason", "min_policy_version",
               "max_policy_version", "meta", "rm_scores", "rewards", "response_text")


class QueueCollection:
    """Rank 0's side of a local update (module docstring)."""

    def _collect(self, step: int, timer, *, first: bool) -> tuple[list[str], dict[str, float]]:
        """Train groups for one local update. Sync mode generates the data of the whole step at its
        first local update; the budget is max_num_gen_batches generation batches per local update."""
        fg = self.cfg.algorithm.filter_groups
        updates = self.P if self.sync_mode and first else 1
        need, examined, kept0, filtered0 = updates * self.tbs, 0, len(self._pool), len(self._filtered)
        stale0 = self._stale_dropped
        exhausted = False
        while True:
            self._check_staleness(step)
            if len(self._pool) >= need or (self.sync_mode and not first):
                break
            if fg.enable and fg.max_num_gen_batches > 0 and examined >= fg.max_num_gen_batches * self.gbs * updates:
                if fg.on_exhausted == "raise":
                    raise DynamicSamplingExhausted(
                        f"dynamic sampling kept {len(self._pool)} of the {need} prompts needed after {examined} "
                        f"generated prompts (algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches}); "
                        f"too many groups have a constant '{fg.metric}'. Check the data and reward, raise "
                        f"max_num_gen_batches, or set algorithm.filter_groups.on_exhausted=train_on_available")
                exhausted = True
                break
            new = self._generate(step, timer)
            self._classify(new)
            examined += len(new)
        take = min(self.tbs, len(self._pool))
        if exhausted or take < self.tbs:
            mini = self.cfg.actor.ppo_mini_batch_size
            take = take // mini * mini
        keys = [k for k, _ in self._pool[:take]]
        del self._pool[:take]
        metrics = {"train/num_gen_batches": examined / self.gbs,
                   "train/num_kept_prompts": float(len(self._pool) + take - kept0),
                   "train/num_dropped_groups": float(len(self._filtered) - filtered0),
                   "train/num_train_prompts": float(take)}
        if not self.sync_mode:
            metrics["staleness/regenerated_groups"] = float(self._stale_dropped - stale0)
        return keys, metrics

    def _generate(self, step: int, timer) -> list[str]:
        """gen: prompts whose groups became done, scored. Sync: issue one generation batch, generate it here
        (one engine call, as the sync trainer makes) and score it (timed as reward); async: keep the
        producers fed (they score each claim beside generation) and wait for finished groups."""
        if self.sync_mode:
            with timer("gen"):
                keys = self._issue(step)
                claim = self.producer.generate_claim(len(keys))
            with timer("reward"):
                self.producer.write_claim(claim)
            return keys
        with timer("gen"):
            return self._wait_for_groups(step)

    def _wait_for_groups(self, step: int) -> list[str]:
        while True:
            self._top_up(step)
            if self.producers is not None:
                self.producers.check()
            else:
                self._check_producers()
            new = [k for k in self.queue.list_keys(TRAIN, is_prompt=True, status="done") if k not in self._seen]
            if new:
                return new
            time.sleep(0.02)

    def _issue(self, step: int) -> list[str]:
        """Put the sampler's next generation batch as pending prompts, with the sampler position, atomically."""
        p = self.p
        k = self._last_issue[1] + 1 if self._last_issue and self._last_issue[0] == step else 0
        records = [p.train_data[i] for i in p.sampler.next_batch()]
        keys = [prompt_key(r.uid, step, k) for r in records]
        seed = self.cfg.trainer.seed * 1_000_003 + step * 1009 + k  # the sync trainer's generation seed
        fields = {"prompts": [list(r.prompt_ids) for r in records], "raw_prompt": [r.raw_prompt for r in records],
                  "ground_truth": [r.ground_truth for r in records], "data_source": [r.data_source for r in records],
                  "uid": [r.uid for r in records], "seed": [seed] * len(records)}
        if self._row_info:  # a custom reward function reads each row's extra_info
            fields["extra_info"] = [dict(r.extra_info) for r in records]
        with self.queue.transaction():
            self.queue.put(TRAIN, keys, fields, {"global_steps": step})
            self._write_sampler_record(last_issue=(step, k))
        self._last_issue = (step, k)
        return keys

    def _write_sampler_record(self, *, last_issue) -> None:
        self.queue.put(STATE, ["sampler"], {"state": [self.p.sampler.state_dict()],
                                            "last_issue": [list(last_issue) if last_issue else None]}, overwrite=True)

    def _top_up(self, step: int) -> None:
        """Async: issue generation batches while fewer than (max_staleness + 1) * parameter_sync_step
        batches' worth of prompts are issued and not yet consumed."""
        window = (self.cfg.queue.max_staleness + 1) * self.P * self.gbs
        live = self.queue.count(TRAIN, is_prompt=True, status=("pending", "running", "done")) - len(self._filtered)
        while live + self.gbs <= window:
            live += len(self._issue(step))

    def _check_producers(self) -> None:
        for i, code in self.pool.dead():
            keys = reissue_claims(self.queue, self.pool.claim_prefix(i), global_steps=self.global_step)
            log.warning("producer %d died (exit code %s); reissued its %d running prompts", i, code, len(keys))
            self.pool.restart(i, code)

    def _classify(self, keys: list[str]) -> None:
        """Dynamic sampling per group: informative groups join the pool, constant ones are filtered."""
        if not keys:
            return
        fg, tkeys = self.cfg.algorithm.filter_groups, self._traj_keys(keys)
        metric = "rewards" if fg.metric in ("seq_reward", "seq_final_reward") else fg.metric
        f = self.queue.get(TRAIN, tkeys, [metric, "min_policy_version"])
        index = [k for k in keys for _ in range(self.n)]
        kept = set(select_informative_groups(index, f[metric])) if fg.enable else set(keys)
        dropped = [k for k in keys if k not in kept]
        if dropped and self.r3:  # a filtered group is never trained: its routing need not stay on disk
            self._drop_routing(dropped)
        for i, k in enumerate(keys):
            self._seen.add(k)
            if k in kept:
                self._pool.append((k, min(f["min_policy_version"][i * self.n:(i + 1) * self.n])))
            else:
                self._filtered.append(k)

    def _check_staleness(self, step: int) -> None:
        """Groups whose oldest token is more than max_staleness syncs old: regenerate (drop) or keep (correct)."""
        if self.sync_mode or self.cfg.queue.stale_policy == "correct":
            return
        oldest = self.policy_version - self.cfg.queue.max_staleness * self.P
        stale = [k for k, v in self._pool if v < oldest]  # v: the oldest version that produced a token
        if stale:
            if self.r3:
                self._drop_routing(stale)
            with self.queue.transaction():
                self.queue.delete_trajectories(TRAIN, stale)
                self.queue.update_tags(TRAIN, stale, status="pending", global_steps=step)
            self._pool = [(k, v) for k, v in self._pool if v >= oldest]
            self._seen.difference_update(stale)
            self._stale_dropped += len(stale)
            log.info("step %d: %d stale groups (policy version < %d) sent back for regeneration", step, len(stale),
                     oldest)

    def _traj_keys(self, keys: list[str]) -> list[str]:
        return [trajectory_key(k, j) for k in keys for j in range(self.n)]

    def _drop_routing(self, keys: list[str]) -> None:
        """R3: the routing files of these groups' rows are removed (a row's is ~2.5 MB at the MoE recipe) and
        their references cleared; the rest of each row stays."""
        tkeys = self._traj_keys(keys)
        spool.drop(spool.spool_dir(self.queue.path), self._routing_refs(tkeys))
        self.queue.put_fields(TRAIN, tkeys, {"routed_experts": [None] * len(tkeys)})

    def _routing_refs(self, tkeys: list[str]) -> list[dict | None]:
        """The spool references of these trajectories' routing (None where a row has none, or was written
        without the field: a run resumed with actor.router_replay changed)."""
        try:
            return self.queue.get(TRAIN, tkeys, ["routed_experts"])["routed_experts"]
        except QueueKeyError:
            out = []
            for k in tkeys:
                try:
                    out += self.queue.get(TRAIN, [k], ["routed_experts"])["routed_experts"]
                except QueueKeyError:
                    out.append(None)
            return out

    def _sweep_routing(self, *, producers_running: bool) -> None:
        """R3: remove the routing files no trajectory of the queue references (queue/spool.py); while producers
        run, only those older than SWEEP_GRACE_S (a claim's files are written before its transaction)."""
        live = self._routing_refs(self.queue.list_keys(TRAIN, is_prompt=False))
        removed = spool.sweep(spool.spool_dir(self.queue.path), live,
                              min_age_s=SWEEP_GRACE_S if producers_running else 0.0)
        if removed:
            log.info("removed %d routing files no queued row references", removed)

    # -- the train groups' batch, from the queue ----------------------------------------------------
    def _load_batch(self, keys: list[str]) -> tuple[ScoredBatch, torch.Tensor]:
        """The train groups as a ScoredBatch, and the oldest policy version of each row [B]. With R3 the rows'
        routing too (the producers wrote it with each claim): rank 0 holds one training batch's routing."""
        tkeys = self._traj_keys(keys)
        pf = self.queue.get(TRAIN, keys, ["raw_prompt", "ground_truth", "uid", "reward_keys"])
        reward_keys = pf["reward_keys"][0]  # the same reward manager scored every group
        f = self.queue.get(TRAIN, tkeys, [*TRAJ_FIELDS, *reward_keys])
        # Ragged from the stored tensors: real tokens only, no Python lists, nothing padded to max_response_length.
        prompts = [PromptInput(k, tuple(f["prompts"][g * self.n].tolist())) for g, k in enumerate(keys)]
        rollout = ragged_batch(prompts, self.n, f["responses"], f["rollout_log_probs"], finish_reason=f["finish_reason"],
                               policy_version=f["max_policy_version"], meta=f["meta"],
                               routed_experts=self._read_routing(tkeys) if self.r3 else [None] * len(tkeys),
                               pad_id=self.p.tokenizer.pad_id,
                               max_response_length=self.cfg.data.max_response_length)
        rep = lambda xs: [x for x in xs for _ in range(self.n)]  # noqa: E731
        extra = {name: f[name] for name in reward_keys}
        extra["uid"] = rep(pf["uid"])
        batch = ScoredBatch(rollout=rollout, raw_prompt=rep(pf["raw_prompt"]), response_text=f["response_text"],
                            ground_truth=rep(pf["ground_truth"]),
                            scores=torch.tensor(f["rm_scores"], dtype=torch.float32),
                            rewards=torch.tensor(f["rewards"], dtype=torch.float32), extra=extra)
        min_versions = torch.tensor(f["min_policy_version"], dtype=torch.int64)
        self._check_versions(rollout, min_versions)
        return batch, min_versions

    def _read_routing(self, tkeys: list[str]) -> list[torch.Tensor | None]:
        """R3: the rows' routing, from the spool files the producers wrote: memory maps of them (read as the
        step sends each row to its ranks), or read at once where a batch has more rows than maps to spare."""
        directory, mapped = spool.spool_dir(self.queue.path), len(tkeys) <= spool.map_budget()
        return [spool.read_tensor(directory, ref, mapped=mapped) for ref in self._routing_refs(tkeys)]

    def _check_versions(self, rollout, min_versions: torch.Tensor) -> None:
        """Rows must come from weights this trainer pushed: in sync mode the last push's, in async mode one
        no newer than it (an engine that missed a push or reports a version never sent fails the step)."""
        newest, oldest = rollout.policy_version, min_versions
        if self.sync_mode:
            bad = torch.nonzero((newest != self.policy_version) | (oldest != self.policy_version)).squeeze(1)
            expected = f"policy version {self.policy_version}"
        else:
            bad = torch.nonzero((newest > self.policy_version) | (oldest > newest) | (oldest < 0)).squeeze(1)
            expected = f"versions within 0..{self.policy_version}, the oldest first"
        if len(bad):
            r = int(bad[0])
            raise stages.PolicyVersionError(
                f"rollout row {r} (group {rollout.index[r]!r}) was generated with policy versions "
                f"{int(oldest[r])}..{int(newest[r])}, expected {expected} ({len(bad)} of {len(newest)} rows "
                "differ): the engine did not receive the weight syncs")
