"""How long a run is: trainer.total_training_steps, or trainer.total_epochs passes over the training prompts,
whichever ends first (trainer/fit.py `_done`). A step draws at least one generation batch of
data.gen_batch_size prompts (more when dynamic sampling keeps too few groups), so the epochs hold at most
`gen_batches` steps. verl's keys mean the same, but over the file verl reads: its DAPO recipe's epoch count
is sized for the 1.79M-row published file, which `make data` reduces to ~17.4k distinct problems, so the
same `trainer.total_epochs=1` here ends the run after ~11 generation batches. The preflight refuses such a
configuration by name and the start of a run says which of the two ends it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    prompts: int  # training prompts (after filtering)
    gen_batch: int  # prompts per generation batch
    epochs: int  # trainer.total_epochs
    steps: int  # trainer.total_training_steps

    @property
    def gen_batches(self) -> int:
        """Generation batches the epochs hold (the last one may draw from the next epoch's order)."""
        return -(-self.prompts * self.epochs // self.gen_batch)

    @property
    def epochs_end_first(self) -> bool:
        """The epochs run out before total_training_steps even at one generation batch per step."""
        return self.gen_batches < self.steps

    def describe(self) -> str:
        end = (f"the epochs end it by step {self.gen_batches}" if self.epochs_end_first
               else f"it ends at step {self.steps}")
        return (f"{self.steps} steps (trainer.total_training_steps); {self.prompts:,} training prompts x "
                f"{self.epochs} epochs (trainer.total_epochs) = {self.gen_batches:,} generation batches of "
                f"{self.gen_batch:,}: {end}")

    def problem(self) -> str | None:
        """Why the epochs contradict total_training_steps, naming what to set; None when they do not."""
        if not self.epochs_end_first:
            return None
        need = -(-self.steps * self.gen_batch // self.prompts)
        return (f"trainer.total_epochs={self.epochs} over {self.prompts:,} training prompts is "
                f"{self.gen_batches:,} generation batches of {self.gen_batch:,}, so the run would end by step "
                f"{self.gen_batches} (earlier when dynamic sampling draws several batches a step), before "
                f"trainer.total_training_steps={self.steps}: set trainer.total_epochs={need} or more (more with "
                "dynamic sampling), or lower trainer.total_training_steps")


def schedule(cfg, *, prompts: int) -> Schedule:
    return Schedule(prompts=prompts, gen_batch=cfg.data.effective_gen_batch_size, epochs=cfg.trainer.total_epochs,
                    steps=cfg.trainer.total_training_steps)
