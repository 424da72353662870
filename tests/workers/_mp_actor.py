"""torchrun --nproc_per_node 2: DP=2 update (unequal per-rank micro-batch plans), DP=2 log-prob
collectives, TP=2 log-probs, a PP=2 update, then PP=2 x VPP=2 with an odd micro-batch count
(see test_actor.py)."""

import sys

import torch
import torch.distributed as dist

from megatron_dapo.config import load_config
from megatron_dapo.models.weights import load_canonical_state
from megatron_dapo.parallel import destroy_parallel, init_parallel
from megatron_dapo.workers.build import build_actor
from megatron_dapo.workers.policy import PolicyModel
from tests.workers._actor_cases import (
    PAD,
    VOCAB,
    capture_grads,
    flat_params,
    overrides,
    policy_batch,
    random_batch,
)

DP2_BUDGET = 16
"""DP=2, balance off: the ranks plan 3 and 4, then 4 and 2 micro-batches for the two mini-batches."""
VPP_BUDGET = 40
"""PP=2 x VPP=2: rows count at the longest length (13, 11), 3 per micro-batch: 3 micro-batches per
mini-batch, rounded up to 4 for the schedule."""


def _spy_counts() -> list:
    seen = []
    real = PolicyModel._agreed_counts

    def spy(self, local):
        out = real(self, local)
        seen.append((list(local), out))
        return out

    PolicyModel._agreed_counts = spy
    return seen


def _load(a, pgs, out_dir):
    init = torch.load(f"{out_dir}/init.pt", weights_only=True)
    for chunk in a.policy.chunks:
        load_canonical_state(chunk, init.__getitem__, pgs=pgs)


def main(out_dir: str) -> None:
    raw = random_batch(seed=3)
    seqs = (raw["prompt_ids"], raw["prompt_length"], raw["responses"], raw["response_length"])
    counts = _spy_counts()
    pgs = init_parallel()
    cfg = load_config("configs/tiny_cpu.yaml", overrides(**{"trainer.n_gpus_per_node": 2}))
    a = build_actor(cfg, pgs, vocab_size=VOCAB, pad_id=PAD)
    a.policy.max_tokens = DP2_BUDGET
    grads = capture_grads(a)
    a.update_policy(policy_batch(a, raw, perturb_old=0.05))
    dp2_counts = [None, None]
    dist.all_gather_object(dp2_counts, counts[-2:])  # the update's two mini-batches
    # compute_log_prob's collectives carry only what was asked for, real tokens only
    gathers = []
    real_all_gather = dist.all_gather
    dist.all_gather = lambda parts, t, **kw: gathers.append(tuple(t.shape)) or real_all_gather(parts, t, **kw)
    a.compute_log_prob(*seqs)
    a.compute_log_prob(*seqs, with_entropy=True, with_sum_sq=True)
    dist.all_gather = real_all_gather
    if pgs.rank == 0:
        torch.save({"params": flat_params(a), "grads": grads, "counts": dp2_counts, "gathers": gathers},
                   f"{out_dir}/dp2.pt")
    destroy_parallel()
    pgs = init_parallel(tp=2)
    cfg = load_config("configs/tiny_cpu.yaml", overrides(**{"trainer.n_gpus_per_node": 2,
                                                            "parallel.tensor_model_parallel_size": 2}))
    a = build_actor(cfg, pgs, vocab_size=VOCAB, pad_id=PAD)
    lp = a.compute_log_prob(*seqs)
    if pgs.rank == 0:
        torch.save({"log_probs": lp.log_probs}, f"{out_dir}/tp2.pt")
    destroy_parallel()
    # PP=2 through the trainer's own build (variable_seq_lengths on a dense model), loaded with the
    # single-process actor's initial weights: log-probs and the update's loss / grad norm equal it.
    for name, extra, budget in (("pp2", {}, None),
                                ("vpp2", {"parallel.virtual_pipeline_model_parallel_size": 2}, VPP_BUDGET)):
        pgs = init_parallel(pp=2, vpp=extra and 2 or None)
        cfg = load_config("configs/tiny_cpu.yaml", overrides(**{"trainer.n_gpus_per_node": 2,
                                                                "parallel.pipeline_model_parallel_size": 2, **extra}))
        a = build_actor(cfg, pgs, vocab_size=VOCAB, pad_id=PAD)
        if budget:
            a.policy.max_tokens = budget
        _load(a, pgs, out_dir)
        del counts[:]
        lp = a.compute_log_prob(*seqs)
        m = a.update_policy(policy_batch(a, raw, perturb_old=0.05))
        if pgs.rank == 0:
            torch.save({"log_probs": lp.log_probs, "pg_loss": m["actor/pg_loss"], "grad_norm": m["actor/grad_norm"],
                        "counts": list(counts)}, f"{out_dir}/{name}.pt")
        destroy_parallel(destroy_world=name == "vpp2")


if __name__ == "__main__":
    from megatron_dapo.trainer.run import exit_process

    exit_process(main(sys.argv[1]))  # as python -m megatron_dapo.train ends
