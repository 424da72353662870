"""torchrun --nproc_per_node 4: tiny_moe at DP 4 x EP 2 with shards whose token-budget packing gives
EP partners different micro-batch counts (see test_actor_shapes_mp.py)."""

import json
import sys

import torch

from megatron_dapo.config import load_config
from megatron_dapo.models.weights import load_canonical_state
from megatron_dapo.parallel import destroy_parallel, init_parallel
from megatron_dapo.workers.build import build_actor
from megatron_dapo.workers.policy import PolicyModel
from tests.workers._actor_cases import PAD, VOCAB, overrides, policy_batch
from tests.workers.test_actor_shapes_mp import MOE_OVERRIDES, moe_batch


def main(out_dir: str) -> None:
    raw = moe_batch()
    pgs = init_parallel(ep=2, etp=1)
    cfg = load_config("configs/tiny_cpu.yaml", overrides(**{"trainer.n_gpus_per_node": 4,
                                                            "parallel.expert_model_parallel_size": 2, **MOE_OVERRIDES}))
    a = build_actor(cfg, pgs, vocab_size=VOCAB, pad_id=PAD)
    init = torch.load(f"{out_dir}/init.pt", weights_only=True)
    for chunk in a.policy.chunks:
        load_canonical_state(chunk, init.__getitem__, pgs=pgs)
    local, agreed = [], []
    real = PolicyModel._agreed_counts

    def spy(self, counts):
        local.append(list(counts))
        out = real(self, counts)
        agreed.append(out)
        return out

    PolicyModel._agreed_counts = spy
    lp = a.compute_log_prob(raw["prompt_ids"], raw["prompt_length"], raw["responses"], raw["response_length"])
    m = a.update_policy(policy_batch(a, raw, perturb_old=0.05))
    gathered = [None] * pgs.world_size
    torch.distributed.all_gather_object(gathered, {"local": local, "agreed": agreed})
    if pgs.rank == 0:
        torch.save({"log_probs": lp.log_probs, "pg_loss": m["actor/pg_loss"], "grad_norm": m["actor/grad_norm"]},
                   f"{out_dir}/ep2.pt")
        with open(f"{out_dir}/counts.json", "w") as f:
            json.dump(gathered, f)
    destroy_parallel(destroy_world=True)


if __name__ == "__main__":
    from megatron_dapo.trainer.run import exit_process

    exit_process(main(sys.argv[1]))  # as python -m megatron_dapo.train ends
