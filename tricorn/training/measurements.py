"""What the logger measures on each rank: memory, the parameter norm, parameter counts, a max over ranks.

Collectives: ``params_norm`` one scalar all-reduce over TP x PP (and one over EP with MoE experts, or over
DP x CP with the distributed optimizer); ``parameter_counts`` one all-gather of 4 integers per rank over the world;
``max_over_ranks`` one all-reduce (max) of a short vector. Memory: scalars only (the norm streams over the
owned parameter ranges; nothing is gathered). ``measure_cuda_context``: the device memory the CUDA context of
this process takes (gpu_check c), read once at start-up.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


def memory_bytes(device: torch.device) -> tuple[float, float]:
    """(allocated, max allocated): the CUDA caching allocator's figures, or on CPU the process RSS and its peak."""
    if device.type == "cuda":
        return float(torch.cuda.memory_allocated(device)), float(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    try:
        with open("/proc/self/statm") as fh:
            current = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no /proc (macOS): the peak is the best figure there is
        current = peak
    return float(current), float(max(peak, current))


def params_norm(chunks: list[torch.nn.Module], state: Any, optimizer: Any = None) -> float:
    """L2 norm of all parameters, each counted once over TP/PP/EP and DP (grads.py's rule for the gradient norm).

    Streams: with an optimizer, each rank sums the squares of the parameter ranges it owns (its optimizer
    shard: 1/(DP x CP) under the distributed optimizer, whatever the ZeRO stage), so nothing is gathered; the
    sums are then reduced as the gradient norm's are (TP x PP, EP for MoE experts, DP x CP when sharded).
    """
    from tricorn.parallel.grads import global_grad_norm

    if optimizer is None:
        params = [p for chunk in chunks for p in chunk.parameters()]
        return global_grad_norm(params, state, grad_fn=lambda p: p.detach()).item()
    owned = {id(ps.param): ps.value for ps in optimizer.sharded_param_state()}
    params = [ps.param for ps in optimizer.sharded_param_state()]
    return global_grad_norm(params, state, dp_sharded=optimizer.opts.distributed, grad_fn=lambda p: owned.get(id(p))).item()


def cpu_peak_bytes(fn: Callable[[], Any]) -> tuple[Any, int]:
    """(fn(), the peak of bytes allocated by torch's CPU allocator in this thread while fn ran, above the start).

    Read from the profiler's memory events (allocations and frees in time order): what a CPU run holds
    beyond its steady state, e.g. during a checkpoint save (tests/test_checkpoint.py, bench/checkpoint.py)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return out, peak


@dataclass(frozen=True)
class ParameterCounts:
    total: int  # every parameter once (TP shards summed, TP/DP replicas and the tied head copy once)
    per_rank: list[int]  # what each world rank holds
    per_stage: list[int]  # per pipeline stage, each of its parameters once over TP (a tied head copy included)


def parameter_counts(chunks: list[torch.nn.Module], state: Any) -> ParameterCounts:
    """Collectives: one all-gather over the world (4 integers per rank)."""
    from tricorn.model.init import is_expert, is_tp_split
    from tricorn.parallel.grads import counts_for_norm

    def once_over_tp(p: torch.Tensor) -> bool:  # TP shards on every TP rank, TP-replicated ones on TP rank 0
        return is_tp_split(p) or state.tp_rank == 0

    def replica0(p: torch.Tensor) -> bool:  # DP/CP replicas (expert-DP for MoE experts) hold the same parameters
        return dist.get_rank(state.replica_group(is_expert(p))) == 0

    params = [p for c in chunks for p in c.parameters()]
    counted = sum(p.numel() for p in params if counts_for_norm(p, state) and replica0(p))
    on_stage = sum(p.numel() for p in params if once_over_tp(p) and replica0(p))  # a tied head copy counts here
    mine = torch.tensor([sum(p.numel() for p in params), counted, state.pp_rank, on_stage], device=state.device)
    rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    table = torch.stack(rows).cpu().tolist()
    per_stage = [0] * state.pp_size
    for _, _, pp, stage_part in table:
        per_stage[pp] += stage_part
    return ParameterCounts(sum(r[1] for r in table), [r[0] for r in table], per_stage)


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


@dataclass
class CudaContext:
    bytes: Optional[int]  # device memory the CUDA context of this process takes; None where not measurable
    how: str


def _used_device_memory() -> Optional[int]:
    """Used memory of GPU 0 as the driver reports it, readable without a CUDA context in this process: NVML
    through torch (pynvml), else nvidia-smi; None when neither is there."""
    try:
        return int(torch.cuda.device_memory_used(0))
    except Exception:
        pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", visible],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return int(out.stdout.split()[0]) * 2**20 if out.returncode == 0 and out.stdout.strip() else None


def measure_cuda_context() -> CudaContext:
    """The context is what the device loses when this process initialises CUDA, nothing allocated yet: used
    memory before and after the first torch.cuda.mem_get_info (cudaMemGetInfo needs, so creates, the context),
    both read by the same reader (NVML and cudaMemGetInfo count the driver's reserve differently).
    max_memory_allocated never sees the context, which is why check c takes the estimator's constant for it
    out of the estimate and this figure is compared with the constant on its own line."""
    before = _used_device_memory()
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    after = _used_device_memory()
    if before is None or after is None:
        return CudaContext(None, f"NVML unavailable; {(total - free) / 2**20:.0f} MiB used after init, other processes included")
    return CudaContext(after - before, f"NVML used after init minus before; mem_get_info: {(total - free) / 2**20:.0f} MiB used")
