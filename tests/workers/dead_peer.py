"""Worker: rank 1 stops itself (SIGSTOP) after one all-reduce; rank 0's next collective times out.

Rank 0 prints the line `collective_failure` makes of gloo's error (or "unrecognised: ..."), and exits 1.
The timeout is 3 seconds, set directly on the process group: --distributed-timeout-minutes is too
coarse for a test. The caller kills the stopped rank.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from tricorn.parallel.failures import collective_failure

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=3))
t = torch.ones(4)
dist.all_reduce(t)
if rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
try:
    dist.all_reduce(t)
except RuntimeError as e:
    line = collective_failure(e, rank, 2, 0.05)
    print(line or f"unrecognised: {e}", flush=True)
    sys.exit(1)
