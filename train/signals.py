"""Preemption signals: SIGTERM / SIGUSR1 ask the loop to checkpoint and stop at the next step
boundary (Slurm sends SIGUSR1 ahead of a time limit with --signal=USR1@<s>)."""

from __future__ import annotations

import signal

import torch

from .distributed import all_reduce_sum

# Exit codes of k3-train, read by the Slurm glue: finished, stopped after a preemption checkpoint
# (requeue me), or failed.
EXIT_DONE = 0
EXIT_FAILED = 1
EXIT_PREEMPTED = 75  # EX_TEMPFAIL


class PreemptionFlag:
    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1)):
        self.received: int | None = None
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.received = signum

    def agreed(self, device: torch.device) -> bool:
        """True on every rank once any rank received a signal (one small all-reduce)."""
        flag = torch.tensor([1.0 if self.received is not None else 0.0], device=device)
        return bool(all_reduce_sum(flag).item() > 0)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
