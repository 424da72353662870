"""Preemption and Ctrl-C: a signal asks the run to stop at the next safe point, with a checkpoint.

The handlers (`trainer.exit_signals`: SIGTERM from Kubernetes or `scancel`, SIGUSR1 that
`sbatch --signal=B:USR1@<s>` sends ahead of the time limit and launch/slurm forwards to the ranks,
SIGINT from a terminal) only record the signal. At each safe point every rank takes part in one
all-reduce of what it recorded over the gloo control group (`pgs.ctrl`), so a signal that reached one
rank stops all of them at the same point:

- the end of a step, after its checkpoint when one was due;
- in the sync trainer, between generation batches of a step, right after the kept groups were saved
  (`ckpt.save_inflight`): the resumed run continues that step without regenerating them;
- in the sync trainer, right after a generation batch the signal cut: on the first signal, rank 0 aborts
  the generation in flight (`on_signal`), the batch returns at once with its unfinished rows aborted, the
  complete groups are scored and saved as kept groups (with dynamic sampling; without it, the batch's
  prompts go back to the sampler) and the cut groups' prompts go back to the front of the sampler, so no
  sample is lost or trained twice. A stop therefore waits for at most the rest of the step's training
  (or the cut generation's scoring) plus the checkpoint write, never for a 20-minute generation.

There the trainer writes a checkpoint of the step reached (unless one exists; none before the first step,
whose kept groups alone resume it) and raises `Preempted`; `python -m megatron_dapo.train` exits with
`trainer.preemption_exit_code` (default 75, EX_TEMPFAIL: try again later), the code the SLURM script
requeues on. A second SIGINT stops at once (KeyboardInterrupt), as pressing Ctrl-C twice should.
A signal that arrives during a checkpoint write lets it finish: the handler never interrupts it.
"""

from __future__ import annotations

import logging
import signal
import threading

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

EXIT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
"""The signals trainer.exit_signals may name."""


class Preempted(Exception):
    """A stop signal was agreed on at a safe point; the checkpoint of `step` is written."""

    def __init__(self, signal_name: str, step: int):
        super().__init__(f"{signal_name} received: stopped after a checkpoint at step {step}")
        self.signal_name, self.step = signal_name, step


class PreemptionWatch:
    """Records the first of `signals` this process receives; `requested()` agrees on it across ranks."""

    def __init__(self, signals=EXIT_SIGNALS, *, group=None, world_size: int = 1, on_signal=None):
        """on_signal: called once, in a thread of its own, when the first signal arrives (the trainer cuts
        the generation in flight with it: trainer/fit.py `_cut_generation`)."""
        unknown = sorted(set(signals) - set(EXIT_SIGNALS))
        if unknown:
            raise ValueError(f"trainer.exit_signals: {unknown} are not among {list(EXIT_SIGNALS)}")
        self.signals, self.group, self.world_size, self.on_signal = tuple(signals), group, world_size, on_signal
        self.received: str | None = None
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():  # Python installs handlers there only
            for name in self.signals:
                num = getattr(signal, name)
                self._previous[num] = signal.signal(num, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if name == "SIGINT" and self.received is not None:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        if self.received is None:
            self.received = name
            log.warning("%s received: the run stops with a checkpoint at the next safe point", name)
            if self.on_signal is not None:  # no network call inside a signal handler: a thread does it
                threading.Thread(target=self._call_on_signal, name="stop-signal", daemon=True).start()

    def _call_on_signal(self) -> None:
        try:
            self.on_signal()
        except Exception as e:  # noqa: BLE001 - the stop still happens at the next safe point
            log.warning("acting on the stop signal failed (%s: %s); the run stops at the next safe point",
                        type(e).__name__, e)

    def requested(self) -> str | None:
        """The signal some rank received (when ranks got different ones, the one latest in EXIT_SIGNALS), or
        None; a collective of every rank of `group` when world_size > 1."""
        mine = EXIT_SIGNALS.index(self.received) + 1 if self.received else 0
        if self.world_size > 1:
            flag = torch.tensor([mine], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            mine = int(flag)
        return EXIT_SIGNALS[mine - 1] if mine else None

    def close(self) -> None:
        """Restore the handlers that were there before."""
        for num, previous in self._previous.items():
            signal.signal(num, previous)
        self._previous.clear()
