"""Test hook: make a rank fail inside the step, as a dead, stopped or stuck rank does in production.

``TRICORN_TEST_FAULT="RANK:ITERATION:KIND[:RESTART][,...]"`` (an environment variable, never a flag: nothing a
user runs sets it) makes global rank RANK, at the start of iteration ITERATION's forward/backward, do KIND; with
RESTART, only in the run whose $SLURM_RESTART_COUNT (0 when unset) is RESTART (a requeued job does not repeat it):

- ``kill``: SIGKILL itself (a crashed process, an OOM kill);
- ``stop``: SIGSTOP itself (a frozen process: no thread runs, not even the heartbeat). A reaper process then
  SIGKILLs it once every other rank of the job has exited, so that the launch ends;
- ``sleep``: ``time.sleep`` for an hour in the main thread (stuck in Python: the heartbeat thread goes on);
- ``oom``: the next module forward raises ``torch.OutOfMemoryError`` with CUDA's message (an allocation that does
  not fit), from inside the model, as a real one would (training/oom.py reports it).

Read once per process; no collectives, no memory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from functools import lru_cache

ENV = "TRICORN_TEST_FAULT"
KINDS = ("kill", "stop", "sleep", "oom")

# Waits until no pid given is a live process (gone, or a zombie its parent has not reaped), then kills the target.
_REAPER = """
import os, sys, time
def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
target, peers = int(sys.argv[1]), [int(p) for p in sys.argv[2:]]
while any(alive(p) for p in peers) and alive(target):
    time.sleep(0.1)
os.kill(target, 9)
"""


@lru_cache(maxsize=1)
def planned() -> dict[tuple[int, int], str]:
    """(rank, iteration) -> kind, from $TRICORN_TEST_FAULT."""
    out = {}
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    for item in filter(None, os.environ.get(ENV, "").split(",")):
        rank, iteration, kind, *only = item.split(":")
        if kind not in KINDS:
            raise ValueError(f"{ENV}: unknown kind {kind!r}; use one of {', '.join(KINDS)}")
        if not only or only[0] == restart:
            out[(int(rank), int(iteration))] = kind
    return out


def peer_pids() -> list[int]:
    """Every rank's pid, as the watchdog published them in the job's store (one rank a host: the tests' case)."""
    import torch.distributed as dist

    from tricorn.training.watchdog import PREFIX

    store = dist.distributed_c10d._get_default_store()
    return [int(v) for v in store.multi_get([f"{PREFIX}pid/{r}" for r in range(dist.get_world_size())])]


def maybe_inject(rank: int, iteration: int) -> None:
    """Do the planned fault of (rank, iteration), if any."""
    kind = planned().get((rank, iteration)) if os.environ.get(ENV) else None
    if kind is None:
        return
    print(f"tricorn: test fault: rank {rank} {kind} at iteration {iteration} ({time.time():.3f})", file=sys.stderr, flush=True)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "stop":
        peers = [str(p) for p in peer_pids() if p != os.getpid()]
        subprocess.Popen([sys.executable, "-c", _REAPER, str(os.getpid()), *peers], start_new_session=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "oom":
        _raise_in_next_forward()
    else:
        time.sleep(3600)


# What the CUDA caching allocator says (torch 2.13, c10/cuda/CUDACachingAllocator.cpp), with made-up figures.
OOM_MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which 1.25 GiB is free. "
    "Of the allocated memory 71.20 GiB is allocated by PyTorch, and 6.40 GiB is reserved by PyTorch but unallocated."
)


def _raise_in_next_forward() -> None:
    import torch

    def hook(module, args):
        handle.remove()
        raise torch.OutOfMemoryError(OOM_MESSAGE)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
