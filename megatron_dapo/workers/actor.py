"""The Megatron actor: per-token log-probs and the DAPO policy update.

Shape legend:
    B  rows (responses) of the batch, prompt-major   T  response width   b, S  one micro-batch
    log_probs, entropy, response_mask, advantages: [B, T]

Data parallelism is SPMD: every rank holds the whole batch, works on its DP shard of the rows and
the results are reduced across DP. The loss of every micro-batch is normalised by the *global*
token count (or sequence count) of its mini-batch, computed once from the whole mini-batch before
the micro-batch loop (STYLE.md rule 7), so the objective does not depend on how a mini-batch is
split into micro-batches or DP ranks. Megatron's schedule divides each micro-batch loss by the
number of micro-batches and DDP averages gradients over DP; `_loss_func` undoes the first and the
`dp_size` factor of `agg_loss` undoes the second.

Every actor config field reaches the loss by keyword (STYLE.md rule 2; tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_dapo.algos.kl import kl_penalty
from megatron_dapo.algos.policy_loss import agg_loss, get_policy_loss_fn
from megatron_dapo.algos.rollout_correction import compute_rollout_correction
from megatron_dapo.config.schema import ActorConfig
from megatron_dapo.models.forward import main_logits, unwrap_model
from megatron_dapo.workers.batch import PolicyBatch
from megatron_dapo.workers.logprob import logprob_entropy_from_logits
from megatron_dapo.workers.microbatch import MicroBatch, make_microbatches, scatter_rows, to_response_aligned


@dataclass(frozen=True)
class LogProbs:
    log_probs: Tensor  # [B, T] float32
    entropy: Tensor | None  # [B, T] float32
    sum_sq_probs: Tensor | None  # [B, T] float32, sum_v p_v^2 (variance proxy)
    routed_counts: Tensor | None = None  # [L, E] int64: MoE assignments of response tokens per layer/expert


def dp_shard_rows(lengths: list[int], dp_size: int, dp_rank: int, *, balance: bool) -> list[int]:
    """This DP rank's rows. balance=True deals rows longest-first in a snake order so every rank gets
    about the same number of tokens; otherwise contiguous chunks. Deterministic on every rank."""
    n = len(lengths)
    if n < dp_size:
        raise ValueError(f"{n} rows cannot be split over {dp_size} data-parallel ranks")
    if not balance:
        per = -(-n // dp_size)
        return list(range(dp_rank * per, min(n, (dp_rank + 1) * per)))
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    mine = []
    for k, i in enumerate(order):
        lap, pos = divmod(k, dp_size)
        if (pos if lap % 2 == 0 else dp_size - 1 - pos) == dp_rank:
            mine.append(i)
    return sorted(mine)


class PolicyModel:
    """A (possibly pipelined / DDP-wrapped) Megatron model that computes per-token log-probs."""

    def __init__(self, model_chunks: list, *, pgs, pad_id: int, temperature: float, max_tokens: int,
                 vocab_size: int, fused: bool = False, router_replay: bool = False):
        """fused: the training forward stops before the output layer and computes log-probs and entropy
        with `kernels.fused_logprob_entropy` (Triton on CUDA, chunked torch on CPU), never holding the
        [tokens, V/tp] logits; models with MTP layers keep the logits path."""
        self.chunks, self.pgs = model_chunks, pgs
        self.pad_id, self.temperature, self.max_tokens = pad_id, temperature, max_tokens
        self.vocab_size = vocab_size
        self.fused = fused and not unwrap_model(model_chunks[-1]).config.mtp_num_layers
        self.router_replay = router_replay
        # Router replay: per row of the last compute_log_prob batch, per MoE layer, the top-k experts of
        # each position [seq_len, K]; keyed by the batch's responses tensor so a stale record is never used.
        self._routing: dict | None = None
        # Sequence parallelism splits the sequence over TP ranks (context parallelism in 2*cp chunks).
        self.seq_multiple = pgs.tp_size * (2 * pgs.cp_size if pgs.cp_size > 1 else 1)

    # -- one micro-batch -------------------------------------------------------------------------
    def _forward(self, model, mb: MicroBatch, *, hidden: bool = False):
        """Logits [b, S, V/tp] of the main head on the last stage (MTP handled), activations elsewhere;
        hidden=True: the output layer's input [b, S(/tp under SP), H] instead of logits."""
        dev = self.pgs.device
        ids, pos = mb.input_ids.to(dev), mb.position_ids.to(dev)
        inner = unwrap_model(model)
        if hidden and inner.post_process:
            with _output_layer_bypassed(inner):
                return model(ids, pos, None)
        return main_logits(model, ids, pos, None, mb.labels.to(dev), gather=False)

    def fused_token_stats(self, hidden: Tensor, mb: MicroBatch, width: int) -> tuple[Tensor, Tensor]:
        """(log-probs, entropy) [b, T] from the output layer's input, without materialising the logits."""
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        from megatron_dapo.kernels import fused_logprob_entropy

        inner = unwrap_model(self.chunks[-1])
        if inner.config.sequence_parallel and self.pgs.tp_size > 1:
            # The kernel all-reduces d hidden over TP itself: gather with a plain split as backward.
            hidden = gather_from_sequence_parallel_region(hidden.transpose(0, 1), tensor_parallel_output_grad=False,
                                                          group=self.pgs.tp).transpose(0, 1)
        b, S, h = hidden.shape
        idx = (mb.resp_start.unsqueeze(1) + torch.arange(width).unsqueeze(0)).clamp(max=S - 1).to(hidden.device)
        hid = hidden.gather(1, idx.unsqueeze(-1).expand(b, width, h)).reshape(b * width, h)
        labels = to_response_aligned(mb.labels.to(hidden.device), mb, width).reshape(b * width)
        weight = (inner.shared_embedding_or_output_weight() if inner.share_embeddings_and_output_weights
                  else inner.output_layer.weight)
        # Labels outside this TP rank's vocabulary shard are handled inside the kernel.
        logp, ent = fused_logprob_entropy(hid, weight, labels, temperature=self.temperature,
                                          tp_group=self.pgs.tp if self.pgs.tp_size > 1 else None)
        return logp.view(b, width), ent.view(b, width)

    def _response_logits(self, output: Tensor, mb: MicroBatch, width: int) -> tuple[Tensor, Tensor]:
        """Vocab-parallel logits at the response positions [b*T, V/tp] and their labels [b*T]."""
        b, S, vp = output.shape
        idx = (mb.resp_start.unsqueeze(1) + torch.arange(width).unsqueeze(0)).clamp(max=S - 1).to(output.device)
        logits = output.gather(1, idx.unsqueeze(-1).expand(b, width, vp))
        labels = to_response_aligned(mb.labels.to(output.device), mb, width)
        return logits.reshape(b * width, vp), labels.reshape(b * width)

    def token_stats(self, output, mb, width, *, entropy: bool, sum_sq: bool):
        logits, labels = self._response_logits(output, mb, width)
        vp = logits.shape[-1]
        logp, ent, sq = logprob_entropy_from_logits(
            logits, labels, temperature=self.temperature, tp_group=self.pgs.tp,
            vocab_start=self.pgs.tp_rank * vp, compute_entropy=entropy, compute_sum_sq=sum_sq)
        b = mb.rows.numel()
        return (logp.view(b, width), None if ent is None else ent.view(b, width),
                None if sq is None else sq.view(b, width))

    # -- MoE routing counts (load-balance metrics) -------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return bool(self._routers())

    def _routers(self) -> list:
        """The decoder's MoE routers (MTP layers excluded: they are the drafter, not the policy)."""
        return [m for c in self.chunks for name, m in unwrap_model(c).named_modules()
                if type(m).__name__ == "TopKRouter" and not name.startswith("mtp.")]

    def _count_routing(self, routers: list, counts: list, current: list):
        """Forward hooks adding each router's assignments of response tokens to counts[layer].

        The router sees the micro-batch flattened sequence-first ([s, b] order; under sequence
        parallelism only this TP rank's sequence shard), so the response mask is laid out alike."""
        def make_hook(layer: int):
            def hook(module, args, output):
                routing_map = output[1]  # [tokens, E] bool
                mask = current[0]
                if mask is None or routing_map.shape[0] != mask.numel():
                    return
                counts[layer] += (routing_map.to(torch.int64) * mask.to(routing_map.device).unsqueeze(1)).sum(0).cpu()
            return hook

        return [r.register_forward_hook(make_hook(i)) for i, r in enumerate(routers)]

    def _response_token_mask(self, mb: MicroBatch) -> Tensor:
        """[s*b] int mask of response input tokens, flattened sequence-first, this rank's SP shard."""
        b, S = mb.input_ids.shape
        pos = torch.arange(S).unsqueeze(0)
        start = mb.resp_start.unsqueeze(1) + 1
        mask = ((pos >= start) & (pos < mb.seq_len.unsqueeze(1))).to(torch.int64).t()  # [S, b]
        if unwrap_model(self.chunks[0]).config.sequence_parallel and self.pgs.tp_size > 1:
            shard = S // self.pgs.tp_size
            mask = mask[self.pgs.tp_rank * shard:(self.pgs.tp_rank + 1) * shard]
        return mask.reshape(-1)

    # -- router replay ---------------------------------------------------------------------------
    def _set_replay_action(self, action: str | None) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for r in self._routers():
            if action is None:
                r.router_replay.clear_router_replay_action()
                r.router_replay.clear_indices()
            else:
                r.router_replay.set_router_replay_action(RouterReplayAction[action])

    def _collect_routing(self, mb: MicroBatch, out: dict[int, list]) -> None:
        """After a recorded forward: each router's [S*b, K] top-k (sequence-first) -> per row [seq_len, K]."""
        b, S = mb.input_ids.shape
        per_layer = [r.router_replay.get_recorded_indices().reshape(S, b, -1).cpu() for r in self._routers()]
        for k, row in enumerate(mb.rows.tolist()):
            n = int(mb.seq_len[k])
            out[row] = [idx[:n, k].clone() for idx in per_layer]

    def replay_targets(self, mb: MicroBatch, responses: Tensor) -> None:
        """Before a training forward: set every router's replay target from the recorded routing."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self._routing is None or self._routing["key"] is not responses:
            raise ValueError("actor.router_replay: no routing was recorded for this batch "
                             "(compute_log_prob must run on the same batch first)")
        b, S = mb.input_ids.shape
        for layer, r in enumerate(self._routers()):
            K = r.topk
            target = torch.arange(K).repeat(S, b, 1)  # padding positions: any K distinct experts
            for k, row in enumerate(mb.rows.tolist()):
                rec = self._routing["rows"][row][layer]
                target[: rec.shape[0], k] = rec
            r.router_replay.clear_indices()
            r.router_replay.set_target_indices(target.reshape(S * b, K).to(self.pgs.device))
            r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    # -- the schedule ----------------------------------------------------------------------------
    def run(self, microbatches: list[MicroBatch], loss_func, *, forward_only: bool, hidden: bool = False,
            before_forward=None):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            if before_forward is not None:
                before_forward(mb)
            return self._forward(model, mb, hidden=hidden), partial(loss_func, mb)

        _reset_megatron_loss_scalers()
        fb = get_forward_backward_func()
        seq = max(int(mb.input_ids.shape[1]) for mb in microbatches)
        mbs = max(int(mb.input_ids.shape[0]) for mb in microbatches)
        its = [iter(microbatches) for _ in self.chunks] if len(self.chunks) > 1 else iter(microbatches)
        return fb(forward_step_func=forward_step, data_iterator=its, model=self.chunks,
                  num_microbatches=len(microbatches), seq_length=seq, micro_batch_size=mbs,
                  forward_only=forward_only)

    @torch.no_grad()
    def compute_log_prob(self, prompt_ids: Tensor, prompt_length: Tensor, responses: Tensor,
                         response_length: Tensor, *, with_entropy: bool = False,
                         with_sum_sq: bool = False) -> LogProbs:
        """Per-token log-probs of the responses at the sampling temperature (all ranks get [B, T])."""
        B, T = responses.shape
        lengths = (prompt_length + response_length).tolist()
        rows = dp_shard_rows(lengths, self.pgs.dp_size, self.pgs.dp_rank, balance=True)
        mbs = make_microbatches(prompt_ids, prompt_length, responses, response_length, rows=rows,
                                max_tokens=self.max_tokens, pad_id=self.pad_id, sort_by_length=True,
                                seq_multiple=self.seq_multiple)
        out = {k: torch.zeros(B, T) for k in ("lp", "ent", "sq")}
        routers = self._routers() if self.pgs.pp_size == 1 else []  # per-stage layers: PP not counted
        current: list = [None]
        counts = [torch.zeros(r.config.num_moe_experts, dtype=torch.int64) for r in routers]
        hooks = self._count_routing(routers, counts, current)
        mb_iter = iter(mbs)

        def next_mask(module, args):
            current[0] = self._response_token_mask(next(mb_iter))

        if routers:
            hooks.append(unwrap_model(self.chunks[0]).register_forward_pre_hook(next_mask))

        record = self.router_replay and bool(self._routers())
        if record:
            self._set_replay_action("RECORD")
            rows_routing: dict[int, list] = {}

        def loss_func(mb, output):
            if record:
                self._collect_routing(mb, rows_routing)
            lp, ent, sq = self.token_stats(output, mb, T, entropy=with_entropy, sum_sq=with_sum_sq)
            for key, val in (("lp", lp), ("ent", ent), ("sq", sq)):
                if val is not None:
                    scatter_rows(out[key], mb, val.float().cpu())
            return lp.new_zeros(()), {}

        for m in self.chunks:
            m.eval()
        try:
            self.run(mbs, loss_func, forward_only=True)
        finally:
            for h in hooks:
                h.remove()
            if record:
                self._set_replay_action(None)
        if record:
            if self.pgs.dp_size > 1:  # the update shards rows differently: every rank keeps every row
                parts: list = [None] * self.pgs.dp_size
                dist.all_gather_object(parts, rows_routing, group=self.pgs.dp)
                rows_routing = {k: v for part in parts for k, v in part.items()}
            self._routing = {"key": responses, "rows": rows_routing}
        routed = self._reduce_counts(counts) if routers else None
        stacked = torch.stack([out["lp"], out["ent"], out["sq"]]).to(self.pgs.device)
        if self.pgs.pp_size > 1:  # only the last stage computed them
            dist.broadcast(stacked, src=dist.get_global_rank(self.pgs.pp, self.pgs.pp_size - 1), group=self.pgs.pp)
        if self.pgs.dp_size > 1:  # disjoint rows: a sum is a gather
            dist.all_reduce(stacked, group=self.pgs.dp)
        stacked = stacked.cpu()
        return LogProbs(stacked[0], stacked[1] if with_entropy else None, stacked[2] if with_sum_sq else None,
                        routed_counts=routed)

    def _reduce_counts(self, counts: list[Tensor]) -> Tensor:
        total = torch.stack(counts).to(self.pgs.device)  # [L, E]
        if self.pgs.dp_size > 1:  # disjoint rows
            dist.all_reduce(total, group=self.pgs.dp)
        sp = unwrap_model(self.chunks[0]).config.sequence_parallel
        if sp and self.pgs.tp_size > 1:  # each TP rank routed its own sequence shard
            dist.all_reduce(total, group=self.pgs.tp)
        return total.cpu()


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

    def compute_log_prob(self, *args, **kwargs) -> LogProbs:
        return self.policy.compute_log_prob(*args, **kwargs)

    def _loss_func(self, batch: PolicyBatch, totals: dict, denom: dict, num_mbs: int, record: dict | None,
                   mb: MicroBatch, output):
        """record (update_policy_on_policy): [B, T] buffers receiving the detached log-probs ("lp") and
        sum of squared probabilities ("sq", or None); old_log_prob is then logp.detach()."""
        cfg, T = self.cfg, batch.responses.shape[1]
        rows = mb.rows
        sq = None
        if self.policy.fused:
            logp, ent = self.policy.fused_token_stats(output, mb, T)
        else:
            logp, ent, sq = self.policy.token_stats(output, mb, T, entropy=True,
                                                    sum_sq=record is not None and record["sq"] is not None)
        if record is not None:
            scatter_rows(record["lp"], mb, logp.detach().float().cpu())
            if sq is not None:
                scatter_rows(record["sq"], mb, sq.detach().float().cpu())
        dev = logp.device
        take = lambda t: None if t is None else t.index_select(0, rows).to(dev)  # noqa: E731
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
        per-token sum of squared probabilities when `with_sum_sq` (not on the fused-kernel path: None).
        """
        if batch.old_log_probs is not None:
            raise ValueError("update_policy_on_policy: batch.old_log_probs must be None (it is taken from the update)")
        if self.cfg.ppo_epochs != 1 or len(batch) != self.cfg.ppo_mini_batch_size * self.n:
            raise ValueError(
                f"update_policy_on_policy needs exactly one optimizer step: ppo_epochs=1 (got {self.cfg.ppo_epochs}) "
                f"and a batch of ppo_mini_batch_size*n = {self.cfg.ppo_mini_batch_size * self.n} rows (got {len(batch)})")
        self._check_update_batch(batch)
        B, T = batch.responses.shape
        record = {"lp": torch.zeros(B, T), "sq": torch.zeros(B, T) if with_sum_sq and not self.policy.fused else None}
        self._begin_training_step()
        for m in self.policy.chunks:
            m.train()
        out = self._update_mini(batch, list(range(B)), record=record)
        stacked = torch.stack([record["lp"]] + ([record["sq"]] if record["sq"] is not None else []))
        stacked = stacked.to(self.pgs.device)
        if self.pgs.pp_size > 1:  # only the last stage computed them
            dist.broadcast(stacked, src=dist.get_global_rank(self.pgs.pp, self.pgs.pp_size - 1), group=self.pgs.pp)
        if self.pgs.dp_size > 1:  # disjoint rows: a sum is a gather
            dist.all_reduce(stacked, group=self.pgs.dp)
        stacked = stacked.cpu()
        lp = LogProbs(stacked[0] * batch.response_mask, None, stacked[1] if record["sq"] is not None else None)
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
            out = self._update_mini(batch, list(range(len(batch))))
        finally:
            self.loss_fn = saved
            self.scheduler.step(increment=0)  # restore the RL schedule's learning rate
        return {k: float(v) for k, v in out.items()}

    def reset_optimizer_state(self) -> None:
        """Forget Adam moments (after the warm-up, so RL starts from a fresh optimizer)."""
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            opt.optimizer.state.clear()

    def _update_mini(self, batch: PolicyBatch, mini: list[int], *, record: dict | None = None) -> dict[str, Tensor]:
        mask = batch.response_mask[mini]
        denom = {"tokens": mask.sum().to(self.pgs.device),
                 "seqs": (mask.sum(-1) > 0).sum().to(self.pgs.device)}
        lengths = [int(batch.prompt_length[r] + batch.response_length[r]) for r in mini]
        local = [mini[i] for i in dp_shard_rows(lengths, self.pgs.dp_size, self.pgs.dp_rank,
                                                 balance=self.balance_batch)]
        mbs = make_microbatches(batch.prompt_ids, batch.prompt_length, batch.responses, batch.response_length,
                                rows=local, max_tokens=self.cfg.max_tokens_per_microbatch, pad_id=self.policy.pad_id,
                                seq_multiple=self.policy.seq_multiple)
        zero = lambda: torch.zeros((), device=self.pgs.device)  # noqa: E731
        totals = {k: zero() for k in ("actor/pg_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl",
                                      "actor/pg_clipfrac_lower", "_tokens")}
        if self.cfg.use_kl_loss:
            totals["actor/kl_loss"] = zero()
        for chunk in self.policy.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss_func = partial(self._loss_func, batch, totals, denom, len(mbs), record)
        replay = (lambda mb: self.policy.replay_targets(mb, batch.responses)) if self.policy.router_replay else None
        try:
            self.policy.run(mbs, loss_func, forward_only=False, hidden=self.policy.fused, before_forward=replay)
        finally:
            if replay is not None:
                self.policy._set_replay_action(None)
        ok, grad_norm, _ = self.optimizer.step()
        return self._reduce(totals, grad_norm, ok)

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


def _reset_megatron_loss_scalers() -> None:
    """Megatron keeps the MoE aux-loss and MTP loss scales in class attributes and copies new values
    into them in place: a scale left by another model in the process (a different shape) breaks the
    next schedule with "output with shape [] doesn't match the broadcast shape [1]"."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    MTPLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0)  # its class default


class _output_layer_bypassed:
    """Within the block the output layer returns its input: GPTModel then returns the final hidden
    states ([b, s, h] after its transpose) instead of logits, so the fused kernel never sees logits."""

    def __init__(self, inner):
        self.layer = inner.output_layer

    def __enter__(self):
        self.layer.forward = lambda input_, *args, **kwargs: (input_, None)

    def __exit__(self, *exc):
        del self.layer.forward  # back to the class's forward
