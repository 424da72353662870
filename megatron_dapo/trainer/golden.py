"""The golden per-step loss file of a short fixed-seed tiny CPU run (STYLE.md rule 13).

    python -m megatron_dapo.trainer.golden --write    # regenerate tests/assets/losses/tiny_cpu.txt

A refactor must reproduce the file exactly; a change to the numerics updates it in the same commit,
with the reason in the commit message. The run is single-threaded (BLAS results depend on the
thread count) and uses the embedded default's recipe with a random model and small sizes.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "assets", "losses", "tiny_cpu.txt")
OVERRIDES = ["data.train_batch_size=4", "data.gen_batch_size=6", "rollout.n=4", "actor.ppo_mini_batch_size=2",
             "data.max_response_length=6", "reward.overlong_buffer.len=4", "algorithm.filter_groups.metric=seq_reward",
             "data.arithmetic.num_train=200", "data.arithmetic.num_val=8", "trainer.sft_warmup_steps=0",
             "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.logger=[]",
             "trainer.total_training_steps=4", "actor.lr=1e-3", "trainer.experiment_name=golden"]


def golden_losses() -> list[tuple[int, float, float]]:
    """(step, actor/pg_loss, actor/grad_norm) of the golden run."""
    from megatron_dapo.config import load_config
    from megatron_dapo.trainer.fit import DAPOTrainer
    from megatron_dapo.trainer.run import build_parts

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as out:
            root = os.path.join(os.path.dirname(__file__), "..", "..")
            cfg = load_config(os.path.join(root, "configs", "tiny_cpu.yaml"), OVERRIDES + [f"trainer.output_dir={out}"])
            parts = build_parts(cfg)
            trainer = DAPOTrainer(cfg, parts)
            rows = []
            real = parts.actor.update_policy

            def record(batch):
                m = real(batch)
                rows.append((trainer.global_step + 1, m["actor/pg_loss"], m["actor/grad_norm"]))
                return m

            parts.actor.update_policy = record
            try:
                trainer.fit()
            finally:
                parts.reward_manager.close()
            return rows
    finally:
        torch.set_num_threads(threads)


def format_rows(rows) -> str:
    return "".join(f"{step} {loss:.9e} {gnorm:.9e}\n" for step, loss, gnorm in rows)


def main(argv: list[str]) -> int:
    text = format_rows(golden_losses())
    if argv[:1] == ["--write"]:
        with open(GOLDEN, "w") as f:
            f.write("# step actor/pg_loss actor/grad_norm  (python -m megatron_dapo.trainer.golden --write)\n" + text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
