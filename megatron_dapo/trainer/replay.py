"""R3 (actor.router_replay=r3): the routing SGLang chose for each training row, to the ranks that train it.

Rank 0 received every row's routing from the engine (RolloutBatch.routed_experts: [L_hf, S, K] per row,
S = prompt + response - 1, zeros for a layer without a router). Each rank needs only the rows its
data-parallel rank computes (PolicyModel.shard_rows: the same dealing as compute_log_prob and the update),
so rank 0 sends each rank exactly those rows, point to point on the control group, MoE layers only:
a header (S per row, -1 for a row without routing, e.g. an aborted request) then one flat tensor. Each
rank hands them to its policies (actor, reference), which keep their own layers' part.

Host memory: rank 0 holds the whole training batch's routing (it received it from the engine); every
other rank its DP rank's rows (the TP and PP ranks of one DP rank each receive them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _wire_dtype(num_experts: int) -> torch.dtype:
    return torch.uint8 if num_experts <= 256 else torch.int32  # gloo has no int16


def provide_rollout_routing(rollout, policies: list, *, pgs) -> dict[str, float]:
    """Give `policies` (PolicyModels over the same batch, the actor's first) the routing of the rows this
    rank computes.

    rollout: the training batch's RolloutBatch (dense, every rank). Returns
    router_replay/rows_with_routing (share of the batch's rows that carried routing), identical on every
    rank. A collective over pgs.ctrl."""
    from megatron_dapo.models.forward import unwrap_model
    from megatron_dapo.workers.routing import moe_layer_pattern

    policy = policies[0]
    config = unwrap_model(policy.chunks[0]).config
    # the decoder layers with a router: the rows of SGLang's per-layer routing that are the MoE layers
    moe_layers = [i for i, moe in enumerate(moe_layer_pattern(config)) if moe]
    num_experts, top_k = config.num_moe_experts, config.moe_router_topk
    B = len(rollout)
    shards, _ = policy.shard_rows(rollout.prompt_length, rollout.response_length, policy.row_groups(B))
    world, me = dist.get_world_size(pgs.ctrl), dist.get_rank(pgs.ctrl)
    dp_of = [None] * world
    dist.all_gather_object(dp_of, pgs.dp_rank, group=pgs.ctrl)
    L, dtype = len(moe_layers), _wire_dtype(num_experts)
    have = torch.zeros(1, dtype=torch.int64)
    if me == 0:
        routing = rollout.routed_experts or [None] * B
        expected = (rollout.prompt_length + rollout.response_length - 1).tolist()
        for row, r in enumerate(routing):
            if r is not None and (r.dim() != 3 or r.shape[1] != expected[row] or r.shape[2] != top_k
                                  or r.shape[0] <= max(moe_layers)):
                raise ValueError(f"actor.router_replay=r3: row {row}: routing of shape {tuple(r.shape)}, expected "
                                 f"[{max(moe_layers) + 1}+ layers, {expected[row]} tokens, top-k {top_k}]")
        index = torch.tensor(moe_layers, dtype=torch.long)
        moe = [None if r is None else r.index_select(0, index) for r in routing]
        have += sum(r is not None for r in moe)
        for dst in range(1, world):
            rows = shards[dp_of[dst]]
            header = torch.tensor([-1 if moe[row] is None else moe[row].shape[1] for row in rows], dtype=torch.int64)
            flat = [moe[row].reshape(-1).to(dtype) for row in rows if moe[row] is not None]
            g = dist.get_global_rank(pgs.ctrl, dst)
            if header.numel():
                dist.send(header, dst=g, group=pgs.ctrl)
            if sum(t.numel() for t in flat):
                dist.send(torch.cat(flat), dst=g, group=pgs.ctrl)
        mine = {row: moe[row] for row in shards[pgs.dp_rank]}
    else:
        rows = shards[pgs.dp_rank]
        header = torch.empty(len(rows), dtype=torch.int64)
        src = dist.get_global_rank(pgs.ctrl, 0)
        if rows:
            dist.recv(header, src=src, group=pgs.ctrl)
        sizes = [int(s) for s in header.tolist()]
        total = sum(s for s in sizes if s > 0) * L * top_k
        flat = torch.empty(total, dtype=dtype)
        if total:
            dist.recv(flat, src=src, group=pgs.ctrl)
        mine, offset = {}, 0
        for row, s in zip(rows, sizes, strict=True):
            if s < 0:
                mine[row] = None
                continue
            n = s * L * top_k
            mine[row] = flat[offset:offset + n].view(L, s, top_k)
            offset += n
    dist.broadcast(have, src=dist.get_global_rank(pgs.ctrl, 0), group=pgs.ctrl)
    for p in policies:
        p.provide_routing(rollout.responses, mine)
    return {"router_replay/rows_with_routing": float(have) / max(B, 1)}
