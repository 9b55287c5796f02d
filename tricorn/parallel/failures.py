"""A collective that failed because a peer is dead or stopped, as one line instead of a backend traceback.

gloo reports a dead or stopped peer as "Timed out waiting Nms for recv operation to complete",
"Connection closed by peer [ip]:port" or "Application timeout caused pair closure"; NCCL's watchdog as
"... timeout: WorkNCCL(SeqNum=.., OpType=ALLREDUCE, ...)". `collective_failure` recognises these and
names what can be known: the collective (NCCL's OpType, or the torch.distributed function in the
traceback, e.g. all_reduce or barrier), the peer rank (only when the world has two ranks: the
messages carry an address, not a rank), and the timeout. In a training run the hang watchdog
(tricorn/training/watchdog.py) then names the rank that is gone at any world size, from the heartbeats;
this line is the fallback when it cannot. No collectives, no memory.
"""

from __future__ import annotations

import re
from typing import Optional

_PEER_GONE = (
    re.compile(r"Timed out waiting \d+ ?ms for (?:send|recv) operation"),
    re.compile(r"Connection closed by peer"),
    re.compile(r"Connection reset by peer"),
    re.compile(r"pair closure"),
    re.compile(r"Watchdog caught collective operation timeout"),
)
_NCCL_OP = re.compile(r"OpType=(\w+)")
_C10D_FILE = "distributed_c10d.py"


def collective_name(exc: BaseException) -> Optional[str]:
    """The collective that raised: NCCL's OpType, else the innermost torch.distributed function in the traceback."""
    op = _NCCL_OP.search(str(exc))
    if op:
        return op.group(1).lower()
    name, tb = None, exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.endswith(_C10D_FILE) and not code.co_name.startswith("_"):
            name = code.co_name
        tb = tb.tb_next
    return name


def collective_failure(exc: BaseException, rank: int, world_size: int, timeout_minutes: float) -> Optional[str]:
    """One line for a collective that failed because a peer died or stopped; None for any other error."""
    text = str(exc)
    if not any(p.search(text) for p in _PEER_GONE):
        return None
    peer = f"rank {1 - rank}" if world_size == 2 else "a peer rank"
    op = collective_name(exc)
    during = f"in {op}" if op else "in a collective"
    return (
        f"rank {rank}: {peer} did not answer {during} within --distributed-timeout-minutes {timeout_minutes:g}; "
        "it died or is stopped (see its log), resume from the last checkpoint with --load"
    )


def peer_named(line: str) -> Optional[int]:
    """The peer rank a collective_failure line names, if any (rank 0 reports; a peer of dead rank 0 reports too)."""
    found = re.search(r": rank (\d+) did not answer", line)
    return int(found.group(1)) if found else None
