"""Bytes moved per weight sync, per rank role, for each transport (rollout/sglang/sync.py).

    python -m megatron_dapo.plan --config configs/dapo_qwen2.5_32b.yaml     # prints this with the memory plan

One sync moves every tensor of every pipeline stage to every server (DESIGN.md, "Weight path"):

1. Gather to each stage's sender (the stage's first rank), one parameter at a time, in the
   training dtype: every other TP rank of the stage's data-parallel replica 0 sends its TP shards
   once (dist.gather, not all_gather); with EP the experts go over expert-TP, then over EP. The sender
   receives what it does not hold itself. Ranks of the other replicas (dp > 0, cp > 0) move nothing.
2. Send, stage after stage:
   - distributed (disaggregated servers, any node): one weight-update group per stage; each server
     TP rank receives the whole model once (sum over stages). A broadcast root sends its stage once
     per link of the collective's tree/ring (NCCL) and once per receiver on gloo.
   - ipc (colocated, CUDA): the sender broadcasts its stage to the first rank of every node (a
     NCCL collective among distinct GPUs), which posts CUDA IPC handles to its node's servers: the
     servers read the tensors from device memory, nothing is copied for them.
Extra memory of a sync on a sender: one parameter being gathered plus one bucket
(rollout.weight_sync_bucket_mb); on a node leader in ipc mode: one bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dapo.models.arch import ModelArch
from megatron_dapo.plan.params import count_shards

GB = 1e9


@dataclass(frozen=True)
class StageTraffic:
    pp_rank: int
    stage_bytes: int
    """The full stage (all experts), training dtype."""
    sender_gathers: int
    """What the stage's sender receives from its TP / EP peers."""
    peer_sends: int
    """What each other TP (or expert) rank of data-parallel replica 0 sends."""


@dataclass(frozen=True)
class WeightSyncPlan:
    transport: str
    stages: tuple[StageTraffic, ...]
    model_bytes: int
    server_ranks: int
    """TP ranks over all servers (each receives the whole model)."""
    nodes: int
    bucket_bytes: int

    def per_server_rank(self) -> int:
        return self.model_bytes

    def sender_egress(self, stage: int) -> int:
        """Bytes the stage's sender puts on the wire, on gloo (once per receiver); NCCL's ring sends about
        stage_bytes per link instead."""
        receivers = self.server_ranks if self.transport == "distributed" else max(self.nodes - 1, 0)
        return self.stages[stage].stage_bytes * receivers


def plan_weight_sync(arch: ModelArch, *, tp: int, pp: int, ep: int = 1, etp: int | None = None,
                     vpp: int | None = None, dtype_bytes: int, transport: str, server_ranks: int,
                     nodes: int = 1, bucket_bytes: int = 512 * 2**20) -> WeightSyncPlan:
    etp = etp or tp
    full = count_shards(arch, tp=1, pp=pp, ep=1, etp=1, vpp=vpp)
    mine = count_shards(arch, tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp)
    stages = []
    for f, m in zip(full, mine, strict=True):
        dense_gather = (f.dense - m.dense) * dtype_bytes
        expert_gather = (f.expert - m.expert) * dtype_bytes
        peers = (tp - 1) if tp > 1 else 0
        expert_peers = etp * ep - 1
        peer = 0
        if peers:
            peer = max(peer, dense_gather // peers)
        if expert_peers:
            peer = max(peer, expert_gather // expert_peers)
        stages.append(StageTraffic(pp_rank=f.pp_rank, stage_bytes=(f.dense + f.expert) * dtype_bytes,
                                   sender_gathers=dense_gather + expert_gather, peer_sends=peer))
    return WeightSyncPlan(transport=transport, stages=tuple(stages),
                          model_bytes=sum(s.stage_bytes for s in stages), server_ranks=server_ranks, nodes=nodes,
                          bucket_bytes=bucket_bytes)


def plan_weight_sync_from_config(cfg, *, arch: ModelArch, device_type: str = "cuda") -> WeightSyncPlan:
    par, r = cfg.parallel, cfg.rollout
    transport = r.weight_transport
    if transport == "auto":
        transport = "ipc" if r.mode == "colocate" and device_type == "cuda" else "distributed"
    servers = len(r.sglang_urls) or max(cfg.trainer.world_size // r.tensor_model_parallel_size, 1)
    return plan_weight_sync(arch, tp=par.tensor_model_parallel_size, pp=par.pipeline_model_parallel_size,
                            ep=par.expert_model_parallel_size, etp=par.expert_tensor_parallel_size,
                            vpp=par.virtual_pipeline_model_parallel_size,
                            dtype_bytes=2 if cfg.model.params_dtype == "bf16" else 4, transport=transport,
                            server_ranks=servers * r.tensor_model_parallel_size, nodes=cfg.trainer.nnodes,
                            bucket_bytes=int(r.weight_sync_bucket_mb * 2**20))


def format_weight_sync(plan: WeightSyncPlan) -> str:
    lines = [f"weight sync ({plan.transport}): {plan.model_bytes / GB:.2f} GB per server TP rank "
             f"({plan.server_ranks} ranks), bucket {plan.bucket_bytes / 2**20:.0f} MiB"]
    for s in plan.stages:
        lines.append(f"  stage {s.pp_rank}: {s.stage_bytes / GB:.2f} GB; its sender gathers "
                     f"{s.sender_gathers / GB:.2f} GB from its TP/EP peers (each sends <= {s.peer_sends / GB:.2f} GB), "
                     f"then broadcasts it (NCCL: about {s.stage_bytes / GB:.2f} GB per link; gloo: once per receiver, "
                     f"{plan.sender_egress(s.pp_rank) / GB:.1f} GB)")
    if plan.transport == "ipc":
        lines.append(f"  ipc: each of {plan.nodes} node leaders receives the model once "
                     f"({plan.model_bytes / GB:.2f} GB) and hands CUDA IPC handles to its node's servers (no copy)")
    lines.append("  other data-parallel replicas move nothing; extra memory: one parameter + one bucket per sender")
    return "\n".join(lines)
