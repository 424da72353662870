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
(rollout.weight_sync_bucket_mb) and its flattened copy (each bucket travels as one byte tensor); on a node
leader in ipc mode: one bucket.

Seconds: a sync costs per HF tensor as well as per byte (SGLang's load_weights walks its expert mapping for
every tensor; the trainer gathers and names each one): the `sync:` line estimates the step's sync as
tensors x SYNC_US_PER_TENSOR + bytes / SYNC_ASSUMED_GBPS.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dapo.models.arch import ModelArch
from megatron_dapo.plan.params import count_shards

GB = 1e9
SYNC_US_PER_TENSOR = 110.0
"""Microseconds per HF tensor of a sync beyond its bytes, measured at Qwen3-30B-A3B's structure (48 layers x
128 experts, 18,867 tensors, tiny widths) against a real SGLang 0.5.23 CPU server, buckets flattened:
(sync - same-bytes floor) / tensors = (2.09-2.46 s - 0.15-0.27 s) / 18,867 on a 2-core AMD EPYC
(benchmarks/bench_weight_sync.py, docs/benchmarks.md, 2026-12-06). About 40 of it is the server's
load_weights (its scan of the expert mapping per tensor), the rest the trainer's gather and HF naming and the
server's receive; a GPU node's faster host CPU makes it an upper estimate there."""
SYNC_ASSUMED_GBPS = 25.0
"""Bytes term of the estimate: an assumed NCCL broadcast rate per link (not measured here)."""


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
    tensors: int = 0
    """HF tensors one sync sends (sync_tensor_count)."""

    def estimated_seconds(self) -> float:
        return self.tensors * SYNC_US_PER_TENSOR * 1e-6 + self.model_bytes / (SYNC_ASSUMED_GBPS * GB)

    def per_server_rank(self) -> int:
        return self.model_bytes

    def sender_egress(self, stage: int) -> int:
        """Bytes the stage's sender puts on the wire, on gloo (once per receiver); NCCL's ring sends about
        stage_bytes per link instead."""
        receivers = self.server_ranks if self.transport == "distributed" else max(self.nodes - 1, 0)
        return self.stages[stage].stage_bytes * receivers


def sync_tensor_count(arch: ModelArch) -> int:
    """HF tensors of one sync (MTP layers left out): embeddings, final norm and an untied output layer; per
    layer two norms, q / k / v / o (+ their biases, + q / k norms), and an MLP of three matrices, or a router
    plus three per expert (+ a shared expert's three and its gate). 48 x 128-expert Qwen3-MoE: 18,867."""
    attention = 6 + 3 * arch.add_qkv_bias + 2 * arch.qk_layernorm
    moe = 1 + 3 * (arch.num_moe_experts or 0) + (4 if arch.moe_shared_expert_intermediate_size else 0)
    layers = sum(attention + (moe if is_moe else 3) for is_moe in arch.moe_layer_pattern())
    return 2 + arch.untie_embeddings_and_output_weights + layers


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
                          bucket_bytes=bucket_bytes, tensors=sync_tensor_count(arch))


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
    lines.append("  other data-parallel replicas move nothing; extra memory: one parameter + one bucket (and its "
                 "flattened copy) per sender")
    lines.append(f"sync: about {plan.estimated_seconds():.1f} s per step = {plan.tensors:,} HF tensors x "
                 f"{SYNC_US_PER_TENSOR:g} us (per-tensor cost measured on CPU, benchmarks/bench_weight_sync.py) + "
                 f"{plan.model_bytes / GB:.1f} GB at an assumed {SYNC_ASSUMED_GBPS:g} GB/s")
    return "\n".join(lines)
