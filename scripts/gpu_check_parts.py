"""Parts of scripts/gpu_check.py that need no Runner: a check's result line, the guards a run enters, the
CUDA-context INFO line, Transformer Engine's FP8 query, --cpu-smoke's stand-in for the sync-debug mode, and small
helpers. Split off to keep the script readable; gpu_check imports them all."""

from __future__ import annotations

import contextlib
import socket
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch


class Check:
    def __init__(self, name: str, what: str):
        self.name, self.what = name, what
        self.status, self.detail, self.data = "PASS", "", {}

    def fail(self, detail: str) -> None:
        self.status, self.detail = "FAIL", detail

    def skip(self, detail: str) -> None:
        self.status, self.detail = "SKIP", detail

    def line(self) -> str:
        figures = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.data.items())
        return f"{self.status} {self.name} {self.what}: {figures} {self.detail}".rstrip()


@dataclass
class Guards:
    """Context managers a run enters: `step()` around every iteration, `quiet(trainer)` around each one after
    the first (lazy initialisation) that does not log."""

    step: Callable[[], Any] = contextlib.nullcontext
    quiet: Callable[[Any], Any] = lambda _trainer: contextlib.nullcontext()


def tail_mean(losses: list[float]) -> float:
    return statistics.fmean(losses[-10:])


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def _without_bf16(model: str) -> str:
    return " ".join(w for w in model.split() if w != "--bf16")


def _bf16(model: str) -> str:
    return model if "--bf16" in model.split() else model + " --bf16"


# ---------------------------------------------------------------- the CUDA context, measured apart


def context_line(context: Optional[Any]) -> str:
    """The INFO line: the CUDA context measured apart (tricorn.training.measurements) next to the estimator's constant."""
    from tricorn.planning.memory import CUDA_OVERHEAD_BYTES

    constant = f"estimate_constant_mib={CUDA_OVERHEAD_BYTES / 2**20:.0f}"
    if context is None:
        return f"INFO c cuda-context: not measured on the CPU (the estimate has no constant for --device cpu); {constant}"
    measured = f"measured_mib={context.bytes / 2**20:.0f}" if context.bytes is not None else "measured_mib=n/a"
    return f"INFO c cuda-context: {measured} {constant} ({context.how})"


def fp8_support(te: Any) -> tuple[bool, str]:
    """Whether TE can run FP8 here, and why not: TE 1.x/2.x's fp8.check_fp8_support, or 2.x's is_fp8_available."""
    try:
        check = getattr(getattr(te, "fp8", None), "check_fp8_support", None)
        if check is not None:
            ok, reason = check()
            return bool(ok), str(reason)
        available = getattr(te, "is_fp8_available", None)
        if available is not None:
            ok, reason = available(return_reason=True)
            return bool(ok), str(reason)
    except Exception as e:
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return False, "this Transformer Engine has no FP8 support query"


class NcclRefused(RuntimeError):
    """NCCL would not run two ranks on one GPU; the message is NCCL's own line."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ReadsAsSyncs:
    """--cpu-smoke's stand-in for set_sync_debug_mode("error"): a host read in the block raises on exit, except
    MoE's per-expert loop reading its row counts (model/moe.py read_counts), the one read the CPU path (no grouped
    GEMM there) needs by design; those are counted in `tolerated`."""

    tolerated: list[str] = []

    def __init__(self, trainer: Any):
        from tricorn.host_reads import HostReadCounter

        self.counter = HostReadCounter(trainer.optimizer.host_scalars(), trainer.state.device)

    def __enter__(self) -> _ReadsAsSyncs:
        self.counter.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.counter.__exit__(*exc)
        reads = [w for w in self.counter.where if " at moe.py:" not in w]
        _ReadsAsSyncs.tolerated += [w for w in self.counter.where if " at moe.py:" in w]
        if reads and exc[0] is None:
            raise RuntimeError(f"synchronising read in a non-logging iteration: {reads[0]}")


@contextlib.contextmanager
def _sync_errors(_trainer: Any):
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call now raises
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
