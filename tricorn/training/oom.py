"""Out of memory: one line from every rank that runs out, exit OOM_ERROR (3), and no checkpoint written.

The line names the rank, the phase and iteration it failed in (from the exception's traceback: the innermost
tricorn function it knows, e.g. "pipeline backward", and the innermost tricorn frame), the allocator's figures
(``torch.cuda.memory_stats`` and ``mem_get_info``; the process RSS for the host allocator), this rank's
estimate by category (``tricorn estimate``'s code, planning/memory.py, for its pipeline stage) and the memory
snapshot the allocator's history was written to (``--record-memory-history``, profiling.py), or how to get one.

Nothing is saved after the error: main.py returns before the final save, and a save that ran out of memory
itself leaves only its never-published temporary directory (removed by the next save). Other ranks end the
way any lost peer ends them (their collective fails; the watchdog names this rank). On CUDA the error is
``torch.OutOfMemoryError``; the host allocator's failure is a RuntimeError ("DefaultCPUAllocator: can't
allocate memory"), reported the same way. No collectives.
"""

from __future__ import annotations

import os
import re
import traceback
from typing import Optional

import torch

from tricorn.launch_errors import OOM_ERROR, fail

_TRIED = re.compile(r"(?:Tried to allocate|you tried to allocate) ([0-9.]+ ?[KMGT]?i?B|[0-9]+ bytes)")
_HOST_OOM = "DefaultCPUAllocator: can't allocate memory"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../tricorn
# (file, function) -> the phase it is; the innermost one on the traceback names the failure's phase.
_PHASES = {
    ("training/main.py", "build"): "model build",
    ("checkpoint/checkpointer.py", "load"): "checkpoint load",
    ("training/loop.py", "run_iteration"): "data loading",
    ("training/loop.py", "train_step"): "forward-backward",
    ("parallel/step.py", "microbatch_loss"): "forward",
    ("pipeline/executor.py", "_forward"): "pipeline forward",
    ("pipeline/executor.py", "_backward"): "pipeline backward",
    ("pipeline/executor.py", "_weight"): "pipeline weight gradients",
    ("pipeline/executor.py", "_communicate"): "pipeline send/receive",
    ("parallel/optimizer.py", "finish_grad_sync"): "gradient reduction",
    ("parallel/optimizer.py", "step"): "optimizer step",
    ("training/loop.py", "evaluate"): "evaluation",
    ("training/loop.py", "log"): "logging",
    ("checkpoint/checkpointer.py", "save"): "checkpoint save",
}


def is_out_of_memory(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and _HOST_OOM in str(e))


def phase_of(e: BaseException) -> tuple[str, str]:
    """(phase, innermost tricorn frame "path:line function") of where `e` was raised."""
    phase, where, backward = "start-up", "", False
    for frame, lineno in traceback.walk_tb(e.__traceback__):
        path, name = frame.f_code.co_filename, frame.f_code.co_name
        for (suffix, function), label in _PHASES.items():
            if name == function and path.endswith(suffix):
                phase, backward = label, False
        if name == "backward" and path.endswith(("torch/autograd/__init__.py", "torch/_tensor.py")):
            backward = True  # autograd's backward below the phase's frame: the microbatch's backward pass
        if path.startswith(_PACKAGE):
            where = f"{os.path.relpath(path, os.path.dirname(_PACKAGE))}:{lineno} {name}"
    if backward and phase in ("forward-backward", "forward"):
        phase = "backward"
    return phase, where


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def allocator_figures(api, device: torch.device) -> str:
    """The caching allocator's figures (through `api`, profiling.CudaApi), or the host process's."""
    if api is None:
        from tricorn.training.measurements import memory_bytes

        rss, peak = memory_bytes(torch.device("cpu"))
        return f"host process RSS {_size(rss)} (peak {_size(peak)})"
    stats = api.memory_stats(device)
    free, total = api.mem_get_info(device)
    retries = stats.get("num_alloc_retries", 0)
    return (
        f"allocator: {_size(stats.get('allocated_bytes.all.current', 0))} allocated, "
        f"{_size(stats.get('reserved_bytes.all.current', 0))} reserved (peak allocated "
        f"{_size(stats.get('allocated_bytes.all.peak', 0))}), {_size(free)} free of {_size(total)}"
        + (f", {retries} cache flushes to retry" if retries else "")
    )


def estimate_figures(cfg, pp_rank: int) -> str:
    """This rank's pipeline stage as `tricorn estimate` sees it, by category."""
    from tricorn.planning.memory import estimate_config

    try:
        e = estimate_config(cfg, stage=pp_rank)
    except Exception as exc:  # noqa: BLE001 - the estimate is advice: a config it cannot model still gets the line
        return f"no estimate ({exc})"
    parts = [
        ("params", e.params_bytes),
        ("grads", e.grads_bytes),
        ("master params", e.master_params_bytes),
        ("optimizer state", e.optimizer_state_bytes),
        ("activations", e.activation_bytes),
        ("logits", e.embedding_logits_bytes),
        ("buffers", e.buffer_bytes + e.overhead_bytes + e.fp8_bytes),
    ]
    return (
        f"estimate for stage {pp_rank} (tricorn estimate): "
        + ", ".join(f"{k} {_size(v)}" for k, v in parts)
        + (f" = {_size(e.total_bytes)}")
    )


def oom_line(e: BaseException, cfg, rank: int, pp_rank: int, iteration: int, api, device, snapshot: Optional[str]) -> str:
    phase, where = phase_of(e)
    tried = _TRIED.search(str(e))
    kind = "host" if _HOST_OOM in str(e) else "device"
    history = (
        f"memory history: {snapshot} (drop it on https://pytorch.org/memory_viz)"
        if snapshot
        else "no memory history (--record-memory-history writes one)"
    )
    return (
        f"rank {rank} ran out of {kind} memory in {phase} of iteration {iteration}"
        + (f" ({where})" if where else "")
        + (f": tried to allocate {tried.group(1)}" if tried else "")
        + f"; {allocator_figures(api, device)}; {estimate_figures(cfg, pp_rank)}; {history}; no checkpoint written; "
        "fit it with a smaller --micro-batch-size, --recompute-granularity, more TP/PP or --use-distributed-optimizer"
    )


def report(e: BaseException, cfg, state, iteration: int, profiler) -> int:
    """Print this rank's line (every rank that ran out prints its own), write its snapshot, return OOM_ERROR."""
    snapshot = profiler.dump_memory(stop=True) if profiler is not None else None
    api = profiler.api if profiler is not None else None
    line = oom_line(e, cfg, state.rank, state.pp_rank, iteration, api, state.device, snapshot)
    return fail(line, OOM_ERROR, prints=True)
