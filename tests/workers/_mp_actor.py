"""torchrun --nproc_per_node 2: DP=2 update, TP=2 log-probs, then a PP=2 update (see test_actor.py)."""

import sys

import torch

from megatron_dapo.config import load_config
from megatron_dapo.models.weights import load_canonical_state
from megatron_dapo.parallel import destroy_parallel, init_parallel
from megatron_dapo.workers.build import build_actor
from tests.workers._actor_cases import (
    PAD,
    VOCAB,
    capture_grads,
    flat_params,
    overrides,
    policy_batch,
    random_batch,
)


def main(out_dir: str) -> None:
    raw = random_batch(seed=3)
    pgs = init_parallel()
    cfg = load_config("configs/tiny_cpu.yaml", overrides(**{"trainer.n_gpus_per_node": 2}))
    a = build_actor(cfg, pgs, vocab_size=VOCAB, pad_id=PAD)
    grads = capture_grads(a)
    a.update_policy(policy_batch(a, raw, perturb_old=0.05))
    if pgs.rank == 0:
        torch.save({"params": flat_params(a), "grads": grads}, f"{out_dir}/dp2.pt")
    destroy_parallel()
    pgs = init_parallel(tp=2)
    cfg = load_config("configs/tiny_cpu.yaml", overrides(**{"trainer.n_gpus_per_node": 2,
                                                            "parallel.tensor_model_parallel_size": 2}))
    a = build_actor(cfg, pgs, vocab_size=VOCAB, pad_id=PAD)
    lp = a.compute_log_prob(raw["prompt_ids"], raw["prompt_length"], raw["responses"], raw["response_length"])
    if pgs.rank == 0:
        torch.save({"log_probs": lp.log_probs}, f"{out_dir}/tp2.pt")
    destroy_parallel()
    # PP=2 through the trainer's own build (variable_seq_lengths on a dense model), loaded with the
    # single-process actor's initial weights: log-probs and the update's loss / grad norm equal it.
    pgs = init_parallel(pp=2)
    cfg = load_config("configs/tiny_cpu.yaml", overrides(**{"trainer.n_gpus_per_node": 2,
                                                            "parallel.pipeline_model_parallel_size": 2}))
    a = build_actor(cfg, pgs, vocab_size=VOCAB, pad_id=PAD)
    init = torch.load(f"{out_dir}/init.pt", weights_only=True)
    for chunk in a.policy.chunks:
        load_canonical_state(chunk, init.__getitem__, pgs=pgs)
    lp = a.compute_log_prob(raw["prompt_ids"], raw["prompt_length"], raw["responses"], raw["response_length"])
    m = a.update_policy(policy_batch(a, raw, perturb_old=0.05))
    if pgs.rank == 0:
        torch.save({"log_probs": lp.log_probs, "pg_loss": m["actor/pg_loss"], "grad_norm": m["actor/grad_norm"]},
                   f"{out_dir}/pp2.pt")
    destroy_parallel(destroy_world=True)


if __name__ == "__main__":
    main(sys.argv[1])
