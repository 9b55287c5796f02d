"""CUDA-only branches run on the CPU with torch.cuda's answers faked (bench/cuda_coverage.py lists what is left):
the GPU table lookup, device memory queries, and the NCCL options that carry the group timeout."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from tricorn.parallel import state as state_mod
from tricorn.planning import estimate, hardware
from tricorn.training import measurements

GiB = 1024**3


@pytest.mark.parametrize(
    "name, key", [("NVIDIA H100 80GB HBM3", "h100-80gb"), ("NVIDIA H200", "h200-141gb"), ("NVIDIA L4", None)]
)
def test_gpu_table_key_from_the_device_name(monkeypatch: pytest.MonkeyPatch, name: str, key) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _i: SimpleNamespace(name=name, total_memory=80 * GiB))
    assert hardware.detect_gpu_type() == key
    assert estimate.visible_device_memory() == 80 * GiB


def test_memory_figures_on_cuda_are_the_allocators(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda _d: 3 * GiB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda _d: 5 * GiB)
    assert measurements.memory_bytes(torch.device("cuda", 0)) == (3 * GiB, 5 * GiB)


class FakeNcclOptions:
    """ProcessGroupNCCL.Options' fields that group_options sets (the class exists only in CUDA builds of torch)."""

    def __init__(self, is_high_priority_stream: bool = False) -> None:
        self.is_high_priority_stream = True  # the opposite of what group_options must set
        self._timeout = timedelta(minutes=10)


def test_nccl_groups_get_nccl_options_with_the_world_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_mod, "world_timeout", lambda: timedelta(minutes=45))
    monkeypatch.setattr(state_mod.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(state_mod.dist, "get_world_size", lambda group=None: 8)
    monkeypatch.setattr(state_mod.dist, "ProcessGroupNCCL", SimpleNamespace(Options=FakeNcclOptions), raising=False)
    opts = state_mod.group_options(2)
    assert isinstance(opts, FakeNcclOptions) and opts._timeout == timedelta(minutes=45)
    assert opts.is_high_priority_stream is False
    assert state_mod.group_options(8) is None  # the whole world: DeviceMesh reuses the world group


BASE = "--mock-data --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --vocab-size 500".split()


def test_device_cuda_without_a_gpu_is_refused_in_one_line(capsys: pytest.CaptureFixture) -> None:
    from tricorn.training.main import resolve_config

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as stop:
        resolve_config(BASE + ["--device", "cuda"])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and err.count("\n") == 0 and "no CUDA device is visible" in err


def test_cuda_configs_are_held_to_the_device_memory(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from tricorn.training import main

    monkeypatch.setattr(main, "_cuda_visible", lambda: True)
    monkeypatch.setattr(estimate, "visible_device_memory", lambda: 1 * 1024**2)  # a 1 MiB "GPU": nothing fits
    with pytest.raises(SystemExit):
        main.resolve_config(BASE + ["--device", "cuda"])
    assert "exceeds the device's 0.0 GiB" in capsys.readouterr().err


def test_compiled_runs_report_the_cuda_allocator_peak_without_the_tracker(monkeypatch: pytest.MonkeyPatch) -> None:
    """--torch-compile: no PeakTracker (a dispatch mode would keep dynamo from compiling), but on CUDA the
    allocator's high-water mark is still measured, and the summary line names it."""
    from tricorn.training import memory_report

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda _d: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda _d: 7 * GiB)
    monkeypatch.setattr(memory_report, "PeakTracker", None)  # must not be built
    with memory_report.iteration_peak(None, [], torch.device("cuda", 0), by_kind=False) as peak:
        assert calls == ["reset"]
    assert peak == {"peak_allocated_bytes": 7 * GiB}
    text = memory_report._peak_text([{"rank": 0, **peak}, {"rank": 1, "peak_allocated_bytes": GiB}])
    assert text == " | iteration-1 peak 7168.00 MiB on rank 0 (CUDA allocator)"
