"""Run by test_trainer_export.py under `torchrun --nproc_per_node 4` (gloo, CPU): the trainer's actor at a
parallel layout writes a checkpoint, and its own forward gives the reference log-probs of a probe.

    dense  tiny      TP=2 x PP=2   (DP=1)
    moe    tiny_moe  TP=2 x EP=2   (expert TP=2, sequence parallel; dense DP=2, expert DP=1)

Writes OUT/runs/exp/config.yaml and OUT/runs/exp/ckpt/global_step_3 as the trainer does
(trainer.run.build_trainer and trainer.checkpoint.save_checkpoint), and OUT/probe.safetensors:
{"input_ids": [B, S], "log_probs": [V, B, S]}, log_probs[v, b, s] = log softmax(logits[b, s])[v] from
Megatron's pipeline schedule over the actor's own chunks (temperature 1), one micro-batch per label v.

The weights are moved off their seeded initialisation (noise seeded by each parameter's name, so the
copies that TP / DP ranks hold of a replicated tensor stay equal): an exporter that silently rebuilt
the model from the seed would not match.
"""

import argparse
import os
import zlib

import torch
from safetensors.torch import save_file

from megatron_dapo.config import load_config, to_yaml
from megatron_dapo.data.tokenizer import load_tokenizer
from megatron_dapo.models.forward import Microbatch, forward_only_logprobs, unwrap_model
from megatron_dapo.parallel import destroy_parallel, init_parallel
from megatron_dapo.trainer.checkpoint import save_checkpoint
from megatron_dapo.workers.build import build_actor

LAYOUTS = {
    "dense": ({"model.arch": "tiny", "parallel.tensor_model_parallel_size": 2,
               "parallel.pipeline_model_parallel_size": 2}, {"tp": 2, "pp": 2}),
    "moe": ({"model.arch": "tiny_moe", "parallel.tensor_model_parallel_size": 2,
             "parallel.expert_model_parallel_size": 2, "parallel.expert_tensor_parallel_size": 1},
            {"tp": 2, "ep": 2, "etp": 1}),
}
STEP, B, S = 3, 2, 12


def main(case: str, out: str) -> None:
    layout, sizes = LAYOUTS[case]
    pgs = init_parallel(**sizes, backend="gloo")
    overrides = {**layout, "trainer.n_gpus_per_node": 4, "trainer.output_dir": os.path.join(out, "runs"),
                 "trainer.experiment_name": "exp", "data.train_batch_size": 4, "data.gen_batch_size": 4,
                 "actor.ppo_mini_batch_size": 2, "rollout.n": 4}
    cfg = load_config("configs/tiny_cpu.yaml", [f"{k}={v}" for k, v in overrides.items()])
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    actor = build_actor(cfg, pgs, vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id)
    chunks = [unwrap_model(c) for c in actor.policy.chunks]
    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))
    if pgs.rank == 0:
        os.makedirs(cfg.run_dir, exist_ok=True)
        with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as f:
            f.write(to_yaml(cfg))
    save_checkpoint(cfg.ckpt_dir, STEP, actor=actor, trainer_state={"global_step": STEP}, keep=2,
                    is_rank0=pgs.rank == 0)

    V = tokenizer.vocab_size
    ids = torch.randint(1, V, (B, S), generator=torch.Generator().manual_seed(7))
    pos = torch.arange(S).expand(B, S)
    microbatches = [Microbatch(ids, pos, torch.full((B, S), v)) for v in range(V)]
    lp = forward_only_logprobs([c.eval() for c in chunks], microbatches, pgs=pgs, temperature=1.0)
    if pgs.rank == 0:
        save_file({"input_ids": ids.contiguous(), "log_probs": torch.stack(lp).float().contiguous()},
                  os.path.join(out, "probe.safetensors"))
    destroy_parallel(destroy_world=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=sorted(LAYOUTS), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from megatron_dapo.trainer.run import exit_process

    exit_process(main(args.case, args.out))  # as python -m megatron_dapo.train ends
