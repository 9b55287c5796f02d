"""Phase timers that do not serialise the GPU (issue 26, item 5).

At --timing-log-level 1 on CUDA the timers record CUDA events on the compute stream and read them once per log
line; nothing synchronises the device. No GPU here, so the CUDA path runs with a stand-in event
(tests/fake_cuda_event.py) whose API is checked against the real torch.cuda.Event, which imports on a CPU build."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from fake_cuda_event import JOURNAL, FakeEvent
from harness import run_script

from tricorn.timers import FORWARD_BACKWARD, GRADS_REDUCE_WAIT, OPTIMIZER_STEP, EventTimer, Timer, Timers

WORKER = Path(__file__).parent / "workers" / "event_timers.py"


def _params(fn) -> list[tuple[str, object]]:
    """Names and defaults of a callable's parameters, without self/cls (annotations differ and do not matter)."""
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.name not in ("self", "cls", "obj")]


@pytest.mark.parametrize("method", ["record", "elapsed_time", "synchronize", "query"])
def test_fake_event_has_the_api_of_torch_cuda_event(method: str) -> None:
    real, fake = _params(getattr(torch.cuda.Event, method)), _params(getattr(FakeEvent, method))
    # elapsed_time's argument is end_event in torch 2.13; the stand-in must accept it by that name too.
    assert fake == real, f"{method}: stand-in {fake} vs torch.cuda.Event {real}"


def test_fake_event_constructor_matches_torch_cuda_event() -> None:
    # torch.cuda.Event takes its arguments in __new__ (its __init__ is a pass-through).
    assert _params(FakeEvent.__init__) == _params(torch.cuda.Event.__new__)
    assert "enable_timing" in inspect.signature(torch.cuda.Event.__new__).parameters


def test_level1_on_cuda_records_events_and_never_synchronises(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> None:
        raise AssertionError("torch.cuda.synchronize() at level 1")

    monkeypatch.setattr(torch.cuda, "synchronize", fail)
    JOURNAL.clear()
    timers = Timers(1, torch.device("cuda"), event_factory=FakeEvent)
    timer = timers(FORWARD_BACKWARD)
    assert isinstance(timer, EventTimer) and timers.uses_events
    for _ in range(3):  # one interval: three iterations, nothing read yet
        with timer, timers(OPTIMIZER_STEP):
            torch.ones(64).sum()
    assert set(JOURNAL) == {"record"} and len(JOURNAL) == 12
    times = timers.read()
    assert JOURNAL[12:].count("synchronize") == 1 and JOURNAL[12:].count("elapsed_time") == 6
    assert times[FORWARD_BACKWARD] >= times[OPTIMIZER_STEP] > 0  # nested: the outer span holds the inner one
    JOURNAL.clear()
    with timer:
        pass
    assert timers.read()[OPTIMIZER_STEP] == 0.0 and JOURNAL.count("synchronize") == 1  # read resets
    with pytest.raises(RuntimeError, match="started twice"):
        timer.start()
        timer.start()
    timer.stop()
    with pytest.raises(RuntimeError, match="without being started"):
        timer.stop()


def test_events_are_reused_after_each_read() -> None:
    made: list[FakeEvent] = []

    def factory(**kwargs) -> FakeEvent:
        made.append(FakeEvent(**kwargs))
        return made[-1]

    timers = Timers(1, torch.device("cuda"), event_factory=factory)
    for _ in range(5):
        with timers(GRADS_REDUCE_WAIT):
            pass
        timers.read()
    assert len(made) == 2  # one start and one stop event, recycled every interval


def test_level2_on_cuda_synchronises_and_cpu_reads_the_wall_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    syncs: list[int] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    debug = Timers(2, torch.device("cuda"))
    assert not debug.uses_events and debug.reduce_across_ranks
    with debug(FORWARD_BACKWARD):
        pass
    assert len(syncs) == 2  # start and stop: the documented debugging mode
    for level in (1, 2):
        cpu = Timers(level, torch.device("cpu"))
        assert isinstance(cpu(FORWARD_BACKWARD), Timer) and not cpu.uses_events
        with cpu(FORWARD_BACKWARD):
            pass
    assert len(syncs) == 2


def test_a_training_run_reads_the_events_once_per_log_line() -> None:
    flags = ["--timing-log-level", "1", "--train-iters", "6", "--log-interval", "3"]
    out = json.loads(run_script(WORKER, 1, flags, timeout=180).strip().splitlines()[-1])
    journal, phase_times = out["journal"], out["phase_times"]
    inside, reads = False, []
    for entry in journal:
        if entry in ("log-start", "log-end"):
            inside = entry == "log-start"
        elif entry != "record":
            reads.append((entry, inside))
    assert all(inside for _, inside in reads), f"events read inside a step: {reads}"
    assert [e for e, _ in reads].count("synchronize") == 2 == len(phase_times)  # one host wait per log line
    assert journal.count("record") > 6 * 2 * 3  # at least three phases timed in each of six iterations
    for times in phase_times:
        assert times[FORWARD_BACKWARD] > 0 and times[OPTIMIZER_STEP] > 0 and GRADS_REDUCE_WAIT in times
