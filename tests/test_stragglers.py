"""The straggler monitor's rules, in process (issue 32, part 4); the 2-rank runs are in tests/test_spikes.py
(run C: a rank slowed by a sleep is named; runs A and B: nobody is)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from fake_cuda_event import JOURNAL, FakeEvent

from tricorn.training import stragglers
from tricorn.training.stragglers import STREAK, StragglerMonitor, grid_position


def fake_state(world: int = 4, rank: int = 0) -> SimpleNamespace:
    mesh = SimpleNamespace(mesh=torch.arange(world).reshape(1, world // 2, 1, 2), mesh_dim_names=("pp", "dp", "cp", "tp"))
    return SimpleNamespace(world_size=world, rank=rank, device=torch.device("cpu"), mesh=mesh)


@pytest.fixture
def warnings(monkeypatch) -> list[str]:
    lines: list[str] = []
    monkeypatch.setattr(stragglers, "warn", lines.append)
    return lines


def test_a_rank_slow_for_three_intervals_in_a_row_is_named_once(warnings):
    monitor = StragglerMonitor(1.2, fake_state(), log_dir="logs")
    even, slow3 = [0.10, 0.10, 0.11, 0.10], [0.10, 0.10, 0.10, 0.15]
    for it, times in enumerate([slow3, slow3, even, slow3, slow3, slow3, slow3], start=1):
        report = monitor.report(times, it)
        if it <= 2:
            assert not warnings, "a streak of 2 is not enough"
    assert len(warnings) == 1, warnings  # named at the 3rd interval in a row (6), not again at the 4th (7)
    assert warnings[0].startswith("straggler: rank 3 (pp0 dp1 cp0 tp1) 150.0 ms (x1.50) of own work per iteration")
    assert "for 3 log intervals in a row (up to iteration 6); logs: logs/rank-00003.log" in warnings[0]
    assert (report.slowest_rank, report.slowest, report.median) == (3, 0.15, 0.10)
    assert report.console() == "slowest rank: 3 (150.0 ms, median 100.0 ms)"


def test_even_ranks_and_other_ranks_stay_silent(warnings):
    for rank in (0, 1):
        monitor = StragglerMonitor(1.2, fake_state(rank=rank))
        for it in range(1, 3 * STREAK):
            monitor.report([0.10, 0.11, 0.105, 0.119] if rank == 0 else [0.1, 0.1, 0.1, 0.5], it)
    assert warnings == [], "ranks within the factor are nobody's business, and only rank 0 warns"


def test_grid_position_names_every_dimension():
    assert [grid_position(fake_state(8).mesh, r) for r in (0, 5)] == ["pp0 dp0 cp0 tp0", "pp0 dp2 cp0 tp1"]


def test_cuda_spans_are_event_pairs_read_at_the_log_line(monkeypatch):
    """On CUDA the spans record events (never the host clock) and are read only after the last event completed."""
    monkeypatch.setenv(stragglers.SLOW_RANK, "0")
    monkeypatch.setenv(stragglers.SLOW_RANK_SLEEP_S, "0.02")
    monitor = StragglerMonitor(1.2, fake_state(), event_factory=FakeEvent)
    JOURNAL.clear()
    for _ in range(3):
        with monitor.span():
            pass
    assert JOURNAL == ["record"] * 6, "a span costs two event records and no host wait"
    monitor.pool.wait_last()
    seconds = monitor.timer.collect(reset=True)
    assert JOURNAL[6:] == ["synchronize"] + ["elapsed_time"] * 3
    assert 0.06 <= seconds < 1.0, seconds  # three injected 20 ms sleeps (the test hook) inside the spans


def test_cpu_spans_use_the_wall_clock():
    monitor = StragglerMonitor(1.2, fake_state())
    start = time.perf_counter()
    with monitor.span():
        time.sleep(0.01)
    assert 0.01 <= monitor.timer.collect(reset=True) <= time.perf_counter() - start
