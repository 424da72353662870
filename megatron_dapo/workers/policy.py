"""The policy model: one log-prob path for old_log_prob, the reference and the update.

Shape legend:
    B  rows (responses) of the batch, prompt-major   T  response width   [R, C] one micro-batch's input
    N  real response tokens of a micro-batch          H  hidden size      V/tp this rank's vocabulary shard
    K  statistics asked for (log-prob, entropy, sum of squared probabilities)

One pass (compute_log_prob, or one mini-batch of the update):
  1. plan  every DP rank's rows (dp_shard_rows, deterministic), this rank's rows sorted and packed
           by the token budget, the micro-batch count all-reduced (MAX) over the data x context
           parallel group and rounded for interleaved pipelines, bins split or filled to it;
  2. run   Megatron's schedule with the output layer bypassed: the last stage returns the final
           hidden states [R, C, H] (under sequence parallelism gathered over TP), MTP layers off in
           forward-only passes and, in the training forward, fed by Megatron as usual;
  3. stats the hidden states at the N real response positions only go to
           `kernels.fused_logprob_stats` (Triton on CUDA, chunked torch on CPU) with this rank's
           vocabulary shard: log-probs, and entropy / sum p^2 only when asked; no [N, V] logits,
           no position past a row's response, the same numerics with and without grad;
  4. gather (compute_log_prob) each rank's real tokens, K x its token count, all-gathered over DP
           and broadcast from the last pipeline stage, then laid out as [K, B, T] at the edge.

Context parallelism is not implemented (config.ParallelConfig refuses it; so does this class).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import cached_property, partial

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_dapo.models.forward import unwrap_model
from megatron_dapo.workers import routing
from megatron_dapo.workers.microbatch import (
    MicroBatch,
    build_microbatch,
    filler_microbatch,
    pad_microbatch,
    plan_bins,
    round_for_pipeline,
    split_bins,
)


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


@dataclass(frozen=True)
class PassPlan:
    """The micro-batches of one pass on this rank and where their tokens go."""

    microbatches: list[MicroBatch]
    """This rank's micro-batches (the same count on every DP rank), fillers included."""
    shard_rows: list[list[int]]
    """Per DP rank, the rows it computes, ascending: the order of its flat token buffer."""
    dest: dict[int, Tensor]
    """id(micro-batch) -> [N] positions of its tokens in this rank's flat token buffer."""
    num_local_tokens: int

    def counts(self) -> int:
        return len(self.microbatches)


def _both(first, second):
    """before_forward hooks: the ones given, in order (None when neither)."""
    hooks = [h for h in (first, second) if h]
    return (lambda chunk, mb: [h(chunk, mb) for h in hooks]) if hooks else None


class PolicyModel:
    """A (possibly pipelined / DDP-wrapped) Megatron model that computes per-token log-probs."""

    def __init__(self, model_chunks: list, *, pgs, pad_id: int, temperature: float, max_tokens: int,
                 vocab_size: int, minibatch_rows: int | None = None, balance_rows: bool = True,
                 packed_sequences: bool = False, router_replay: str = "off"):
        """minibatch_rows / balance_rows: the update's layout (rows per mini-batch, token-balanced DP
        shards); compute_log_prob shards a batch of a multiple of minibatch_rows rows the same way, so
        every rank computes (and records routing for) exactly the rows it trains, in the very micro-batches
        the update runs. packed_sequences: thd micro-batches (Transformer Engine spec only)."""
        if pgs.cp_size > 1:
            raise ValueError("parallel.context_parallel_size > 1 is not implemented: sequences are not split "
                             "over context-parallel ranks")
        self.chunks, self.pgs = model_chunks, pgs
        self.pad_id, self.temperature, self.max_tokens = pad_id, temperature, max_tokens
        self.vocab_size = vocab_size
        self.minibatch_rows, self.balance_rows = minibatch_rows, balance_rows
        self.packed = packed_sequences
        self.router_replay = router_replay != "off"
        # Router replay: per row this rank trains, [L, seq_len, K] expert ids of the last compute_log_prob
        # batch, keyed by the batch's responses tensor so a stale record is never used.
        self._routing: dict | None = None
        self.last_replay_metrics: dict[str, Tensor] = {}  # router_replay/* of the last replayed forward-only pass
        # Sequence parallelism splits the sequence (bshd: S, thd: the packed total) over the TP ranks.
        self.sequence_parallel = bool(unwrap_model(model_chunks[0]).config.sequence_parallel) and pgs.tp_size > 1
        self.seq_multiple = pgs.tp_size if self.sequence_parallel else 1
        self.filler_tokens = 1 + (unwrap_model(model_chunks[-1]).config.mtp_num_layers or 1)

    # -- planning ----------------------------------------------------------------------------------
    def row_groups(self, num_rows: int) -> list[list[int]]:
        """The update's mini-batches when num_rows is a multiple of minibatch_rows, else one group."""
        per = self.minibatch_rows
        if not per or num_rows % per or num_rows == per:
            return [list(range(num_rows))]
        return [list(range(s, s + per)) for s in range(0, num_rows, per)]

    def shard_rows(self, prompt_length: Tensor, response_length: Tensor,
                   groups: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
        """The rows each data-parallel rank computes ([dp_size] lists, over all groups) and this rank's rows
        per group: each group of batch rows is dealt over DP on its own (token-balanced when balance_rows)."""
        pgs, lengths = self.pgs, (prompt_length + response_length).tolist()
        every: list[list[int]] = [[] for _ in range(pgs.dp_size)]
        mine = []
        for g in groups:
            glens = [lengths[r] for r in g]
            shards = [[g[i] for i in dp_shard_rows(glens, pgs.dp_size, rank, balance=self.balance_rows)]
                      for rank in range(pgs.dp_size)]
            for rank in range(pgs.dp_size):
                every[rank] += shards[rank]
            mine.append(shards[pgs.dp_rank])
        return every, mine

    def plan(self, prompt_ids: Tensor, prompt_length: Tensor, responses: Tensor, response_length: Tensor,
             groups: list[list[int]]) -> PassPlan:
        """Micro-batches of `groups` (lists of batch rows, each sharded over DP on its own)."""
        pgs, lengths = self.pgs, (prompt_length + response_length).tolist()
        interleaved = len(self.chunks) > 1
        shard_rows, per_group = self.shard_rows(prompt_length, response_length, groups)
        local = [(mine, [lengths[r] for r in mine]) for mine in per_group]
        # interleaved bshd: one [rows, width] shape for the whole pass (microbatch.py, pad_microbatch)
        width = (-(-max(n for _, ml in local for n in ml) // self.seq_multiple) * self.seq_multiple
                 if interleaved and not self.packed else None)
        local_bins = [(mine, mlens, plan_bins(mlens, self.max_tokens, packed=self.packed, width=width))
                      for mine, mlens in local]
        counts = self._agreed_counts([len(bins) for _, _, bins in local_bins])
        rl = response_length.tolist()
        offset, n = {}, 0
        for row in shard_rows[pgs.dp_rank]:
            offset[row], n = n, n + rl[row]
        mbs, dest = [], {}
        for (mine, mlens, bins), count in zip(local_bins, counts):
            for b in split_bins(bins, mlens, count, packed=self.packed):
                if not b:
                    mb = filler_microbatch(pad_id=self.pad_id, seq_multiple=self.seq_multiple, packed=self.packed,
                                           length=self.filler_tokens)
                else:
                    mb = build_microbatch([mine[i] for i in b], prompt_ids, prompt_length, responses, response_length,
                                          pad_id=self.pad_id, seq_multiple=self.seq_multiple, packed=self.packed)
                starts = torch.tensor([offset[r] for r in mb.rows.tolist()], dtype=torch.long)
                dest[id(mb)] = (starts[mb.token_row] + mb.token_pos) if not mb.is_filler else mb.token_pos
                mbs.append(mb)
        if interleaved:
            rows = max(mb.input_ids.shape[0] for mb in mbs)
            cols = max(mb.input_ids.shape[1] for mb in mbs)
            padded = [pad_microbatch(mb, rows, cols, pad_id=self.pad_id) for mb in mbs]
            dest = {id(p): dest[id(mb)] for p, mb in zip(padded, mbs)}
            mbs = padded
        return PassPlan(microbatches=mbs, shard_rows=shard_rows, dest=dest, num_local_tokens=n)

    def _agreed_counts(self, local: list[int]) -> list[int]:
        """Per group, the largest micro-batch count of any rank sharing collectives (data x context
        parallel; expert-parallel groups lie inside it), rounded for interleaved pipelines."""
        counts = torch.tensor(local, dtype=torch.int64, device=self.pgs.device)
        if dist.get_world_size(self.pgs.dp_cp) > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.pgs.dp_cp)
        interleaved = len(self.chunks) > 1
        return [round_for_pipeline(int(c), pp=self.pgs.pp_size, interleaved=interleaved) for c in counts.tolist()]

    # -- one micro-batch ---------------------------------------------------------------------------
    def _forward(self, model, mb: MicroBatch, *, training: bool):
        """The last stage: final hidden states [R, C(/tp under SP), H]; other stages: their activations."""
        dev = self.pgs.device
        ids, pos = mb.input_ids.to(dev), mb.position_ids.to(dev)
        packed = mb.packed_seq_params(dev)
        kw = {} if packed is None else {"packed_seq_params": packed}
        inner = unwrap_model(model)
        if not inner.post_process:
            return model(ids, pos, None, **kw)
        if training and inner.config.mtp_num_layers:
            # Megatron computes the MTP loss from the labels (response targets only: loss_mask) and adds
            # its gradient through the hidden states; the main head's input is what this pass needs.
            mask, scale = _mtp_loss_mask(mb, inner.config.mtp_num_layers)
            captured: list = []
            with _main_head_captured(inner, captured, tp=self.pgs.tp_size), _mtp_loss_scaled(inner.config, scale):
                model(ids, pos, None, labels=mb.labels.to(dev), loss_mask=mask.to(dev), **kw)
            return captured[0].transpose(0, 1)
        with _output_layer_bypassed(inner):
            return model(ids, pos, None, **kw)

    def lm_head_weight(self) -> Tensor:
        """The output layer's weight [V/tp, H] on the last stage (the embedding when tied)."""
        inner = unwrap_model(self.chunks[-1])
        return (inner.shared_embedding_or_output_weight() if inner.share_embeddings_and_output_weights
                else inner.output_layer.weight)

    def token_stats(self, hidden: Tensor, mb: MicroBatch, *, weight: Tensor, entropy: bool,
                    sum_sq: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(log-probs, entropy or None, sum p^2 or None) [N] fp32 at the micro-batch's real response
        tokens, from the last stage's hidden states [R, C(/tp), H]."""
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        from megatron_dapo.kernels import fused_logprob_stats

        if self.sequence_parallel:
            # The kernel all-reduces d hidden over TP itself: gather with a plain split as backward.
            hidden = gather_from_sequence_parallel_region(hidden.transpose(0, 1), tensor_parallel_output_grad=False,
                                                          group=self.pgs.tp).transpose(0, 1)
        R, C, H = hidden.shape
        hid = hidden.reshape(R * C, H).index_select(0, mb.token_index.to(hidden.device))
        labels = mb.token_labels().to(hidden.device)
        # Labels outside this TP rank's vocabulary shard are handled inside the kernel.
        return fused_logprob_stats(hid, weight, labels, temperature=self.temperature, compute_entropy=entropy,
                                   compute_sum_sq=sum_sq, tp_group=self.pgs.tp if self.pgs.tp_size > 1 else None)

    # -- MoE routing -------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return bool(self._routers())

    def _routers(self) -> list:
        return routing.moe_routers(self.chunks)

    @cached_property
    def _rank_routers(self) -> routing.RankRouters:
        """This rank's routers per chunk and their MoE-layer indices, found once (a module walk)."""
        return routing.RankRouters(self.chunks)

    def routing_layers(self) -> list[int]:
        """R3: the MoE layers (indices among the model's MoE layers, ascending) this rank's chunks route."""
        return sorted(self._rank_routers.moe_index)

    def provide_routing(self, responses: Tensor, rows: dict[int, Tensor], *, layers: list[int] | None = None) -> None:
        """R3: the rollout engine's routing of the batch `responses`, row -> [L_total, S, K] (every MoE layer
        of the model, or the MoE layers `layers`, which hold this rank's; the first S positions of the row,
        prompt then response: SGLang sends every position but the last) or None (no routing: the row routes
        freely); the rows this rank computes at least. This rank keeps its layers' part; compute_log_prob and
        the update replay it."""
        local = self._rank_routers.local_part
        self._routing = {"key": responses, "provided": True,
                         "rows": {r: None if t is None else local(t, where=f"row {r}", layers=layers)
                                  for r, t in rows.items()}}

    def replay(self, responses: Tensor, *, training: bool = True) -> routing.RoutingReplay:
        """For a pass over the batch `responses`: the replay of its recorded routing (call `before_forward`
        per chunk and micro-batch, `remove` always, then `metrics`)."""
        if self._routing is None or self._routing["key"] is not responses:
            raise ValueError("actor.router_replay: no routing was recorded for this batch "
                             "(compute_log_prob must run on the same batch first)")
        return routing.RoutingReplay(self._rank_routers, self._routing["rows"],
                                     sequence_parallel=self.sequence_parallel, tp_size=self.pgs.tp_size,
                                     tp_rank=self.pgs.tp_rank, device=self.pgs.device, training=training)

    # -- the schedule ------------------------------------------------------------------------------
    def run(self, microbatches: list[MicroBatch], loss_func, *, forward_only: bool, before_forward=None,
            after_forward=None):
        """One pass of Megatron's schedule. before_forward / after_forward(chunk, mb): called around each
        model chunk's forward of a micro-batch (chunk: its index in self.chunks, i.e. the virtual stage)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            chunk = next(i for i, c in enumerate(self.chunks) if c is model)
            if before_forward is not None:
                before_forward(chunk, mb)
            out = self._forward(model, mb, training=not forward_only)
            if after_forward is not None:
                after_forward(chunk, mb)
            return out, partial(loss_func, mb)

        _reset_megatron_loss_scalers()
        fb = get_forward_backward_func()
        seq = max(int(mb.input_ids.shape[1]) for mb in microbatches)
        mbs = max(int(mb.input_ids.shape[0]) for mb in microbatches)
        its = [iter(microbatches) for _ in self.chunks] if len(self.chunks) > 1 else iter(microbatches)
        with _mtp_skipped(self.chunks) if forward_only else nullcontext():
            return fb(forward_step_func=forward_step, data_iterator=its, model=self.chunks,
                      num_microbatches=len(microbatches), seq_length=seq, micro_batch_size=mbs,
                      forward_only=forward_only)

    @torch.no_grad()
    def compute_log_prob(self, prompt_ids: Tensor, prompt_length: Tensor, responses: Tensor,
                         response_length: Tensor, *, with_entropy: bool = False,
                         with_sum_sq: bool = False) -> LogProbs:
        """Per-token log-probs of the responses at the sampling temperature (all ranks get [B, T]);
        entropy and the squared-probability sum are computed (and reduced) only when asked for."""
        B, T = responses.shape
        plan = self.plan(prompt_ids, prompt_length, responses, response_length, self.row_groups(B))
        n_stats = 1 + with_entropy + with_sum_sq
        local = torch.zeros(n_stats, plan.num_local_tokens, device=self.pgs.device)
        routers = self._routers()
        counted = routers if self.pgs.pp_size == 1 else []  # per-stage layers: PP not counted
        counts = (routing.RoutingCounts(counted, device=self.pgs.device, sequence_parallel=self.sequence_parallel,
                                        tp_size=self.pgs.tp_size, tp_rank=self.pgs.tp_rank) if counted else None)
        provided = self._routing is not None and self._routing.get("provided") and self._routing["key"] is responses
        replay = self.replay(responses, training=False) if provided else None
        recorder = (routing.RoutingRecorder(self._rank_routers, tp_group=self.pgs.tp,
                                            tp_size=self.pgs.tp_size, sequence_parallel=self.sequence_parallel)
                    if self.router_replay and routers and not provided else None)
        weight = self.lm_head_weight() if self.pgs.is_last_pp_stage else None

        def loss_func(mb, output):
            if mb.token_index.numel():
                lp, ent, sq = self.token_stats(output, mb, weight=weight, entropy=with_entropy, sum_sq=with_sum_sq)
                local[:, plan.dest[id(mb)].to(local.device)] = torch.stack([v for v in (lp, ent, sq) if v is not None])
            return output.new_zeros(()), {}

        for m in self.chunks:
            m.eval()
        try:
            self.run(plan.microbatches, loss_func, forward_only=True,
                     before_forward=_both(counts and (lambda _, mb: counts.set_microbatch(mb)),
                                          replay and replay.before_forward),
                     after_forward=recorder.after_forward if recorder is not None else None)
        except BaseException:
            if recorder is not None:
                recorder.abandon()
            raise
        finally:
            if counts is not None:
                counts.remove()
            if replay is not None:
                replay.remove()
        if replay is not None:
            self.last_replay_metrics = replay.metrics(self.pgs)
        if recorder is not None:  # only the rows this rank trains: compute_log_prob sharded them as the update will
            self._routing = {"key": responses, "rows": recorder.finish()}
        routed = counts.reduce(self.pgs) if counts is not None else None
        stats = iter(self.gather_tokens(plan, local, response_length, T))
        lp = next(stats)
        return LogProbs(lp, next(stats) if with_entropy else None, next(stats) if with_sum_sq else None,
                        routed_counts=routed)

    def gather_tokens(self, plan: PassPlan, local: Tensor, response_length: Tensor, width: int) -> Tensor:
        """This rank's [K, N_local] token statistics -> [K, B, width] on every rank (host, zero past each
        response): an all-gather of real tokens over DP on the last stage, a broadcast over PP."""
        pgs, rl = self.pgs, response_length.long()
        sizes = [int(rl[rows].sum()) if rows else 0 for rows in plan.shard_rows]
        K, total = local.shape[0], sum(sizes)
        flat = local
        if pgs.is_last_pp_stage and pgs.dp_size > 1:
            buf = local.new_zeros(K, max(sizes))
            buf[:, :local.shape[1]] = local
            parts = [torch.empty_like(buf) for _ in range(pgs.dp_size)]
            dist.all_gather(parts, buf, group=pgs.dp)
            flat = torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)
        if pgs.pp_size > 1:  # only the last stage computed them
            if not pgs.is_last_pp_stage:
                flat = local.new_zeros(K, total)
            dist.broadcast(flat, src=dist.get_global_rank(pgs.pp, pgs.pp_size - 1), group=pgs.pp)
        rows = torch.tensor([r for shard in plan.shard_rows for r in shard], dtype=torch.long)
        lens = rl[rows]  # token j of row r sits at (tokens of the rows before r) + j in flat; it goes to r * width + j
        index = torch.arange(int(lens.sum())) + torch.repeat_interleave(rows * width - (lens.cumsum(0) - lens), lens)
        out = torch.zeros(K, rl.numel() * width)
        out[:, index] = flat.float().cpu()
        return out.view(K, rl.numel(), width)


def _reset_megatron_loss_scalers() -> None:
    """Megatron keeps the MoE aux-loss and MTP loss scales in class attributes and copies new values
    into them in place: a scale left by another model in the process (a different shape) breaks the
    next schedule with "output with shape [] doesn't match the broadcast shape [1]"."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    MTPLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0)  # its class default


def _mtp_loss_mask(mb: MicroBatch, mtp_layers: int) -> tuple[Tensor, float | None]:
    """(loss_mask [R, C], scale override) of the MTP loss: 1 where the label is a response token. Megatron
    divides each MTP layer's loss by its mask's sum after j shifts (layer j = 1..mtp_layers), which keeps
    the response labels at position >= j of their sequence; where some layer keeps none (a filler, rows
    without a response) that is 0 / 0: such a micro-batch runs its MTP layers on an all-ones mask with the
    loss scale 0 instead (a finite loss, a zero gradient; the partners' collectives still run)."""
    at = mb.prompt_length[mb.token_row] - 1 + mb.token_pos  # each response label's position in its sequence
    if all(bool((at >= j).any()) for j in range(1, mtp_layers + 1)):
        return mb.response_label_mask(), None
    return torch.ones_like(mb.labels), 0.0


class _mtp_loss_scaled:
    """config.mtp_loss_scaling_factor := scale for one forward (GPTModel._postprocess reads it there)."""

    def __init__(self, config, scale: float | None):
        self.config, self.scale = config, scale

    def __enter__(self):
        if self.scale is not None:
            self.saved = self.config.mtp_loss_scaling_factor
            self.config.mtp_loss_scaling_factor = self.scale

    def __exit__(self, *exc):
        if self.scale is not None:
            self.config.mtp_loss_scaling_factor = self.saved


class _output_layer_bypassed:
    """Within the block the output layer returns its input: GPTModel then returns the final hidden
    states ([b, s, h] after its transpose) instead of logits, so the kernel never sees logits."""

    def __init__(self, inner):
        self.layer = inner.output_layer

    def __enter__(self):
        self.layer.forward = lambda input_, *args, **kwargs: (input_, None)

    def __exit__(self, *exc):
        del self.layer.forward  # back to the class's forward


class _main_head_captured:
    """Training forward of an MTP model. GPTModel._postprocess calls the output layer once per MTP
    layer, then once for the main head (call number mtp_num_layers, 0-based). The MTP calls run as
    usual (Megatron computes the MTP loss from their logits); the main call hands its input (the
    final hidden states [s(/tp), b, h], carrying the MTP loss's gradient hook) to `captured` and
    returns [s, b, 1] zeros: Megatron's own main-head cross-entropy then sees a one-column vocabulary
    shard (labels outside it are masked, nothing is indexed out of range), costs nothing, and its
    result is ignored."""

    def __init__(self, inner, captured: list, *, tp: int):
        self.layer, self.captured = inner.output_layer, captured
        self.main_call = inner.config.mtp_num_layers
        self.gathered = tp if self.layer.sequence_parallel else 1

    def __enter__(self):
        original, calls = self.layer.forward, [0]

        def forward(input_, *args, **kwargs):
            index, calls[0] = calls[0], calls[0] + 1
            if index < self.main_call:
                return original(input_, *args, **kwargs)
            if index > self.main_call:
                raise RuntimeError(f"expected {self.main_call + 1} output-layer calls in an MTP forward: "
                                   "Megatron's GPTModel._postprocess changed")
            self.captured.append(input_)
            return input_.new_zeros(input_.shape[0] * self.gathered, input_.shape[1], 1), None

        self.layer.forward = forward

    def __exit__(self, *exc):
        del self.layer.forward
        if exc[0] is None and len(self.captured) != 1:
            raise RuntimeError("the main head's output-layer call did not happen in an MTP forward")


class _mtp_skipped:
    """Forward-only passes run no MTP layer. GPTModel.forward runs the MTP block when `mtp_process`
    and _postprocess computes MTP losses when `config.mtp_num_layers` is set (gpt_model.py, 0.16);
    both are switched off for the pass and restored after. The other readers of mtp_num_layers act
    at build time (transformer_block's final norm, the layer specs) or in training only (the
    schedule's MTP loss scale, the router's aux-loss logging, finalize_model_grads)."""

    def __init__(self, chunks: list):
        self.models = [unwrap_model(c) for c in chunks]
        self.wrappers = list(chunks)
        self.saved: list = []

    def __enter__(self):
        # the model's own config, and the wrapper's (DDP's) that the schedule reads: usually one object
        configs = {id(m.config): m.config for m in self.models}
        configs.update({id(c.config): c.config for c in self.wrappers if getattr(c, "config", None) is not None})
        self.saved = [(m, m.mtp_process) for m in self.models] + [(c, c.mtp_num_layers) for c in configs.values()]
        for m in self.models:
            m.mtp_process = False
        for c in configs.values():
            c.mtp_num_layers = None

    def __exit__(self, *exc):
        for obj, value in self.saved[:len(self.models)]:
            obj.mtp_process = value
        for obj, value in self.saved[len(self.models):]:
            obj.mtp_num_layers = value
