"""A stand-in for torch.cuda.Event on a CPU-only machine, with the real class's API (tests/test_timers.py checks
the signatures against torch.cuda.Event with inspect). On CPU the host is the device: record() takes the wall
clock. Every call is appended to a shared journal, so a test can tell when the events were read."""

from __future__ import annotations

import time
from typing import Any, Optional

JOURNAL: list[str] = []  # "record", "elapsed_time", "synchronize", "query", and the test's own markers


class FakeEvent:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, external: bool = False):
        if not enable_timing:
            raise AssertionError("a timing event needs enable_timing=True (elapsed_time refuses otherwise)")
        self.enable_timing = enable_timing
        self.at: Optional[float] = None

    def record(self, stream: Any = None) -> None:
        JOURNAL.append("record")
        self.at = time.perf_counter()

    def elapsed_time(self, end_event: FakeEvent) -> float:
        JOURNAL.append("elapsed_time")
        if self.at is None or end_event.at is None:
            raise RuntimeError("elapsed_time on an event that was not recorded")  # what CUDA says too
        return 1000.0 * (end_event.at - self.at)

    def synchronize(self) -> None:
        JOURNAL.append("synchronize")

    def query(self) -> bool:
        JOURNAL.append("query")
        return self.at is not None
