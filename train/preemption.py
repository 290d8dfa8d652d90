"""Stopping on a signal without losing steps: SIGTERM (Slurm pre-emption, ``kill``, torchrun passing its own on),
SIGINT (Ctrl-C), SIGUSR1 (what ``#SBATCH --signal=USR1@...`` sends ahead of a time limit) and SIGHUP (the terminal or
ssh session the run was started from went away; its default action would kill the run mid-step).

A signal only raises a flag (a Python handler runs between bytecodes of the main thread, so it must not write files
or enter a collective). The loop reads the flag once per step, after the optimizer step, agreed over all ranks (one
rank signalled is enough: every rank stops at the same step); it then writes a checkpoint, logs one line and raises
``Preempted``, a ``SystemExit`` whose code is the shell's convention for death by that signal (128 + its number:
143 for SIGTERM, 130 for SIGINT, 129 for SIGHUP), so launchers and Slurm read the exit as they would a kill. Rerunning the same
command resumes from that checkpoint exactly. A second Ctrl-C stops at once, without saving.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator

import torch

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)


class Preempted(SystemExit):
    """A run stopped by a signal after checkpointing its last finished step; ``code`` is 128 + the signal number."""

    def __init__(self, signum: int, step: int):
        super().__init__(128 + signum)
        self.signum, self.step = signum, step


class StopFlag:
    """The signal received since ``stop_on_signals`` began, if any (``signum``: 0 while none)."""

    def __init__(self):
        self.signum = 0

    def _handle(self, signum, frame) -> None:
        if self.signum and signum == signal.SIGINT:  # a second Ctrl-C: the user will not wait for the checkpoint
            raise KeyboardInterrupt
        self.signum = self.signum or signum

    def agreed(self, engine) -> int:
        """The signal any rank received (the lowest-numbered if several), the same on every rank: a collective when
        there are several ranks, so every rank must call it at the same point of the same step."""
        if engine.world_size == 1:
            return self.signum
        seen = torch.zeros(len(SIGNALS), device=engine.device)
        if self.signum:
            seen[SIGNALS.index(self.signum)] = 1
        seen = engine.all_reduce_sum(seen)
        return next((int(s) for s, n in zip(SIGNALS, seen.tolist()) if n > 0), 0)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """Catch ``SIGNALS`` for the ``with`` block (the training steps), then restore the previous handlers. Outside
    the main thread (where Python cannot install handlers) the flag simply never rises."""
    flag, previous = StopFlag(), {}
    try:
        for sig in SIGNALS:
            previous[sig] = signal.signal(sig, flag._handle)
    except ValueError:  # not the main thread
        pass
    try:
        yield flag
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stopped_line(signum: int, step: int, steps: int, checkpoint) -> str:
    return (f"received {signal.Signals(signum).name}: stopped after step {step} of {steps} with its checkpoint "
            f"{checkpoint}; rerun the same command (same hydra.run.dir) to resume exactly from it")
