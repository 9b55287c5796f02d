"""gpu_check c's CUDA context figure (tricorn.training.measurements.measure_cuda_context), on the CPU with the
driver's readers faked: used memory before the context exists and after mem_get_info creates it."""

from __future__ import annotations

import pytest
import torch

from tricorn.training import measurements


def _fake_device(monkeypatch: pytest.MonkeyPatch, used: list[int], nvml: bool = True) -> None:
    readings = iter(used)

    def device_memory_used(device: int) -> int:
        if not nvml:
            raise ModuleNotFoundError("pynvml")
        return next(readings)

    monkeypatch.setattr(torch.cuda, "device_memory_used", device_memory_used)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (70 * 2**30, 80 * 2**30))


def test_context_is_the_used_memory_that_init_adds(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_device(monkeypatch, [3 * 2**30, 3 * 2**30 + 500 * 2**20])
    context = measurements.measure_cuda_context()
    assert context.bytes == 500 * 2**20 and "10240 MiB used" in context.how


def test_without_nvml_or_nvidia_smi_the_context_is_not_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_device(monkeypatch, [], nvml=False)
    monkeypatch.setattr(measurements.shutil, "which", lambda _name: None)
    context = measurements.measure_cuda_context()
    assert context.bytes is None and "NVML unavailable" in context.how
