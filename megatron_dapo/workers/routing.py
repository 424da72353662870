"""MoE routing seen from the policy's forward: load-balance counts of response tokens, router replay.

Shape legend:
    L  MoE layers of the decoder (MTP layers excluded: they are the drafter, not the policy)
    E  experts      K  top-k       [R, C] the model input of one micro-batch (see microbatch.py)
A router sees the micro-batch flattened sequence-first, [C * R] tokens (bshd: s * b + k; thd: the
packed position), under sequence parallelism only this TP rank's contiguous shard of them.

Counts stay on the device for the whole pass and are copied to the host once (a host copy per layer
and micro-batch would synchronise the device L x micro-batches times). Replay records keep, per row
this rank trains, one [L, seq_len, K] tensor of uint8 expert ids (int16 above 256 experts): at the
32B recipe's scale 1 B instead of int64's 8 per id, and no row that another rank trains.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

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


def expert_id_dtype(num_experts: int) -> torch.dtype:
    return torch.uint8 if num_experts <= 256 else torch.int16


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


def collect_routing(routers: list, mb: MicroBatch, out: dict[int, Tensor]) -> None:
    """After a recorded forward: out[row] = [L, seq_len, K] expert ids of every position of the row."""
    if mb.is_filler or not routers:
        return
    dtype = expert_id_dtype(routers[0].config.num_moe_experts)
    per_layer = [r.router_replay.get_recorded_indices() for r in routers]  # [C * R, K] each
    for k, row in enumerate(mb.rows.tolist()):
        n = int(mb.seq_len[k])
        idx = seq_first(mb, mb.seq_start[k] + torch.arange(n)).to(per_layer[0].device)
        out[row] = torch.stack([rec.index_select(0, idx) for rec in per_layer]).to("cpu", dtype)


def replay_targets(routers: list, mb: MicroBatch, record: dict[int, Tensor], *, device) -> None:
    """Before a training forward: every router's replay target from the recorded routing."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for row in mb.rows.tolist():
        if row not in record:
            raise ValueError(f"actor.router_replay: no routing was recorded on this rank for row {row} "
                             "(compute_log_prob and the update must shard the batch alike)")
    tokens = mb.input_ids.numel()
    for layer, r in enumerate(routers):
        K = r.topk
        target = torch.arange(K).repeat(tokens, 1)  # padding positions: any K distinct experts
        for k, row in enumerate(mb.rows.tolist()):
            rec = record[row][layer]
            idx = seq_first(mb, mb.seq_start[k] + torch.arange(rec.shape[0]))
            target[idx] = rec.long()
        r.router_replay.clear_indices()
        r.router_replay.set_target_indices(target.to(device))
        r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
