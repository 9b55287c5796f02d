"""A CPU stand-in for the torch.cuda functions tricorn/profiling.py and tricorn/training/oom.py call.

Each function has the parameters of torch's own (tests/test_profiling.py checks them against torch 2.13's with
inspect, and every keyword tricorn passed against the real signature). Every call is appended to a journal -
a JSON line per call in the file given to `install` - so that a test can tell which rank made which call and in
which order relative to the trainer's iterations (the worker adds its own markers with `mark`).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from typing import Any, Optional

from tricorn import profiling

JOURNAL: list[dict] = []
_path: Optional[str] = None
CALLED: dict[str, list[dict]] = {}  # function name -> the keyword arguments of each call (positional ones by name)


def _note(name: str, **kwargs: Any) -> None:
    entry = {"call": name, **kwargs}
    JOURNAL.append(entry)
    CALLED.setdefault(name, []).append(kwargs)
    if _path is not None:
        with open(_path, "a") as fh:
            fh.write(json.dumps(entry, default=str) + "\n")


def mark(text: str) -> None:
    """The test's own marker in the journal (e.g. "iteration 3 begins")."""
    _note("mark", text=text)


def start() -> None:
    _note("profiler_start")


def stop() -> None:
    _note("profiler_stop")


def range_push(msg):
    _note("range_push", msg=msg)
    return 0


def range_pop():
    _note("range_pop")
    return 0


class emit_nvtx:  # noqa: N801 - torch's class name
    def __init__(self, enabled=True, record_shapes=False):
        _note("emit_nvtx", enabled=enabled, record_shapes=record_shapes)

    def __enter__(self):
        _note("emit_nvtx.__enter__")
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        _note("emit_nvtx.__exit__")
        return False


def _record_memory_history(
    enabled: Optional[str] = "all",
    context: Optional[str] = "all",
    stacks: str = "all",
    max_entries: int = sys.maxsize,
    device=None,
    clear_history: bool = False,
    compile_context: bool = False,
    global_record_annotations: bool = False,
    skip_actions: Optional[list[str]] = None,
) -> None:
    _note("record_memory_history", enabled=enabled, context=context, stacks=stacks, max_entries=max_entries)


def _dump_snapshot(filename="dump_snapshot.pickle", augment_with_fx_traces=False):
    _note("dump_snapshot", filename=filename)
    with open(filename, "wb") as fh:  # the layout of torch.cuda.memory._snapshot(), empty
        pickle.dump({"segments": [], "device_traces": [[]], "allocator_settings": {}}, fh)


STATS = {  # what torch.cuda.memory_stats returns, the keys oom.py reads, made-up figures
    "allocated_bytes.all.current": 71 * 2**30,
    "reserved_bytes.all.current": 78 * 2**30,
    "allocated_bytes.all.peak": 75 * 2**30,
    "num_alloc_retries": 4,
}


def memory_stats(device=None) -> dict[str, Any]:
    _note("memory_stats", device=device)
    return dict(STATS)


def mem_get_info(device=None) -> tuple[int, int]:
    _note("mem_get_info", device=device)
    return (1 * 2**30, 80 * 2**30)


# stand-in function -> the torch function it stands for (the signature check walks this)
REAL = {
    start: "torch.cuda.profiler.start",
    stop: "torch.cuda.profiler.stop",
    range_push: "torch.cuda.nvtx.range_push",
    range_pop: "torch.cuda.nvtx.range_pop",
    emit_nvtx: "torch.autograd.profiler.emit_nvtx",
    _record_memory_history: "torch.cuda.memory._record_memory_history",
    _dump_snapshot: "torch.cuda.memory._dump_snapshot",
    memory_stats: "torch.cuda.memory_stats",
    mem_get_info: "torch.cuda.mem_get_info",
}
NAMES = {  # journal name -> stand-in function, for the keyword check
    "profiler_start": start,
    "profiler_stop": stop,
    "range_push": range_push,
    "range_pop": range_pop,
    "emit_nvtx": emit_nvtx,
    "record_memory_history": _record_memory_history,
    "dump_snapshot": _dump_snapshot,
    "memory_stats": memory_stats,
    "mem_get_info": mem_get_info,
}


def api() -> profiling.CudaApi:
    return profiling.CudaApi(
        profiler_start=start,
        profiler_stop=stop,
        range_push=range_push,
        range_pop=range_pop,
        emit_nvtx=emit_nvtx,
        record_memory_history=_record_memory_history,
        dump_snapshot=_dump_snapshot,
        memory_stats=memory_stats,
        mem_get_info=mem_get_info,
    )


def install(path: Optional[str] = None) -> None:
    """Route tricorn's CUDA profiling and allocator calls here (journal lines appended to `path`, when given)."""
    global _path
    _path = path
    if path is not None and os.path.exists(path):
        os.unlink(path)
    JOURNAL.clear()
    CALLED.clear()
    profiling.install_stand_in(api())


def uninstall() -> None:
    profiling.install_stand_in(None)
