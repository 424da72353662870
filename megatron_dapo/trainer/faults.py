"""Fault injection for crash-recovery tests: a process SIGKILLs itself at a named point.

    MEGATRON_DAPO_FAULT=after_reward:3 python -m megatron_dapo.train ... queue.enable=true

makes the process that reaches `maybe_crash("after_reward", 3)` kill itself with SIGKILL: no
`finally`, no atexit, no flush, exactly what an OOM kill or a lost node does. With
`MEGATRON_DAPO_FAULT_SIGNAL=SIGTERM` (or SIGUSR1, SIGINT) the process sends itself that signal instead and
goes on, as a preemption notice arriving at that moment would (trainer/preemption.py); with
`MEGATRON_DAPO_FAULT_RANK=r` only the process of global rank r (torchrun's RANK) acts. Without the variable
(every normal run) `maybe_crash` is one dict lookup. The value is `<point>:<step>`, or several
joined by commas. When `MEGATRON_DAPO_FAULT_ONCE` names a file, a fault fires only if that file
can still be created (O_EXCL), so a point that a restarted process reaches again (a producer
restarted by the trainer inherits the environment) crashes exactly once.

Named points (`step` is the trainer step the work belongs to):
    generation            responses generated, not yet scored (sync trainer; queue trainer's
                          in-process producer: the claimed prompts are `running` in the queue)
    producer_generation   the same point in a producer process (async mode); step = the prompt's
                          global_steps tag
    after_reward          rewards computed (queue trainer: rm_scores written), before old_log_prob
    after_old_log_prob    sync trainer: old log-probs computed, before the update
    update_actor          inside the actor update after its first optimizer step (installed by
                          tests/trainer/_fault_run.py around the optimizer)
    after_update_actor    the update finished; the step is not committed / checkpointed yet
    after_commit          queue trainer: the step's prompts are consumed, before the checkpoint
    weight_sync           queue trainer, async mode on SGLang: generation paused (or drained) for the
                          push of version `step`, nothing pushed yet
    checkpoint_write      inside save_checkpoint: the model shards are written into
                          tmp_global_step_<k>, the rename to global_step_<k> has not happened
                          (trainer.async_save: when the save is completed, after its writer ended)
    background_write      trainer.async_save: in the writer process, before it writes; it SIGKILLs
                          the trainer (its parent), as a trainer lost in the middle of a background save
"""

from __future__ import annotations

import os
import signal

ENV = "MEGATRON_DAPO_FAULT"
ONCE_ENV = "MEGATRON_DAPO_FAULT_ONCE"
SIGNAL_ENV = "MEGATRON_DAPO_FAULT_SIGNAL"
RANK_ENV = "MEGATRON_DAPO_FAULT_RANK"

POINTS = ("generation", "producer_generation", "after_reward", "after_old_log_prob", "update_actor",
          "after_update_actor", "after_commit", "weight_sync", "checkpoint_write", "background_write")


def parse_spec(text: str) -> set[tuple[str, int]]:
    """`"after_reward:3,generation:2"` -> {("after_reward", 3), ("generation", 2)}; bad specs raise naming the part."""
    out = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        point, sep, step = part.partition(":")
        if not sep or point not in POINTS or not step.isdigit():
            raise ValueError(f"{ENV}={text!r}: part {part!r} is not '<point>:<step>' with a point in {POINTS} "
                             f"and a step >= 0")
        out.add((point, int(step)))
    return out


def armed(point: str, step: int) -> bool:
    """True when the environment asks for a crash at (point, step)."""
    text = os.environ.get(ENV)
    return bool(text) and (point, int(step)) in parse_spec(text)


def maybe_crash(point: str, step: int) -> None:
    """SIGKILL this process when `MEGATRON_DAPO_FAULT` names (point, step) (see the module docstring)."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}: expected one of {POINTS}")
    if not armed(point, step):
        return
    rank = os.environ.get(RANK_ENV)
    if rank is not None and rank != os.environ.get("RANK", "0"):
        return
    once = os.environ.get(ONCE_ENV)
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # this fault already fired once
    name = os.environ.get(SIGNAL_ENV)
    if name:
        if name not in ("SIGTERM", "SIGUSR1", "SIGINT"):
            raise ValueError(f"{SIGNAL_ENV}={name!r}: expected SIGTERM, SIGUSR1 or SIGINT")
        signal.raise_signal(getattr(signal, name))  # the handler runs before this returns
        return
    os.kill(os.getpid(), signal.SIGKILL)
