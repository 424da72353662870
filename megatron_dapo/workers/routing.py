"""MoE routing seen from the policy's forward: load-balance counts of response tokens, router replay.

Shape legend:
    L  MoE layers of the decoder (MTP layers excluded: they are the drafter, not the policy)
    E  experts      K  top-k       [R, C] the model input of one micro-batch (see microbatch.py)
A router sees the micro-batch flattened sequence-first, [C * R] tokens (bshd: s * b + k; thd: the
packed position), under sequence parallelism only this TP rank's contiguous shard of them.

Counts stay on the device for the whole pass and are copied to the host once (a host copy per layer
and micro-batch would synchronise the device L x micro-batches times). Replay records keep, per row
this rank trains, one [L_local, seq_len, K] tensor of uint8 expert ids (int16 above 256 experts), every
position of the row (prompt and response): 1 B instead of int64's 8 per id, only this rank's pipeline
stage's layers (L_local), and no row that another data-parallel rank trains (the TP ranks of one DP rank
hold the same rows' records: see RoutingRecorder).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_dapo.models.arch import expert_id_dtype
from megatron_dapo.models.forward import unwrap_model
from megatron_dapo.workers.microbatch import MicroBatch


def moe_routers(chunks: list) -> list:
    """The decoder's TopKRouters of this rank's model chunks, in layer order (MTP layers excluded)."""
    return [m for c in chunks for name, m in unwrap_model(c).named_modules()
            if type(m).__name__ == "TopKRouter" and not name.startswith("mtp.")]


def seq_first(mb: MicroBatch, flat: Tensor) -> Tensor:
    """Row-major flat positions of the [R, C] input -> the router's sequence-first token index."""
    R, C = mb.input_ids.shape
    return (flat % C) * R + flat // C


class RoutingCounts:
    """Per-layer, per-expert counts of response-token assignments over one pass, on the device."""

    def __init__(self, routers: list, *, device, sequence_parallel: bool, tp_size: int, tp_rank: int):
        self.counts = torch.zeros(len(routers), routers[0].config.num_moe_experts if routers else 0,
                                  dtype=torch.int64, device=device)
        self.sp = (sequence_parallel and tp_size > 1, tp_size, tp_rank)
        self.mask: Tensor | None = None
        self.hooks = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def set_microbatch(self, mb: MicroBatch) -> None:
        """Before each forward: the [tokens] mask of response input tokens in the routers' order."""
        mask = torch.zeros(mb.input_ids.numel(), dtype=torch.int64)
        mask[seq_first(mb, mb.token_index + 1)] = 1
        split, tp, rank = self.sp
        if split:
            shard = mask.numel() // tp
            mask = mask[rank * shard:(rank + 1) * shard]
        self.mask = mask.to(self.counts.device)

    def _hook(self, layer: int):
        def hook(module, args, output):
            routing_map = output[1]  # [tokens, E] bool
            if self.mask is None or routing_map.shape[0] != self.mask.numel():
                return
            self.counts[layer] += (routing_map.to(torch.int64) * self.mask.unsqueeze(1)).sum(0)
        return hook

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()

    def reduce(self, pgs) -> Tensor:
        """[L, E] counts over the whole batch (disjoint rows over DP, sequence shards over TP), on host."""
        total = self.counts
        if pgs.dp_size > 1:
            dist.all_reduce(total, group=pgs.dp)
        if self.sp[0]:
            dist.all_reduce(total, group=pgs.tp)
        return total.cpu()


def set_replay_action(routers: list, action: str | None) -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for r in routers:
        if action is None:
            r.router_replay.clear_router_replay_action()
            r.router_replay.clear_indices()
        else:
            r.router_replay.set_router_replay_action(RouterReplayAction[action])


def moe_layer_pattern(config) -> list[bool]:
    """Per decoder layer of the whole model (every pipeline stage): whether it is a MoE layer."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(config.num_layers)]
    return [bool(f) for f in freq]


def moe_layer_total(config) -> int:
    return sum(moe_layer_pattern(config)) if config.num_moe_experts else 0


class RankRouters:
    """This rank's routers per model chunk (virtual pipeline stage), flattened in chunk order.

    Routing records are [L_local, tokens, K] with L_local = this rank's MoE layers (its pipeline stage's, all
    its chunks), layer l at flat index l; `chunk_slice(c)` are the layers of chunk c."""

    def __init__(self, chunks: list):
        self.per_chunk = [moe_routers([c]) for c in chunks]
        self.flat = [r for rs in self.per_chunk for r in rs]
        starts = [0]
        for rs in self.per_chunk:
            starts.append(starts[-1] + len(rs))
        self._starts = starts
        config = unwrap_model(chunks[0]).config
        self.total = moe_layer_total(config)
        self.top_k = config.moe_router_topk
        self.num_experts = config.num_moe_experts or 0
        self.dtype = expert_id_dtype(config.num_moe_experts or 1)
        # Each router's index among the model's MoE layers (layer_number: 1-based, over all stages).
        pattern = moe_layer_pattern(config)
        self.moe_index = [sum(pattern[:r.layer_number - 1]) for r in self.flat]

    def local_part(self, full: Tensor, *, where: str, layers: list[int] | None = None) -> Tensor:
        """[L_total, n, K] routing of every MoE layer of the model (or of the MoE layers `layers`, ascending,
        as trainer/replay.py sends a rank the ones it needs) -> [L_local, n, K], this rank's layers."""
        expected = self.total if layers is None else len(layers)
        if full.dim() != 3 or full.shape[0] != expected or full.shape[2] != self.top_k:
            raise ValueError(f"actor.router_replay: {where}: routing of shape {tuple(full.shape)}, the model needs "
                             f"[{expected} MoE layers, tokens, top-k {self.top_k}]")
        if full.numel() and int(full.max()) >= self.num_experts:
            raise ValueError(f"actor.router_replay: {where}: expert id {int(full.max())} >= the model's "
                             f"{self.num_experts} experts")
        if layers is None:
            return full[self.moe_index].to(self.dtype)
        missing = sorted(set(self.moe_index) - set(layers))
        if missing:
            raise ValueError(f"actor.router_replay: {where}: routing of MoE layers {layers}, this rank needs {missing}")
        return full[[layers.index(m) for m in self.moe_index]].to(self.dtype)

    def chunk_slice(self, chunk: int) -> slice:
        return slice(self._starts[chunk], self._starts[chunk + 1])

    def __len__(self) -> int:
        return len(self.flat)


def _sp_gather(local: Tensor, tp_group, tp_size: int) -> Tensor:
    """[L, tokens / tp, K] of this TP rank's sequence shard -> [L, tokens, K] (contiguous shards in rank order)."""
    parts = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(parts, local.contiguous(), group=tp_group)
    return torch.cat(parts, dim=1)


class RoutingRecorder:
    """R2's record: during a forward-only pass, each chunk's routers record their top-k; after each chunk's
    forward of a micro-batch the ids of every position of every row are kept, per row this rank computes.

    Under sequence parallelism a router sees only its TP rank's shard of the tokens: the shards are gathered
    over TP, so the TP ranks of a data-parallel rank (which train the same rows) hold the same full records;
    the update may bin the rows differently (its micro-batches, hence its shards, need not be these)."""

    def __init__(self, layers: RankRouters, *, tp_group, tp_size: int, sequence_parallel: bool):
        self.layers = layers
        self.tp = (tp_group, tp_size) if sequence_parallel and tp_size > 1 else None
        self._parts: dict[int, list[Tensor | None]] = {}
        set_replay_action(layers.flat, "RECORD")

    def after_forward(self, chunk: int, mb: MicroBatch) -> None:
        routers = self.layers.per_chunk[chunk]
        if mb.is_filler or not routers:
            return
        rec = torch.stack([r.router_replay.get_recorded_indices() for r in routers])  # [Lc, tokens(/tp), K]
        if self.tp is not None:
            rec = _sp_gather(rec, *self.tp)
        rec = rec.to("cpu", self.layers.dtype)
        span = self.layers.chunk_slice(chunk)
        for k, row in enumerate(mb.rows.tolist()):
            idx = seq_first(mb, mb.seq_start[k] + torch.arange(int(mb.seq_len[k])))
            parts = self._parts.setdefault(row, [None] * len(self.layers))
            parts[span] = list(rec[:, idx].unbind(0))

    def finish(self) -> dict[int, Tensor]:
        """row -> [L_local, seq_len, K] expert ids; every layer of every row must have been recorded."""
        set_replay_action(self.layers.flat, None)
        out = {}
        for row, parts in self._parts.items():
            missing = [i for i, p in enumerate(parts) if p is None]
            if missing:
                raise RuntimeError(f"actor.router_replay: row {row} has no recorded routing for this rank's MoE "
                                   f"layers {missing} (a model chunk did not run it)")
            out[row] = torch.stack(parts)
        return out

    def abandon(self) -> None:
        set_replay_action(self.layers.flat, None)


class RoutingReplay:
    """Replay of recorded routing in the training forwards, with its self-check.

    Before each chunk's forward of a micro-batch, that chunk's routers get the micro-batch's target top-k
    and which positions it covers (`known`): the real positions of rows that have a record. Every other
    position (padding, a filler micro-batch, a row or a token the rollout engine sent no routing for)
    routes as the router itself does. Each router's top-k call is observed: a layer is *engaged* when
    every forward of its chunk took the replayed choice (a router that the forward never reached, e.g. a
    stale copy of the decoder, stays at 0), and at the known positions the router's own top-k is compared
    with the replayed one: the mismatch counts (token, layer) pairs whose sets differ, the drift between
    the recorded routing and the current router. The replayed probabilities are the router's scores at
    the replayed experts, as Megatron's RouterReplay computes them.

    Full recompute (model.recompute=full): Megatron runs a checkpointed layer's forward without autograd and
    runs it again in the backward pass, by then other micro-batches' targets are set (pipeline schedules run
    several forwards before a backward). A layer's forward under no-grad in a training pass keeps its target
    in the layer's queue; a call with autograd on while the queue is not empty is that recompute, and takes
    the oldest target (backward passes run in forward order, per chunk). Layers that are not checkpointed
    never queue anything.
    """

    def __init__(self, layers: RankRouters, record: dict[int, Tensor], *, sequence_parallel: bool, tp_size: int,
                 tp_rank: int, device, training: bool = True):
        self.layers, self.record, self.device, self.training = layers, record, device, training
        self.sp = (tp_size, tp_rank) if sequence_parallel and tp_size > 1 else None
        n = len(layers)
        self.replayed = torch.zeros(n, dtype=torch.int64, device=device)
        self.forwards = torch.zeros(n, dtype=torch.int64, device=device)
        self.mismatched = torch.zeros((), dtype=torch.int64, device=device)
        self.compared = torch.zeros((), dtype=torch.int64, device=device)
        self._target: list[tuple[Tensor, Tensor] | None] = [None] * n  # (top-k [tokens, K], known [tokens])
        self._queued: list[deque] = [deque() for _ in range(n)]
        self._unserved: list[int] = []
        for i, r in enumerate(layers.flat):
            r.router_replay.get_replay_topk = self._probe(i, r.router_replay)

    def _probe(self, layer: int, replay):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        bound = type(replay).get_replay_topk.__get__(replay)
        queued = self._queued[layer]

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if replay.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
                return bound(scores, topk, num_groups, group_topk, default_compute_topk)
            recompute = torch.is_grad_enabled() and bool(queued)  # full recompute of a checkpointed forward
            target, known = queued.popleft() if recompute else self._target[layer]
            with torch.no_grad():
                own = default_compute_topk(scores, topk, num_groups, group_topk)[1]
                indices = torch.where(known.unsqueeze(1), target, own)
            if not recompute:
                if self.training and not torch.is_grad_enabled():
                    queued.append((target, known))
                self.replayed[layer] += 1
                differ = (own.sort(-1).values != target.sort(-1).values).any(-1) & known
                self.mismatched += differ.sum()
                self.compared += known.sum()
            return scores.gather(1, indices), indices
        return get_replay_topk

    def before_forward(self, chunk: int, mb: MicroBatch) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        span = self.layers.chunk_slice(chunk)
        routers = self.layers.per_chunk[chunk]
        if not routers:
            return
        rows = mb.rows.tolist()
        for row in rows:
            if row not in self.record:
                raise ValueError(f"actor.router_replay: no routing was recorded on this rank for row {row} "
                                 "(compute_log_prob and the update must shard the batch alike)")
        tokens, K = mb.input_ids.numel(), self.layers.top_k
        target = torch.zeros(len(routers), tokens, K, dtype=torch.long)
        known = torch.zeros(tokens, dtype=torch.bool)
        for k, row in enumerate(rows):
            rec = self.record[row]
            if rec is None:  # the engine sent no routing for this row (an aborted request): it routes freely
                continue
            idx = seq_first(mb, mb.seq_start[k] + torch.arange(rec.shape[1]))
            target[:, idx] = rec[span].long()
            known[idx] = True
        if self.sp is not None:
            tp, rank = self.sp
            shard = tokens // tp
            target, known = target[:, rank * shard:(rank + 1) * shard], known[rank * shard:(rank + 1) * shard]
        target, known = target.to(self.device), known.to(self.device)
        for j, r in enumerate(routers):
            r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            self._target[span.start + j] = (target[j], known)
        self.forwards[span] += 1

    def remove(self) -> list[int]:
        """Restore the routers; the layers (flat indices) whose queued targets were not all recomputed."""
        for r in self.layers.flat:
            r.router_replay.__dict__.pop("get_replay_topk", None)
        set_replay_action(self.layers.flat, None)
        self._unserved = [i for i, q in enumerate(self._queued) if q]
        for q in self._queued:
            q.clear()
        return self._unserved

    def metrics(self, pgs) -> dict[str, Tensor]:
        """router_replay/engaged_layers (MoE layers of the whole model that replayed in every forward, on every
        rank) and router_replay/mismatch_frac over this pass; raises when fewer layers engaged than exist."""
        ok = ((self.replayed == self.forwards) & (self.forwards > 0)).sum().reshape(1)
        if self._unserved:
            raise RuntimeError(f"actor.router_replay: the recomputed forwards of this rank's MoE layers "
                               f"{self._unserved} did not all take their micro-batch's routing")
        for group, size in ((pgs.tp, pgs.tp_size), (pgs.dp, pgs.dp_size)):
            if size > 1:
                dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        counts = torch.stack([self.mismatched, self.compared]).reshape(2)
        for group, size, split in ((pgs.tp, pgs.tp_size, self.sp is not None), (pgs.dp, pgs.dp_size, True),
                                   (pgs.pp, pgs.pp_size, True)):
            if size > 1 and split:
                dist.all_reduce(counts, group=group)
        if pgs.pp_size > 1:
            dist.all_reduce(ok, group=pgs.pp)
        engaged = int(ok)
        if engaged < self.layers.total:
            raise RuntimeError(f"actor.router_replay: only {engaged} of the model's {self.layers.total} MoE layers "
                               "took the replayed routing in every forward of the update (a router the forward "
                               "does not run got the targets, or a micro-batch was not replayed)")
        return {"router_replay/engaged_layers": torch.tensor(float(engaged)),
                "router_replay/mismatch_frac": (counts[0].float() / counts[1].clamp(min=1)).cpu()}
