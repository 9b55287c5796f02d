"""TF32 (issue 26, item 6): fp32 runs on CUDA put their matmuls on TF32 tensor cores unless --no-tf32, and MFU is
measured against the peak of what the matmuls run on. No GPU here: configure_tf32 is called with a CUDA device
(torch's flags are plain settings on a CPU build), and the logger's peak is read with a CUDA device and a GPU
type forced."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tricorn.config_args import config_from_args
from tricorn.parallel.state import configure_tf32
from tricorn.planning.hardware import GPUS, mfu_dtype, peak_tflops

FLAGS = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --vocab-size 500".split()
CUDA = torch.device("cuda", 0)


@pytest.fixture
def restore_flags() -> Iterator[None]:
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.usefixtures("restore_flags")
def test_fp32_on_cuda_enables_tf32_and_no_tf32_turns_it_off() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    assert configure_tf32(config_from_args(FLAGS, world_size=1), CUDA)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "high"  # the same setting seen through torch's other API
    assert not configure_tf32(config_from_args(FLAGS + ["--no-tf32"], world_size=1), CUDA)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


@pytest.mark.usefixtures("restore_flags")
def test_bf16_and_cpu_runs_leave_torch_defaults() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    assert not configure_tf32(config_from_args(FLAGS + ["--bf16"], world_size=1), CUDA)
    assert not configure_tf32(config_from_args(FLAGS, world_size=1), torch.device("cpu"))
    assert not torch.backends.cuda.matmul.allow_tf32


def test_no_tf32_is_a_config_field_default_on() -> None:
    assert config_from_args(FLAGS, world_size=1).training.tf32 is True
    assert config_from_args(FLAGS + ["--no-tf32"], world_size=1).training.tf32 is False


def test_mfu_peak_follows_the_matmul_precision() -> None:
    assert mfu_dtype("fp32", fp8=False, tf32=True) == "tf32" and mfu_dtype("fp32", fp8=False, tf32=False) == "fp32"
    assert mfu_dtype("bf16", fp8=False, tf32=False) == "bf16" and mfu_dtype("bf16", fp8=True, tf32=True) == "fp8"
    assert peak_tflops("h100-80gb", "tf32") == GPUS["h100-80gb"].tf32_tflops == 494
    assert peak_tflops("h100-80gb", "fp32") == GPUS["h100-80gb"].fp32_tflops == 67
    assert peak_tflops("a100-80gb", "fp32") == 19.5


@pytest.mark.parametrize("extra, dtype, peak", [([], "tf32", 494.0), (["--no-tf32"], "fp32", 67.0), (["--bf16"], "bf16", 989.0)])
def test_logger_peak_on_cuda(monkeypatch: pytest.MonkeyPatch, extra: list[str], dtype: str, peak: float) -> None:
    from tricorn.training import logging as tlog

    monkeypatch.setattr(tlog, "detect_gpu_type", lambda: "h100-80gb")
    logger = tlog.MetricsLogger.__new__(tlog.MetricsLogger)  # only the peak is under test: no sinks opened
    logger.cfg, logger.device = config_from_args(FLAGS + extra, world_size=1), CUDA
    assert logger._peak() == (peak, f"h100-80gb, {dtype}")
