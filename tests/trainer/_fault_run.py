"""A tiny queue-trainer run that tests/trainer/test_fault_injection.py launches as a real process and
SIGKILLs at an injected point (megatron_dapo/trainer/faults.py: MEGATRON_DAPO_FAULT=<point>:<step>).

    python tests/trainer/_fault_run.py OUT_DIR [key=value ...]

Besides the points inside the queue trainer and the producers, this script installs two that sit in
code owned elsewhere, by wrapping calls from the outside:
    update_actor      after the first optimizer step of a step's actor update (mini-batch 1 of 2)
    checkpoint_write  after the model shards are written into tmp_global_step_<k>, before the rename
A stop signal (trainer/preemption.py) ends it with trainer.preemption_exit_code, as the real entry point
does. On a clean finish it writes OUT_DIR/summary.json: the loss history and a SHA-256 of the final
model parameters, which the tests compare with an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The tiny settings of tests/trainer/test_fit.py, without validation; 4 steps, a checkpoint every 2.
TINY = ["data.train_batch_size=4", "data.gen_batch_size=6", "rollout.n=4", "actor.ppo_mini_batch_size=2",
        "data.max_response_length=6", "reward.overlong_buffer.len=4", "algorithm.filter_groups.metric=seq_reward",
        "data.arithmetic.num_train=200", "data.arithmetic.num_val=8", "trainer.sft_warmup_steps=0",
        "trainer.test_freq=0", "trainer.val_before_train=false", "actor.lr=1e-3", "trainer.logger=[tensorboard]",
        "trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.experiment_name=f", "queue.enable=true"]


def config(out: str, overrides: list[str]):
    from megatron_dapo.config import load_config

    return load_config(str(ROOT / "configs/tiny_cpu.yaml"),
                       TINY + [f"trainer.output_dir={out}", f"trainer.rollout_data_dir={out}/dumps", *overrides])


def install_external_fault_points(trainer) -> None:
    import megatron.core.dist_checkpointing as dcp

    from megatron_dapo.trainer import faults

    real_save, opt = dcp.save, trainer.p.actor.optimizer
    real_step = opt.step
    seen = {}

    def save(*args, **kwargs):
        out = real_save(*args, **kwargs)
        faults.maybe_crash("checkpoint_write", trainer.global_step)
        return out

    def step(*args, **kwargs):
        out = real_step(*args, **kwargs)
        current = trainer.global_step + 1
        seen[current] = seen.get(current, 0) + 1
        if seen[current] == 1:
            faults.maybe_crash("update_actor", current)
        return out

    dcp.save = save
    opt.step = step


def model_sha256(trainer) -> str:
    from megatron_dapo.models.forward import unwrap_model

    h = hashlib.sha256()
    for name, p in sorted(unwrap_model(trainer.p.actor.policy.chunks[0]).named_parameters()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str]) -> int:
    from megatron_dapo.trainer.run import build_trainer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    out, overrides = argv[0], argv[1:]
    cfg = config(out, overrides)
    trainer = build_trainer(cfg)
    install_external_fault_points(trainer)
    from megatron_dapo.trainer.preemption import Preempted

    try:
        trainer.fit()
    except Preempted as e:  # as python -m megatron_dapo.train ends (trainer/run.py)
        logging.getLogger("megatron_dapo").warning("%s", e)
        return cfg.trainer.preemption_exit_code
    finally:
        trainer.p.reward_manager.close()
        if trainer.p.logger is not None:
            trainer.p.logger.close()
    summary = {"global_step": trainer.global_step, "loss_history": trainer.loss_history,
               "model_sha256": model_sha256(trainer)}  # this rank's part of the model under torchrun
    if trainer.p.pgs.rank == 0:
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f)
    return 0


if __name__ == "__main__":
    from megatron_dapo.trainer.run import exit_process

    exit_process(main(sys.argv[1:]))  # as python -m megatron_dapo.train ends
