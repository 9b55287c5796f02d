"""Per-phase wall-clock timers for the training loop (Megatron's ``--timing-log-level``).

The trainer owns one ``Timers`` and hands it to whoever runs a phase (the pipeline executor
gets it through ``StepContext.timers``); there are no module globals. Code marks a phase with

    with timers(OPTIMIZER_STEP):
        optimizer.step()

or ``t = timers(name); t.start(); ...; t.stop()``. Times accumulate until ``read()``, which the
logger calls once per ``--log-interval`` and divides by the iterations in the interval.

Levels:
  0  no phase timers: ``timers(name)`` returns a shared do-nothing timer, so a phase costs one
     method call and a dict lookup; no device synchronisation is added. The iteration time is
     measured by the trainer itself.
  1  phase timers run. On CUDA each start and stop synchronises the device, so the kernels
     queued by a phase are inside its interval (this is the cost of level 1 on GPU).
  2  as 1, and the logger reduces each timer to its min and max over all ranks (one small
     all-reduce per log interval, done in logging.py together with the memory figures).

Phases nest: ``pipeline-p2p-wait`` happens inside ``forward-backward``.
No collectives here; no device memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Optional, Union

import torch

# The phases the trainer and its collaborators time (Megatron-style names).
FORWARD_BACKWARD = "forward-backward"
PIPELINE_P2P_WAIT = "pipeline-p2p-wait"
GRADS_REDUCE_WAIT = "grads-reduce-wait"
OPTIMIZER_STEP = "optimizer-step"
DATA_LOADING = "data-loading"
CHECKPOINT_STALL = "checkpoint-stall"
PHASES = (DATA_LOADING, FORWARD_BACKWARD, PIPELINE_P2P_WAIT, GRADS_REDUCE_WAIT, OPTIMIZER_STEP, CHECKPOINT_STALL)


class Timer:
    """Accumulates the wall time between start() and stop() calls until read."""

    __slots__ = ("name", "_sync", "_started", "elapsed_s")

    def __init__(self, name: str, sync: Optional[Callable[[], None]] = None):
        self.name = name
        self._sync = sync
        self._started: Optional[float] = None
        self.elapsed_s = 0.0

    def start(self) -> None:
        if self._started is not None:
            raise RuntimeError(f"timer '{self.name}' started twice; stop it first")
        if self._sync is not None:
            self._sync()
        self._started = time.perf_counter()

    def stop(self) -> None:
        if self._started is None:
            raise RuntimeError(f"timer '{self.name}' stopped without being started")
        if self._sync is not None:
            self._sync()
        self.elapsed_s += time.perf_counter() - self._started
        self._started = None

    def __enter__(self) -> Timer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class NullTimer:
    """What a disabled phase gets: every call does nothing."""

    __slots__ = ()

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def __enter__(self) -> NullTimer:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


NULL_TIMER = NullTimer()
AnyTimer = Union[Timer, NullTimer]


class Timers:
    """Named timers that exist only at or above their level; see the module docstring."""

    def __init__(self, level: int = 0, device: Optional[torch.device] = None):
        self.level = level
        self._timers: dict[str, Timer] = {}
        cuda = device is not None and torch.device(device).type == "cuda"
        self._sync = torch.cuda.synchronize if cuda else None

    @classmethod
    def disabled(cls) -> Timers:
        """No timer ever runs (the default for code called outside a training iteration)."""
        return cls(level=-1)

    def __call__(self, name: str, level: int = 1) -> AnyTimer:
        if level > self.level:
            return NULL_TIMER
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = Timer(name, self._sync)
        return timer

    @property
    def reduce_across_ranks(self) -> bool:
        return self.level >= 2

    def read(self, reset: bool = True) -> dict[str, float]:
        """Seconds accumulated per timer since the last reset (only timers that exist at this level)."""
        out = {name: t.elapsed_s for name, t in self._timers.items()}
        if reset:
            for t in self._timers.values():
                t.elapsed_s = 0.0
        return out


NULL_TIMERS = Timers.disabled()
