"""Exit conditions: a signal (SLURM's preemption SIGTERM), a time limit, an iteration interval.

--exit-signal-handler installs a handler for --exit-signal that only sets a
flag; nothing is interrupted mid-iteration. At the end of every iteration the
trainer asks `check()`: all ranks agree through one all-reduce (MAX) of
[signal seen, time limit reached] over the world, because a signal or a clock
may reach one rank earlier than another and every rank must stop after the
same iteration (the checkpoint is collective). --exit-interval needs no
agreement (the iteration is the same everywhere).

Collectives: one 2-element all-reduce per iteration, only when the signal
handler or the duration limit is on. No memory effect.
"""

from __future__ import annotations

import signal
import time
from typing import Optional

import torch
import torch.distributed as dist

from tricorn.config import Config


class ExitConditions:
    def __init__(self, cfg: Config, install: bool = True):
        t = cfg.training
        self.signal_name = t.exit_signal if t.exit_signal_handler else None
        self.duration_s = t.exit_duration_in_mins * 60.0 if t.exit_duration_in_mins else None
        self.interval = t.exit_interval
        self.start = time.monotonic()
        self.received = False
        self.previous_handler = None
        if self.signal_name and install:
            self.previous_handler = signal.signal(getattr(signal, self.signal_name), self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        self.received = True  # acted on at the end of the current iteration, on every rank at once

    @property
    def needs_agreement(self) -> bool:
        return self.signal_name is not None or self.duration_s is not None

    def check(self, iteration: int, device: torch.device = torch.device("cpu")) -> Optional[str]:
        """Why to stop after `iteration` (the same answer on every rank), or None."""
        if self.needs_agreement:
            late = self.duration_s is not None and time.monotonic() - self.start >= self.duration_s
            flags = torch.tensor([float(self.received), float(late)], device=device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            if flags[0].item() > 0:
                return f"received {self.signal_name}"
            if flags[1].item() > 0:
                return f"--exit-duration-in-mins {self.duration_s / 60:g} reached"
        if self.interval and iteration % self.interval == 0:
            return f"--exit-interval {self.interval}"
        return None

    def restore(self) -> None:
        if self.signal_name and self.previous_handler is not None:
            signal.signal(getattr(signal, self.signal_name), self.previous_handler)
