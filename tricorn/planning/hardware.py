"""GPU table for the estimator, the planner and MFU: peak dense TFLOP/s, memory, HBM and link bandwidths.

Figures are the vendors' datasheet numbers for the SXM parts (dense, i.e. without 2:4 sparsity):

| gpu         | bf16/fp16 | fp8  | tf32 | fp32 | memory (nvidia-smi)   | HBM      | NVLink per GPU, one direction | network per GPU |
|-------------|-----------|------|------|------|-----------------------|----------|-------------------------------|-----------------|
| a100-80gb   | 312       | -    | 156  | 19.5 | 81920 MiB             | 2.04 TB/s| 300 GB/s (NVLink 3, 12 links) | 25 GB/s (HDR 200 Gb/s) |
| h100-80gb   | 989       | 1978 | 494  | 67   | 81559 MiB             | 3.35 TB/s| 450 GB/s (NVLink 4, 18 links) | 50 GB/s (NDR 400 Gb/s) |
| h200-141gb  | 989       | 1978 | 494  | 67   | 143771 MiB            | 4.8 TB/s | 450 GB/s (NVLink 4, 18 links) | 50 GB/s (NDR 400 Gb/s) |

The network column assumes the DGX/HGX layout of one InfiniBand NIC per GPU (rail-optimised). Collectives reach
a fraction of these link rates; the planner applies ``BUS_EFFICIENCY`` (what nccl-tests' busbw typically shows
against the link rate) instead of pretending to the datasheet figure.

The host side (what --optimizer-cpu-offload and activation offload use; planning/host_time.py), per GPU: its PCIe
link, one direction, x16 (Gen4 on the A100, Gen5 on the H100/H200: 32 and 64 GB/s), and an eighth of the DGX
node's host memory and memory bandwidth (DGX A100: 1 TiB, 2 x 8 channels of DDR4-3200 = 410 GB/s; DGX H100/H200:
2 TiB, 2 x 8 channels of DDR5-4800 = 614 GB/s). Copies between pinned host memory and the device reach
``BUS_EFFICIENCY["pcie"]`` of the link (an assumption, as nccl-tests' figures are for the collectives).

fp32 training on CUDA runs its matmuls on TF32 tensor cores (tricorn enables them; `--no-tf32` turns them off),
so its peak is the TF32 figure, and with --no-tf32 the fp32 (CUDA-core, non-tensor) figure: `mfu_dtype` picks
the row. fp8 is twice bf16 (Transformer Engine), and the A100 has no fp8 tensor cores.
No collectives, no device work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

GiB = 1024**3
MiB = 1024**2

# Collectives over NVLink / InfiniBand reach roughly this fraction of the link rate (nccl-tests busbw).
BUS_EFFICIENCY = {"nvlink": 0.80, "network": 0.85, "pcie": 0.80}


@dataclass(frozen=True)
class GPUSpec:
    name: str
    bf16_tflops: float  # dense bf16/fp16 tensor-core peak
    tf32_tflops: float
    has_fp8: bool
    memory_bytes: int  # total device memory as nvidia-smi reports it
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # per GPU, one direction, within a node
    network_bytes_per_s: float  # per GPU, one direction, between nodes
    fp32_tflops: float  # IEEE fp32 on the CUDA cores: matmuls with TF32 off
    gpus_per_node: int = 8
    host_link_bytes_per_s: float = 32e9  # PCIe x16 between the GPU and host memory, one direction
    host_memory_bytes: int = 128 * GiB  # this GPU's share of the node's host memory
    host_memory_bytes_per_s: float = 51e9  # this GPU's share of the node's host memory bandwidth

    @property
    def memory_gb(self) -> float:
        return self.memory_bytes / GiB

    def peak_tflops(self, dtype: str) -> float:
        """Dense peak for the compute dtype: bf16, fp16, fp8, tf32 (tensor cores) or fp32 (IEEE, CUDA cores)."""
        if dtype in ("bf16", "fp16"):
            return self.bf16_tflops
        if dtype == "fp8":
            if not self.has_fp8:
                raise ValueError(f"{self.name} has no fp8 tensor cores; train in bf16 on it")
            return 2 * self.bf16_tflops  # the datasheets' 1979 rounds 2 x 989.4
        if dtype == "tf32":
            return self.tf32_tflops
        if dtype == "fp32":
            return self.fp32_tflops
        raise ValueError(f"unknown compute dtype '{dtype}': use bf16, fp16, fp8, tf32 or fp32")


_DGX_H100_HOST = dict(host_link_bytes_per_s=64e9, host_memory_bytes=256 * GiB, host_memory_bytes_per_s=77e9)
GPUS: dict[str, GPUSpec] = {
    "a100-80gb": GPUSpec("a100-80gb", 312.0, 156.0, False, 81920 * MiB, 2.039e12, 300e9, 25e9, 19.5),
    "h100-80gb": GPUSpec("h100-80gb", 989.0, 494.0, True, 81559 * MiB, 3.35e12, 450e9, 50e9, 67.0, **_DGX_H100_HOST),
    "h200-141gb": GPUSpec("h200-141gb", 989.0, 494.0, True, 143771 * MiB, 4.8e12, 450e9, 50e9, 67.0, **_DGX_H100_HOST),
}


def mfu_dtype(param_dtype: str, fp8: bool, tf32: bool) -> str:
    """The table row the matmuls run at: fp8 under --fp8-format, else the parameter dtype, where fp32 means the
    TF32 tensor cores unless --no-tf32 turned them off (tricorn.parallel.state.configure_tf32)."""
    if fp8:
        return "fp8"
    if param_dtype == "fp32":
        return "tf32" if tf32 else "fp32"
    return param_dtype


def get_gpu(name: str) -> GPUSpec:
    if name not in GPUS:
        raise ValueError(f"unknown --gpu-type '{name}'; choose one of {', '.join(GPUS)}")
    return GPUS[name]


def peak_tflops(gpu_type: Optional[str], dtype: str, override: Optional[float] = None) -> Optional[float]:
    """Peak TFLOP/s per device for MFU: ``--peak-tflops`` wins, then the table; None when neither applies (CPU)."""
    if override is not None:
        return float(override)
    if gpu_type is None:
        return None
    return get_gpu(gpu_type).peak_tflops(dtype)


def detect_gpu_type() -> Optional[str]:
    """Table key of the visible CUDA device, from its name and memory; None on CPU or an unknown part."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        props = torch.cuda.get_device_properties(0)
    except Exception:
        return None
    name = props.name.lower()
    for family, key in (("a100", "a100-80gb"), ("h100", "h100-80gb"), ("h200", "h200-141gb")):
        if family in name:
            return key
    return None
