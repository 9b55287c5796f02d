"""Profiler windows, named ranges and the CUDA allocator's history (docs/debugging.md).

The window (Megatron's flags and numbers): with ``--profile``, iterations ``--profile-step-start`` + 1 through
``--profile-step-end`` (1-based, as the log lines number them; the start counts completed iterations) are
profiled on ``--profile-ranks`` (every rank by default):

- ``--use-pytorch-profiler``: a ``torch.profiler`` session runs from the start of the window's first iteration
  to the end of its last (the checkpoint save and the log line included) and writes one trace per rank, in
  ``torch.profiler.tensorboard_trace_handler``'s layout: ``<--tensorboard-dir>/torch_profile/rankR.<ns>.pt.trace.json.gz``,
  a Chrome trace (Perfetto, chrome://tracing) that TensorBoard's profile plugin reads from the same directory.
  ``--record-shapes`` (Megatron: ``--pytorch-profiler-collect-shapes``), ``--profile-memory`` and
  ``--pytorch-profiler-collect-callstack`` are the profiler's own options.
- without it (nsys): ``torch.cuda.profiler.start()`` / ``stop()`` (cudaProfilerStart/Stop) around the window, so
  ``nsys profile --capture-range=cudaProfilerApi`` records exactly it, ``torch.autograd.profiler.emit_nvtx`` in it
  (every operator as an NVTX range, with shapes under ``--record-shapes``), and tricorn's ranges as NVTX ranges.

tricorn's ranges have the same names in both (``span``; callers pass a format and its arguments, or a function):

    iteration N              the whole iteration: data, forward-backward, step, log line, checkpoint save
    forward mbM / backward mbM         one microbatch without pipelining (parallel/step.py)
    F|B|W stageS mbM         a pipeline action: S the virtual stage (parallel/pipeline/executor.py)
    p2p SF0,RB1              one batched send/receive step of the pipeline (its actions)
    dp reduce bucket K       the launch of a DP bucket's reduce-scatter / all-reduce (parallel/data_parallel.py)
    dp reduce wait bucket K  waiting for it
    dp gather bucket K       the launch of a bucket's parameter all-gather (distributed optimizer)
    dp gather wait bucket K  waiting for it
    optimizer step           unscale, norm, clip, AdamW and the gathers' launch (parallel/optimizer.py)
    checkpoint save          the stall of a save (checkpoint/checkpointer.py)

Outside the window ``span`` returns one shared no-op context: the step pays a global read and a call per range
(bench/profiling.py measures it), and no NVTX or profiler call is made.

``--record-memory-history`` (CUDA): ``torch.cuda.memory._record_memory_history`` from before the model is built
on the profiled ranks; the snapshot goes to ``--memory-snapshot-path`` (NAME.rankR.pickle with several ranks)
at the end of the window, or with no ``--profile`` at the end of training, and on out-of-memory (oom.py), when
recording stops too.

CUDA calls go through ``CudaApi`` (the functions of torch.cuda this module calls); the CPU tests install a
stand-in with the same signatures (tests/cuda_standin.py, checked against torch's with inspect).
No collectives. Memory: the profiler's event buffers during the window; the allocator's ring of
MEMORY_HISTORY_ENTRIES events while recording.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

log = logging.getLogger("tricorn")

TRACE_SUBDIR = "torch_profile"  # under --tensorboard-dir: the TensorBoard profile plugin's run of the traces
MEMORY_HISTORY_ENTRIES = 100_000  # allocation events the allocator keeps (Megatron's and torchtitan's figure)

_NOTHING = contextlib.nullcontext()
# The range factory while this rank's window is open (record_function or an NVTX range), else None.
_open: Optional[Callable[[str], ContextManager]] = None


def span(name: Union[str, Callable[..., str]], *args: Any) -> ContextManager:
    """A named range in the trace while the window is open; outside it a shared no-op. ``name`` is a %-format
    of ``args``, or a function of them: the name is only built inside the window."""
    make = _open
    if make is None:
        return _NOTHING
    return make(name(*args) if callable(name) else (name % args if args else name))


def span_of(name: str) -> Callable:
    """Decorator: each call of the function is the range `name` in a profile window (a global read outside it)."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if _open is None:
                return fn(*args, **kwargs)
            with _open(name):
                return fn(*args, **kwargs)

        return inner

    return wrap


def window_open() -> bool:
    return _open is not None


# ---------------------------------------------------------------- the CUDA functions this module calls


@dataclass(frozen=True)
class CudaApi:
    """torch.cuda's profiler, NVTX and allocator functions, by the names tricorn calls them."""

    profiler_start: Callable[[], Any]  # torch.cuda.profiler.start: cudaProfilerStart
    profiler_stop: Callable[[], Any]
    range_push: Callable[[str], Any]  # torch.cuda.nvtx.range_push
    range_pop: Callable[[], Any]
    emit_nvtx: Callable[..., ContextManager]  # torch.autograd.profiler.emit_nvtx
    record_memory_history: Callable[..., None]  # torch.cuda.memory._record_memory_history
    dump_snapshot: Callable[..., None]  # torch.cuda.memory._dump_snapshot
    memory_stats: Callable[..., dict]  # torch.cuda.memory_stats
    mem_get_info: Callable[..., tuple[int, int]]  # torch.cuda.mem_get_info: (free, total) bytes of the device

    @staticmethod
    def real() -> CudaApi:
        return CudaApi(
            profiler_start=torch.cuda.profiler.start,
            profiler_stop=torch.cuda.profiler.stop,
            range_push=torch.cuda.nvtx.range_push,
            range_pop=torch.cuda.nvtx.range_pop,
            emit_nvtx=torch.autograd.profiler.emit_nvtx,
            record_memory_history=torch.cuda.memory._record_memory_history,
            dump_snapshot=torch.cuda.memory._dump_snapshot,
            memory_stats=torch.cuda.memory_stats,
            mem_get_info=torch.cuda.mem_get_info,
        )


_stand_in: Optional[CudaApi] = None  # tests: a CPU stand-in for the CUDA functions (install_stand_in)


def install_stand_in(api: Optional[CudaApi]) -> None:
    """Tests only: route the CUDA calls of this module (and oom.py's) to `api`, on any device (None: undo)."""
    global _stand_in
    _stand_in = api


def cuda_api(device: Optional[torch.device]) -> Optional[CudaApi]:
    """The functions to call: the tests' stand-in, torch's on a CUDA device, else None."""
    if _stand_in is not None:
        return _stand_in
    return CudaApi.real() if device is not None and torch.device(device).type == "cuda" else None


def has_cuda_api(device: Optional[str]) -> bool:
    return _stand_in is not None or device == "cuda"


# ---------------------------------------------------------------- names and checks


def is_profiled(cfg, rank: int) -> bool:
    ranks = cfg.profiling.profile_ranks
    return ranks is None or rank in ranks


def snapshot_path(path: str, rank: int, world_size: int) -> str:
    """--memory-snapshot-path of this rank: as given with one rank, NAME.rankR.SUFFIX with several."""
    if world_size == 1:
        return path
    stem, suffix = os.path.splitext(path)
    return f"{stem}.rank{rank}{suffix}"


def trace_dir(cfg) -> Optional[str]:
    return os.path.join(cfg.logging.tensorboard_dir, TRACE_SUBDIR) if cfg.logging.tensorboard_dir else None


def validate_profiling(cfg) -> list[str]:
    """The profiling flags against the run, one sentence per problem (before launch)."""
    p, errs = cfg.profiling, []
    iters = cfg.training.train_iters
    if p.profile:
        if p.profile_step_end <= p.profile_step_start:
            errs.append(
                f"--profile-step-end {p.profile_step_end} must be after --profile-step-start {p.profile_step_start} "
                f"(the window is iterations start+1 .. end)"
            )
        elif p.profile_step_end > iters:
            errs.append(
                f"the profile window (iterations {p.profile_step_start + 1}-{p.profile_step_end}) ends after the run's "
                f"{iters} iterations; set --profile-step-start and --profile-step-end within --train-iters {iters}"
            )
        if p.use_pytorch_profiler and not cfg.logging.tensorboard_dir:
            errs.append("--use-pytorch-profiler writes its traces under --tensorboard-dir; pass --tensorboard-dir DIR")
        if not p.use_pytorch_profiler and not has_cuda_api(cfg.device):
            errs.append(
                "--profile without --use-pytorch-profiler marks the window for nsys (cudaProfilerStart/Stop, NVTX), "
                "which needs --device cuda; add --use-pytorch-profiler for a torch-profiler trace on the CPU"
            )
    bad = sorted(r for r in p.profile_ranks or [] if r >= cfg.world_size)
    if bad:
        errs.append(
            f"--profile-ranks {' '.join(map(str, bad))} outside the world of {cfg.world_size} ranks (0-{cfg.world_size - 1})"
        )
    # A profiler option outside the window it configures would do nothing: said, not ignored.
    torch_only = [("--use-pytorch-profiler", p.use_pytorch_profiler), ("--record-shapes", p.record_shapes)]
    torch_only += [("--pytorch-profiler-collect-shapes", p.pytorch_profiler_collect_shapes)]
    torch_only += [("--pytorch-profiler-collect-callstack", p.pytorch_profiler_collect_callstack)]
    torch_only += [("--profile-memory", p.profile_memory)]
    idle = [flag for flag, on in torch_only if on and not p.profile]
    if p.profile_ranks and not (p.profile or p.record_memory_history):
        idle.append("--profile-ranks")
    if idle:
        errs.append(f"{', '.join(idle)} only configure the profile window: add --profile (and --profile-step-start/-end)")
    elif p.profile and not p.use_pytorch_profiler:
        torch_flags = [flag for flag, on in torch_only[2:] if on]
        if torch_flags:
            errs.append(f"{', '.join(torch_flags)} configure the torch profiler: add --use-pytorch-profiler")
    if p.record_memory_history and not has_cuda_api(cfg.device):
        errs.append("--record-memory-history records the CUDA caching allocator; it needs --device cuda")
    return errs


# ---------------------------------------------------------------- one rank's profiling


class _NvtxRange:
    __slots__ = ("api", "name")

    def __init__(self, api: CudaApi, name: str):
        self.api, self.name = api, name

    def __enter__(self) -> None:
        self.api.range_push(self.name)

    def __exit__(self, *exc: object) -> None:
        self.api.range_pop()


class Profiler:
    """This rank's window (``begin``/``end`` around each iteration) and its allocator history."""

    def __init__(self, cfg, rank: int, world_size: int, device: Optional[torch.device], api: Optional[CudaApi] = None):
        p = cfg.profiling
        chosen = is_profiled(cfg, rank)
        self.rank = rank
        self.first, self.last = p.profile_step_start + 1, p.profile_step_end
        self.windowed = p.profile and chosen
        self.torch_mode = p.use_pytorch_profiler
        self.options = p
        self.shapes = p.record_shapes or p.pytorch_profiler_collect_shapes
        self.device = device
        self.api = api
        self.trace_dir = trace_dir(cfg)
        self.history_path = (
            snapshot_path(p.memory_snapshot_path, rank, world_size) if p.record_memory_history and chosen else None
        )
        self.announce = rank == min(p.profile_ranks or [0])  # the rank that prints the window's one line
        self.recording = False  # the allocator's history is being recorded
        self.state = "before" if self.windowed else "done"
        self.opened_at = 0
        self._prof = None
        self._nvtx: Optional[ContextManager] = None
        self._iteration: Optional[ContextManager] = None

    @classmethod
    def from_config(cls, cfg, state) -> Profiler:
        return cls(cfg, state.rank, state.world_size, state.device, cuda_api(state.device))

    @classmethod
    def disabled(cls) -> Profiler:
        from tricorn.config import Config

        return cls(Config(), 0, 1, None)

    # ------------------------------------------------------------ the allocator's history

    def start_memory_history(self) -> None:
        """Before the model is built, so that every allocation of the run is in the history."""
        if self.history_path is None or self.api is None:
            return
        self.api.record_memory_history(enabled="all", context="all", stacks="python", max_entries=MEMORY_HISTORY_ENTRIES)
        self.recording = True

    def dump_memory(self, stop: bool = False) -> Optional[str]:
        """Write the history to this rank's snapshot file (returns its path), and stop recording if `stop`."""
        if not self.recording:
            return None
        path = self.history_path
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.api.dump_snapshot(path)
        except (OSError, RuntimeError) as e:  # never let the report of a problem become another one
            log.warning(f"rank {self.rank}: the memory snapshot could not be written to {path}: {e}")
            path = None
        if stop:
            self.api.record_memory_history(enabled=None)
            self.recording = False
        return path

    # ------------------------------------------------------------ the window

    def begin(self, iteration: int) -> None:
        """Before iteration `iteration` (1-based) runs."""
        if self.state == "done":
            return
        if self.state == "before":
            if iteration < self.first:
                return
            if iteration > self.last:  # resumed past the window
                self.state = "done"
                if self.announce:
                    print(
                        f"tricorn: profile: the window (iterations {self.first}-{self.last}) is before this run's "
                        f"first iteration {iteration}; nothing profiled",
                        flush=True,
                    )
                return
            self._open_window(iteration)
        self._iteration = _open(f"iteration {iteration}")
        self._iteration.__enter__()

    def end(self, iteration: int) -> None:
        """After iteration `iteration`, its log line, evaluation and checkpoint save."""
        if self.state != "open":
            return
        self._leave_iteration()
        if iteration >= self.last:
            self._close_window(iteration)

    def finish(self, iteration: int) -> None:
        """Training ended: a window still open closes (an exit signal came inside it); without --profile the
        history of the whole run is written."""
        self.close(iteration)
        if self.recording:
            self.dump_memory(stop=True)

    def close(self, iteration: int) -> None:
        """Any way out (an error too): the open window's trace is written and its calls balanced."""
        if self.state == "open":
            self._leave_iteration()
            self._close_window(iteration)

    def _leave_iteration(self) -> None:
        if self._iteration is not None:
            self._iteration.__exit__(None, None, None)
            self._iteration = None

    def _open_window(self, iteration: int) -> None:
        global _open
        self.state, self.opened_at = "open", iteration
        if self.torch_mode:
            from torch.profiler import ProfilerActivity, profile, record_function, tensorboard_trace_handler

            activities = [ProfilerActivity.CPU] + (
                [ProfilerActivity.CUDA] if torch.device(self.device or "cpu").type == "cuda" else []
            )
            self._prof = profile(
                activities=activities,
                record_shapes=self.shapes,
                profile_memory=self.options.profile_memory,
                with_stack=self.options.pytorch_profiler_collect_callstack,
                on_trace_ready=tensorboard_trace_handler(self.trace_dir, worker_name=f"rank{self.rank}", use_gzip=True),
            )
            self._prof.start()
            _open = record_function
        else:
            api = self.api
            api.profiler_start()
            self._nvtx = api.emit_nvtx(record_shapes=self.shapes)
            self._nvtx.__enter__()
            _open = functools.partial(_NvtxRange, api)

    def _close_window(self, iteration: int) -> None:
        global _open
        _open = None
        self.state = "done"
        if self.torch_mode:
            prof, self._prof = self._prof, None
            try:
                prof.stop()  # on_trace_ready writes the trace
                where = f"trace in {self.trace_dir}"
            except (OSError, RuntimeError) as e:
                log.warning(f"rank {self.rank}: the profiler trace could not be written to {self.trace_dir}: {e}")
                where = f"no trace ({e})"
        else:
            self._nvtx.__exit__(None, None, None)
            self._nvtx = None
            self.api.profiler_stop()
            where = "cudaProfilerStart/Stop around them for nsys --capture-range=cudaProfilerApi"
        memory = ""
        if self.recording:
            path = self.dump_memory(stop=True)
            memory = f"; memory history {path}" if path else ""
        line = f"tricorn: profile: iterations {self.opened_at}-{iteration} on rank {self.rank}: {where}{memory}"
        log.info(line)
        if self.announce:
            print(line, flush=True)
