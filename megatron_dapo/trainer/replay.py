"""R3 (actor.router_replay=r3): the routing SGLang chose for each training row, to the ranks that train it.

Rank 0 received every row's routing from the engine (RolloutBatch.routed_experts: [L_hf, S, K] per row,
S = prompt + response - 1, zeros for a layer without a router). Each rank needs only the rows its
data-parallel rank computes (PolicyModel.shard_rows: the same dealing as compute_log_prob and the update)
and only the MoE layers its pipeline stage routes (PolicyModel.routing_layers). Point to point on the
control group, in two hops, so that rank 0 sends each row once:

1. rank 0 -> the leader of each data-parallel replica (its lowest rank): that replica's rows, every MoE layer;
2. each leader (rank 0 for its own replica) -> each other rank of its replica (its TP, CP and PP peers):
   the same rows, the MoE layers that rank routes. The leaders forward at once, beside each other and beside
   rank 0's later sends; a replica's ranks mostly share a node.

Each message is a header (S per row, -1 for a row without routing, e.g. an aborted request) then each row
as its sender holds it (no copy of a uint8 row with every layer), received into one buffer per rank. Each
rank hands its rows to its policies (actor, reference), which keep their own layers' part.

Bytes rank 0 sends per step: the kept rows' routing once (before: once per rank of each replica, TP x CP x
PP times). At the MoE recipe's TP 2 and a 6.2k mean, 8,192 rows x ~7.2k routed tokens x 48 layers x top-8
x 1 B: 22.7 GB instead of 45.3 GB.

Host memory: rank 0 holds the whole training batch's routing (it received it from the engine) and sends the
rows themselves: no copy when every decoder layer is a MoE layer and ids fit uint8; a leader its replica's
rows, every MoE layer, in one buffer; every other rank its replica's rows, its layers.
`benchmarks/bench_replay_routing.py` measures it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _wire_dtype(num_experts: int) -> torch.dtype:
    return torch.uint8 if num_experts <= 256 else torch.int32  # gloo has no int16


def _send_rows(routing: dict[int, torch.Tensor | None], rows: list[int], dst: int, *, layers: list[int] | None,
               dtype: torch.dtype, group) -> None:
    """Send `rows` of `routing` ([L_moe, S, K] each, or None) to ctrl rank `dst`: the MoE layers `layers`
    (positions along the first dim; None: all). A header, then each row as it is held: no copy of the rows
    (a uint8 row with every layer is sent as is)."""
    header = torch.tensor([-1 if routing[row] is None else routing[row].shape[1] for row in rows], dtype=torch.int64)
    index = None if layers is None else torch.tensor(layers, dtype=torch.long)
    g = dist.get_global_rank(group, dst)
    if header.numel():
        dist.send(header, dst=g, group=group)
    for r in (routing[row] for row in rows):
        if r is not None and r.numel():
            dist.send((r if index is None else r.index_select(0, index)).contiguous().view(-1).to(dtype),
                      dst=g, group=group)


def _recv_rows(rows: list[int], src: int, *, num_layers: int, top_k: int, dtype: torch.dtype,
               group) -> dict[int, torch.Tensor | None]:
    """What `_send_rows` sent from ctrl rank `src`: row -> [num_layers, S, K] (views of one buffer) or None."""
    header = torch.empty(len(rows), dtype=torch.int64)
    g = dist.get_global_rank(group, src)
    if rows:
        dist.recv(header, src=g, group=group)
    sizes = [int(s) for s in header.tolist()]
    flat = torch.empty(sum(s for s in sizes if s > 0) * num_layers * top_k, dtype=dtype)
    out, offset = {}, 0
    for row, s in zip(rows, sizes, strict=True):
        if s < 0:
            out[row] = None
            continue
        n = s * num_layers * top_k
        if n:
            dist.recv(flat[offset:offset + n], src=g, group=group)
        out[row] = flat[offset:offset + n].view(num_layers, s, top_k)
        offset += n
    return out


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
    B, ctrl = len(rollout), pgs.ctrl
    shards, _ = policy.shard_rows(rollout.prompt_length, rollout.response_length, policy.row_groups(B))
    world, me = dist.get_world_size(ctrl), dist.get_rank(ctrl)
    needed = sorted(set().union(*(p.routing_layers() for p in policies)))
    every = [None] * world  # per ctrl rank: (its data-parallel rank, the MoE layers it routes)
    dist.all_gather_object(every, (pgs.dp_rank, needed), group=ctrl)
    replicas: dict[int, list[int]] = {}  # data-parallel rank -> its ctrl ranks, ascending: the first leads
    for rank, (dp, _) in enumerate(every):
        replicas.setdefault(dp, []).append(rank)
    peers = replicas[pgs.dp_rank]
    L, dtype, rows = len(moe_layers), _wire_dtype(num_experts), shards[pgs.dp_rank]
    have = torch.zeros(1, dtype=torch.int64)
    wire = dict(dtype=dtype, group=ctrl)
    if me == 0:
        routing = rollout.routed_experts or [None] * B
        expected = (rollout.prompt_length + rollout.response_length - 1).tolist()
        for row, r in enumerate(routing):
            if r is not None and (r.dim() != 3 or r.shape[1] != expected[row] or r.shape[2] != top_k
                                  or r.shape[0] <= max(moe_layers)):
                raise ValueError(f"actor.router_replay=r3: row {row}: routing of shape {tuple(r.shape)}, expected "
                                 f"[{max(moe_layers) + 1}+ layers, {expected[row]} tokens, top-k {top_k}]")
        index = torch.tensor(moe_layers, dtype=torch.long)
        # every decoder layer routed (Qwen3-MoE): the rows themselves, not a copy of the batch's routing
        moe = {row: None if r is None else r if r.shape[0] == L else r.index_select(0, index)
               for row, r in enumerate(routing)}
        have += sum(r is not None for r in moe.values())
        for dp, ranks in replicas.items():
            if ranks[0] != 0:
                _send_rows(moe, shards[dp], ranks[0], layers=None, **wire)
        full = moe
    elif me == peers[0]:
        full = _recv_rows(rows, 0, num_layers=L, top_k=top_k, **wire)
    if me == peers[0]:  # the leader: its peers' layers of its rows, then its own rows
        for peer in peers[1:]:
            layers = every[peer][1]
            _send_rows(full, rows, peer, layers=None if layers == list(range(L)) else layers, **wire)
        mine, layers = {row: full[row] for row in rows}, None
    else:
        mine, layers = _recv_rows(rows, peers[0], num_layers=len(needed), top_k=top_k, **wire), needed
    dist.broadcast(have, src=dist.get_global_rank(ctrl, 0), group=ctrl)
    for p in policies:
        p.provide_routing(rollout.responses, mine, layers=layers)
    return {"router_replay/rows_with_routing": float(have) / max(B, 1)}
