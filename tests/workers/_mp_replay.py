"""torchrun --nproc_per_node 4 tests/workers/_mp_replay.py LAYOUT OUT_DIR: router replay at a MoE layout.

    tp2_ep2   TP 2 x DP 2, EP 2, expert-TP 1 (sequence parallel: each router sees half the tokens)
    pp2_ep2   PP 2 x DP 2, EP 2 (each stage holds 2 of the 4 MoE layers), full recompute (the MoE recipe's):
              every layer runs again in the backward pass, after later micro-batches' forwards
    pp2_vpp2_ep2  the same with 2 virtual stages per rank (chunks of one layer: rank 0 holds layers 0 and 2)

`replay_case` is what test_router_replay_mp.py also runs on one process, on the same weights: R2's record
of the old-log-prob pass, then an update after the routers moved, with forward hooks that compare what every
router routed to with the record at every real position of every row (per rank, per layer, per shard);
before the update, a chosen routing replayed in a forward-only pass (R3's path: routing given from outside).
"""

import sys
from collections import deque

import torch
import torch.distributed as dist

from megatron_dapo.workers.routing import RankRouters, seq_first
from tests.workers._actor_cases import policy_batch

LAYOUTS = {"tp2_ep2": (dict(tp=2, ep=2, etp=1), {"parallel.tensor_model_parallel_size": 2,
                                                  "parallel.expert_model_parallel_size": 2,
                                                  "parallel.expert_tensor_parallel_size": 1}),
           "pp2_ep2": (dict(pp=2, ep=2), {"parallel.pipeline_model_parallel_size": 2,
                                          "parallel.expert_model_parallel_size": 2, "model.recompute": "full"}),
           "pp2_vpp2_ep2": (dict(pp=2, ep=2, vpp=2), {"parallel.pipeline_model_parallel_size": 2,
                                                      "parallel.virtual_pipeline_model_parallel_size": 2,
                                                      "parallel.expert_model_parallel_size": 2})}


def chosen_routing(raw: dict, *, layers: int, experts: int, top_k: int, seed: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {row: torch.rand(layers, int(raw["prompt_length"][row] + raw["response_length"][row]), experts,
                            generator=g).argsort(-1)[..., :top_k] for row in range(len(raw["responses"]))}


class RoutedVsRecorded:
    """Forward hooks on this rank's routers: at each real position of each row of the micro-batch being run,
    the experts the router routed to (its routing map) against the recorded ones."""

    def __init__(self, policy, record: dict[int, torch.Tensor]):
        self.layers, self.record = RankRouters(policy.chunks), record
        self.sp = (policy.pgs.tp_size, policy.pgs.tp_rank) if policy.sequence_parallel else None
        self.compared = self.mismatched = self.recomputed = 0
        self.current = None
        self.queued = [deque() for _ in self.layers.flat]  # full recompute: the micro-batch of each forward
        self.hooks = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.layers.flat)]

    def before_forward(self, chunk, mb):
        self.current = mb

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            mb, routing_map = self.current, output[1]
            if not torch.is_grad_enabled():  # a checkpointed forward: recomputed later in the backward pass
                self.queued[layer].append(mb)
            elif self.queued[layer]:
                mb = self.queued[layer].popleft()
                self.recomputed += 1
            if mb.is_filler:
                return
            lo, hi = 0, routing_map.shape[0]
            if self.sp is not None:
                lo = self.sp[1] * routing_map.shape[0]
                hi = lo + routing_map.shape[0]
            for k, row in enumerate(mb.rows.tolist()):
                rec = self.record[row][layer].long()
                idx = seq_first(mb, mb.seq_start[k] + torch.arange(rec.shape[0]))
                mine = (idx >= lo) & (idx < hi)
                expected = torch.zeros(int(mine.sum()), routing_map.shape[1], dtype=torch.bool)
                expected.scatter_(1, rec[mine], True)
                self.mismatched += int((routing_map[idx[mine] - lo].cpu() != expected).any(-1).sum())
                self.compared += int(mine.sum())
        return hook

    def remove(self):
        for h in self.hooks:
            h.remove()


def replay_case(actor, raw: dict) -> dict:
    """Everything the layouts are compared on (per rank: the rows and layers it holds)."""
    policy = actor.policy
    layers = RankRouters(policy.chunks)
    batch = policy_batch(actor, raw, perturb_old=0.05)  # compute_log_prob: records (r2)
    recorded = policy._routing
    record = dict(recorded["rows"])
    # a chosen routing replayed in a forward-only pass (before the update: an optimizer step after
    # per-micro-batch aux losses would make the layouts' weights differ by design)
    chosen = chosen_routing(raw, layers=layers.total, experts=layers.num_experts, top_k=layers.top_k, seed=5)
    policy.provide_routing(raw["responses"], chosen)
    replayed = actor.compute_log_prob(raw["prompt_ids"], raw["prompt_length"], raw["responses"],
                                      raw["response_length"]).log_probs
    replay_metrics = {k: float(v) for k, v in policy.last_replay_metrics.items()}
    policy._routing = recorded
    with torch.no_grad():  # the routers move: the update's own choices would differ from the record
        for i, r in zip(layers.moe_index, layers.flat):
            r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(100 + i)) * 5)
    check = RoutedVsRecorded(policy, record)
    replay = policy.replay

    def observed(responses):
        rp = replay(responses)
        inner = rp.before_forward
        rp.before_forward = lambda chunk, mb: (check.before_forward(chunk, mb), inner(chunk, mb))
        return rp

    policy.replay = observed
    try:
        metrics = actor.update_policy(batch)
    finally:
        policy.replay = replay
        check.remove()
    return {"old_log_probs": batch.rollout_log_probs, "moe_index": layers.moe_index,
            "record": {row: t.clone() for row, t in record.items()}, "metrics": metrics,
            "compared": check.compared, "mismatched": check.mismatched, "recomputed": check.recomputed, "replayed": replayed,
            "replay_metrics": replay_metrics}


def main(layout: str, out_dir: str) -> None:
    from megatron_dapo.config import load_config
    from megatron_dapo.models.weights import load_canonical_state
    from megatron_dapo.parallel import destroy_parallel, init_parallel
    from megatron_dapo.workers.build import build_actor
    from tests.workers._actor_cases import PAD, VOCAB, overrides
    from tests.workers.test_router_replay_mp import REPLAY_OVERRIDES, replay_batch

    sizes, keys = LAYOUTS[layout]
    pgs = init_parallel(**sizes)
    cfg = load_config("configs/tiny_cpu.yaml", overrides(**{"trainer.n_gpus_per_node": 4, **keys,
                                                            **REPLAY_OVERRIDES}))
    actor = build_actor(cfg, pgs, vocab_size=VOCAB, pad_id=PAD)
    init = torch.load(f"{out_dir}/init.pt", weights_only=True)
    for chunk in actor.policy.chunks:
        load_canonical_state(chunk, init.__getitem__, pgs=pgs)
    out = replay_case(actor, replay_batch())
    out.update(rank=pgs.rank, tp_rank=pgs.tp_rank, pp_rank=pgs.pp_rank, dp_rank=pgs.dp_rank,
               sequence_parallel=actor.policy.sequence_parallel)
    gathered = [None] * pgs.world_size
    dist.all_gather_object(gathered, out)
    if pgs.rank == 0:
        torch.save(gathered, f"{out_dir}/{layout}.pt")
    destroy_parallel(destroy_world=True)


if __name__ == "__main__":
    from megatron_dapo.trainer.run import exit_process

    exit_process(main(sys.argv[1], sys.argv[2]))  # as python -m megatron_dapo.train ends
