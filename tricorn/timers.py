"""Per-phase timers for the training loop (Megatron's ``--timing-log-level``).

The trainer owns one ``Timers`` and hands it to whoever runs a phase (the pipeline executor
gets it through ``StepContext.timers``); there are no module globals. Code marks a phase with

    with timers(OPTIMIZER_STEP):
        optimizer.step()

or ``t = timers(name); t.start(); ...; t.stop()``. Times accumulate until ``read()``, which the
logger calls once per ``--log-interval`` and divides by the iterations in the interval.

Levels:
  0  no phase timers: ``timers(name)`` returns a shared do-nothing timer, so a phase costs one
     method call and a dict lookup. The iteration time is measured by the trainer itself.
  1  phase timers run without ever synchronising the device. On CUDA each start and stop
     records a CUDA event on the current (compute) stream; ``read()`` waits for the last event
     recorded (one ``event.synchronize()`` per log line, in the logging iteration, which reads the
     loss anyway) and sums ``elapsed_time`` over each timer's pairs. A phase's time is therefore
     the span of the compute stream's timeline between its start and its stop: kernels queued by
     the phase, and waits of the compute stream on other streams (NCCL's, for grads-reduce-wait
     and pipeline-p2p-wait) - but not reductions that run concurrently with the compute, so
     overlap shows. A host-only phase (data-loading) reads as the device time it leaves idle.
     On CPU the timers read the wall clock (the host is the device there).
  2  debugging: on CUDA every start and stop calls ``torch.cuda.synchronize()``, which waits on
     every stream, NCCL's included, so each phase absorbs every reduction still in flight and
     overlap reads as zero; use it to find which phase a hang or a slow kernel belongs to. The
     logger also reduces each timer to its min and max over all ranks (one small all-reduce
     per log interval, in logging.py together with the memory figures).

Phases nest: ``pipeline-p2p-wait`` happens inside ``forward-backward``.
No collectives here; no device memory beyond two events per timed phase of an interval
(reused after each read).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Optional, Protocol, Union

import torch

# The phases the trainer and its collaborators time (Megatron-style names).
FORWARD_BACKWARD = "forward-backward"
PIPELINE_P2P_WAIT = "pipeline-p2p-wait"
GRADS_REDUCE_WAIT = "grads-reduce-wait"
OPTIMIZER_STEP = "optimizer-step"
DATA_LOADING = "data-loading"
CHECKPOINT_STALL = "checkpoint-stall"
PHASES = (DATA_LOADING, FORWARD_BACKWARD, PIPELINE_P2P_WAIT, GRADS_REDUCE_WAIT, OPTIMIZER_STEP, CHECKPOINT_STALL)


class Event(Protocol):
    """The part of torch.cuda.Event the event timers use (tests check a stand-in against the real class)."""

    def record(self, stream: Any = None) -> None: ...

    def elapsed_time(self, end_event: Any) -> float: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


EventFactory = Callable[..., Event]  # called as factory(enable_timing=True), like torch.cuda.Event


class Timer:
    """Accumulates the wall time between start() and stop() calls until read (CPU, and level 2 on CUDA)."""

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

    def collect(self, reset: bool) -> float:
        out = self.elapsed_s
        if reset:
            self.elapsed_s = 0.0
        return out

    def __enter__(self) -> Timer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EventPool:
    """Creates timing events, hands back used ones, and remembers the last one recorded: all events are
    recorded on the one compute stream, so once that one has completed, every earlier one has too."""

    def __init__(self, factory: EventFactory):
        self.factory = factory
        self.free: list[Event] = []
        self.last: Optional[Event] = None

    def record(self) -> Event:
        event = self.free.pop() if self.free else self.factory(enable_timing=True)
        event.record()  # the current stream: the one the step's kernels are queued on
        self.last = event
        return event

    def wait_last(self) -> None:
        """Block the host until the device has passed the last recorded event (once per read)."""
        if self.last is not None:
            self.last.synchronize()
            self.last = None


class EventTimer:
    """A phase timed on the compute stream's timeline: one (start, stop) event pair per start/stop call,
    read only after the pool's last event has completed, so ``elapsed_time`` never waits."""

    __slots__ = ("name", "_pool", "_open", "_pairs")

    def __init__(self, name: str, pool: EventPool):
        self.name = name
        self._pool = pool
        self._open: Optional[Event] = None
        self._pairs: list[tuple[Event, Event]] = []

    def start(self) -> None:
        if self._open is not None:
            raise RuntimeError(f"timer '{self.name}' started twice; stop it first")
        self._open = self._pool.record()

    def stop(self) -> None:
        if self._open is None:
            raise RuntimeError(f"timer '{self.name}' stopped without being started")
        self._pairs.append((self._open, self._pool.record()))
        self._open = None

    def collect(self, reset: bool) -> float:
        """Seconds over the recorded pairs; the caller has waited for the pool's last event."""
        out = sum(begin.elapsed_time(end) for begin, end in self._pairs) / 1000.0  # elapsed_time is in ms
        if reset:
            for begin, end in self._pairs:
                self._pool.free += [begin, end]
            self._pairs.clear()
        return out

    def __enter__(self) -> EventTimer:
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
AnyTimer = Union[Timer, EventTimer, NullTimer]


class Timers:
    """Named timers that exist only at or above their level; see the module docstring.

    `event_factory` replaces torch.cuda.Event for the level-1 CUDA timers (a test's stand-in; None: the real one)."""

    def __init__(self, level: int = 0, device: Optional[torch.device] = None, event_factory: Optional[EventFactory] = None):
        self.level = level
        self._timers: dict[str, Union[Timer, EventTimer]] = {}
        cuda = device is not None and torch.device(device).type == "cuda"
        self._sync = torch.cuda.synchronize if cuda and level >= 2 else None
        self._events = EventPool(event_factory or torch.cuda.Event) if cuda and level == 1 else None

    @classmethod
    def disabled(cls) -> Timers:
        """No timer ever runs (the default for code called outside a training iteration)."""
        return cls(level=-1)

    def __call__(self, name: str, level: int = 1) -> AnyTimer:
        if level > self.level:
            return NULL_TIMER
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = EventTimer(name, self._events) if self._events is not None else Timer(name, self._sync)
        return timer

    @property
    def uses_events(self) -> bool:
        return self._events is not None

    @property
    def reduce_across_ranks(self) -> bool:
        return self.level >= 2

    def read(self, reset: bool = True) -> dict[str, float]:
        """Seconds accumulated per timer since the last reset (only timers that exist at this level).
        With CUDA events: one host wait for the last event recorded, then the event pairs' elapsed times."""
        if self._events is not None:
            self._events.wait_last()
        return {name: t.collect(reset) for name, t in self._timers.items()}


NULL_TIMERS = Timers.disabled()
