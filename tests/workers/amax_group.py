"""Worker: the FP8 amax reduction group is TP x DP x CP of one pipeline stage (argv: layout flags).
Rank 0 prints the ranks of its group."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import torch.distributed as dist  # noqa: E402
from harness import BASE_FLAGS  # noqa: E402

from tricorn.parallel.state import init_parallel  # noqa: E402
from tricorn.parallel.te import amax_reduction_group  # noqa: E402
from tricorn.training.main import resolve_config  # noqa: E402

state = init_parallel(resolve_config(BASE_FLAGS + sys.argv[1:]))
ranks = dist.get_process_group_ranks(amax_reduction_group(state.mesh))
if state.rank == 0:
    print(ranks)
