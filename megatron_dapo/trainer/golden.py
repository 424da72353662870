"""The golden per-step loss file of a short fixed-seed tiny CPU run (STYLE.md rule 13).

    python -m megatron_dapo.trainer.golden --write    # regenerate tests/assets/losses/tiny_cpu.txt

A refactor must reproduce the file to within `RTOL` (relative, per value); a change to the numerics
updates it in the same commit, with the reason in the commit message. The run is single-threaded
(BLAS results depend on the thread count) and uses the embedded default's recipe with a random model
and small sizes.

Why a tolerance and not bit equality: MKL picks its kernels by processor (AVX2 on one machine, AVX-512
on another), so the same single-threaded run differs in the last bits from machine to machine. Seen:
the step-1 gradient norm 4.196740389 on an AMD EPYC with AVX2 against 4.196740270 here (2.8e-8
relative). `MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default` on this machine reproduces that AVX2
value exactly and moves the others by up to 1.5e-7 relative over the four steps. `RTOL = 1e-6` is
about seven times the largest round-off seen and two orders of magnitude below a deliberate numerics change (1e-4 relative and above changes a value
by at least 100 RTOL; tested in tests/trainer/test_golden.py).
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
             "trainer.total_training_steps=4", "actor.lr=1e-3", "actor.adam_beta2=0.999",
             "trainer.experiment_name=golden"]


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


RTOL = 1e-6
"""Relative tolerance per value (see the module docstring for how it was chosen)."""


def parse_rows(text: str) -> list[tuple[int, float, float]]:
    """The (step, pg_loss, grad_norm) rows of a golden file's text (comment lines skipped)."""
    rows = []
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            step, loss, gnorm = line.split()
            rows.append((int(step), float(loss), float(gnorm)))
    return rows


def mismatches(got, expected, *, rtol: float = RTOL) -> list[str]:
    """One line per value of `got` that is not within `rtol` of `expected` (steps must match exactly)."""
    if [r[0] for r in got] != [r[0] for r in expected]:
        return [f"steps {[r[0] for r in got]} != expected {[r[0] for r in expected]}"]
    out = []
    for (step, *values), (_, *want) in zip(got, expected):
        for name, v, w in zip(("actor/pg_loss", "actor/grad_norm"), values, want):
            if abs(v - w) > rtol * abs(w):
                out.append(f"step {step} {name}: {v:.9e} != {w:.9e} (rel {abs(v - w) / max(abs(w), 1e-30):.1e})")
    return out


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
