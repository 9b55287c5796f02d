"""Stragglers: each rank's own work per iteration, gathered every log interval; a rank that stays slow is named.

Every rank times its own work of each iteration: data loading and forward-backward, the two phases in
which it waits for nobody in a data-parallel layout (the global token count's all-reduce between them, the
gradient-reduction wait and the step's reductions after them are left out: there the healthy ranks wait for
the slow one, so a whole-iteration time is the same on every rank). On CPU the host clock; on CUDA a pair of
CUDA events per phase on the compute stream (timers.py's EventTimer), read at the log line after the
trainer's synchronisation there, so no iteration waits for the host.

At each log line `gather` all-gathers one float per rank (its mean seconds per iteration over the interval)
as one small device tensor, which the trainer reads with its other values in its one host read. `report`
then gives the slowest rank, its time and the median (TensorBoard: straggler-slowest-rank,
straggler-slowest-seconds, straggler-median-seconds; the console line: "slowest rank"), and names, in one warning
line on rank 0, each rank whose time has been above --straggler-factor x the median for STREAK log
intervals in a row (once per such streak), with its grid position and its log file.

Limits: inside a tensor- or context-parallel group (and along a pipeline) the peers wait for each other in
their forward-backward, so a slow rank makes its whole TP/CP group (or pipeline) look slow: the line then
names that group, which still points at the node. One process (world 1) gathers nothing.

Test hook: TRICORN_TEST_SLOW_RANK=R[,R...] (with TRICORN_TEST_SLOW_RANK_SLEEP_S, default 0.05) sleeps that
long inside each timed phase of those ranks. Tests use it; nothing else may.

Collectives: one all-gather of one float per rank over the world per log interval. Memory: that tensor
(world floats); on CUDA two events per timed phase of the interval (reused).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from tricorn.timers import EventFactory, EventPool, EventTimer, Timer
from tricorn.training.logging import rank_log_path, warn

STREAK = 3  # log intervals in a row above the factor before a rank is named
SLOW_RANK = "TRICORN_TEST_SLOW_RANK"
SLOW_RANK_SLEEP_S = "TRICORN_TEST_SLOW_RANK_SLEEP_S"


@dataclass(frozen=True)
class StragglerReport:
    times: list[float]  # seconds of own work per iteration, per world rank
    slowest_rank: int
    median: float

    @property
    def slowest(self) -> float:
        return self.times[self.slowest_rank]

    def scalars(self) -> dict[str, float]:
        return {
            "straggler-slowest-rank": float(self.slowest_rank),
            "straggler-slowest-seconds": self.slowest,
            "straggler-median-seconds": self.median,
        }

    def console(self) -> str:
        return f"slowest rank: {self.slowest_rank} ({1000 * self.slowest:.1f} ms, median {1000 * self.median:.1f} ms)"


def grid_position(mesh: Any, rank: int) -> str:
    """A world rank's coordinates in the device mesh, e.g. "pp0 dp1 cp0 tp0"."""
    coords = (mesh.mesh == rank).nonzero()[0].tolist()  # the mesh is a host tensor of world ranks
    return " ".join(f"{name}{c}" for name, c in zip(mesh.mesh_dim_names, coords))


class StragglerMonitor:
    def __init__(
        self,
        factor: float,
        state: Any,
        log_dir: Optional[str] = None,
        event_factory: Optional[EventFactory] = None,
    ):
        self.factor = factor
        self.state = state
        self.log_dir = log_dir
        cuda = state.device.type == "cuda"
        self.pool = EventPool(event_factory or torch.cuda.Event) if cuda or event_factory is not None else None
        self.timer: Union[Timer, EventTimer] = EventTimer("own-work", self.pool) if self.pool else Timer("own-work")
        self.streak = [0] * state.world_size
        slow = {int(r) for r in os.environ.get(SLOW_RANK, "").split(",") if r.strip()}
        self._sleep_s = float(os.environ.get(SLOW_RANK_SLEEP_S, "0.05")) if state.rank in slow else 0.0

    @classmethod
    def from_config(cls, cfg: Any, state: Any) -> Optional[StragglerMonitor]:
        """None for one process: there is nobody to compare with."""
        return cls(cfg.logging.straggler_factor, state, cfg.logging.log_dir) if state.world_size > 1 else None

    @contextmanager
    def span(self) -> Iterator[None]:
        """Time a phase of this rank's own work (it waits for no peer inside)."""
        with self.timer:
            if self._sleep_s:
                time.sleep(self._sleep_s)
            yield

    def gather(self, iterations: int) -> torch.Tensor:
        """Collective: every rank's mean seconds of own work per iteration since the last gather, on the device."""
        if self.pool is not None:
            self.pool.wait_last()  # the logging iteration has synchronised: this returns at once
        mine = torch.full(
            (1,), self.timer.collect(reset=True) / max(iterations, 1), dtype=torch.float64, device=self.state.device
        )
        parts = [torch.empty_like(mine) for _ in range(self.state.world_size)]
        dist.all_gather(parts, mine)
        return torch.cat(parts)

    def report(self, times: list[float], iteration: int) -> StragglerReport:
        """Slowest rank and median of the gathered times; names ranks slow for STREAK intervals (rank 0 warns)."""
        median = statistics.median(times)
        slowest = max(range(len(times)), key=lambda r: times[r])
        named = []
        for r, t in enumerate(times):
            self.streak[r] = self.streak[r] + 1 if median > 0 and t > self.factor * median else 0
            if self.streak[r] == STREAK:
                named.append(r)
        if named and self.state.rank == 0:
            warn(self._line(named, times, median, iteration))
        return StragglerReport(list(times), slowest, median)

    def _line(self, named: list[int], times: list[float], median: float, iteration: int) -> str:
        ranks = ", ".join(
            f"rank {r} ({grid_position(self.state.mesh, r)}) {1000 * times[r]:.1f} ms (x{times[r] / median:.2f})" for r in named
        )
        logs = f"; logs: {', '.join(rank_log_path(self.log_dir, r) for r in named)}" if self.log_dir else ""
        return (
            f"straggler: {ranks} of own work per iteration (data loading + forward-backward) vs the median "
            f"{1000 * median:.1f} ms, above --straggler-factor {self.factor:g} x the median for {STREAK} log intervals "
            f"in a row (up to iteration {iteration}){logs}"
        )
