"""The config sections of what a run reports: logging (TensorBoard, W&B, metrics, timers, stragglers) and
profiling (profiler windows, nsys ranges, the CUDA allocator's history). Part of tricorn.config, which re-exports
them; split off to keep that file readable. Pure Python: no torch, no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tricorn.fields import AT_LEAST_1, NON_NEGATIVE, POSITIVE, Bound
from tricorn.fields import flag_field as _f


@dataclass
class LoggingConfig:
    tensorboard_dir: Optional[str] = _f(None, "TensorBoard event directory.")
    # Weights & Biases (rank 0, the same scalars as TensorBoard; `pip install tricorn[wandb]`).
    wandb_project: Optional[str] = _f(None, "Log to this Weights & Biases project as well (rank 0; needs the wandb package).")
    wandb_exp_name: Optional[str] = _f(None, "The W&B run's name (default: wandb picks one).")
    wandb_save_dir: Optional[str] = _f(None, "Local directory of the W&B run files (default: <--save>/wandb, else ./wandb).")
    wandb_entity: Optional[str] = _f(None, "The W&B team or user the project belongs to (default: your default entity).")
    log_interval: int = _f(10, "Log every N iterations.", bound=AT_LEAST_1)
    log_dir: Optional[str] = _f(None, "Per-rank log files.")
    log_params_norm: bool = _f(False, "Log the parameter norm (costs an extra reduction).")
    timing_log_level: int = _f(
        0,
        "0: iteration time only; 1: per-phase timers (CUDA events, no device sync); 2: timers that synchronise the device (debugging), plus min/max over ranks.",
        choices=[0, 1, 2],
    )
    peak_tflops: Optional[float] = _f(None, "Peak TFLOP/s per device for MFU (default: from the GPU table).", bound=POSITIVE)
    metrics_file: Optional[str] = _f(None, "Also append each logged iteration's metrics as one JSON line to this file (rank 0).")
    straggler_factor: float = _f(
        1.2,
        "Name a rank whose own work per iteration is above this x the median for 3 log intervals in a row.",
        bound=Bound(lo=1, lo_open=True),
    )


@dataclass
class ProfilingConfig:
    """Profiler windows, nsys ranges and the CUDA allocator's history (tricorn/profiling.py, docs/debugging.md)."""

    profile: bool = _f(
        False,
        "Profile iterations --profile-step-start+1 .. --profile-step-end: NVTX ranges between cudaProfilerStart/Stop "
        "(run under `nsys profile --capture-range=cudaProfilerApi`), or a torch-profiler trace with --use-pytorch-profiler.",
    )
    use_pytorch_profiler: bool = _f(
        False, "With --profile: a torch.profiler trace per profiled rank in <--tensorboard-dir>/torch_profile."
    )
    profile_step_start: int = _f(
        10, "Iterations completed before the profile window opens (Megatron's count).", bound=NON_NEGATIVE
    )
    profile_step_end: int = _f(12, "The last iteration profiled.", bound=AT_LEAST_1)
    profile_ranks: Optional[list] = _f(
        None, "Global ranks to profile (default: every rank).", nargs="+", type=int, bound=NON_NEGATIVE
    )
    record_shapes: bool = _f(False, "Record operator input shapes (torch profiler; emit_nvtx's shapes under nsys).")
    pytorch_profiler_collect_shapes: bool = _f(False, "Megatron's name for --record-shapes in the torch profiler.")
    pytorch_profiler_collect_callstack: bool = _f(False, "Record Python call stacks in the torch-profiler trace.")
    profile_memory: bool = _f(False, "Record tensor allocations and frees in the torch-profiler trace.")
    record_memory_history: bool = _f(
        False,
        "CUDA: record the caching allocator's history on the profiled ranks; dumped to --memory-snapshot-path at the "
        "end of the profile window (else of training) and on out-of-memory.",
    )
    memory_snapshot_path: str = _f(
        "snapshot.pickle",
        "File of the allocator history (with several ranks: NAME.rankN.pickle per rank); open it at pytorch.org/memory_viz.",
    )
