"""Worker: every process group that exists after start-up has --distributed-timeout-minutes (argv: layout flags).

Builds what a training run builds before its first step that creates groups: the mesh and its sub-groups
(init_parallel), the FP8 amax group (te.amax_reduction_group) and the checkpoint group (Checkpointer), then
walks every group torch knows of in this process (distributed_c10d's group registry, so a group created
anywhere is seen, not just the ones ParallelState names). Rank 0 prints one JSON line: {description: minutes}.
"""

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import torch.distributed as dist  # noqa: E402
from harness import BASE_FLAGS  # noqa: E402

from tricorn.checkpoint.checkpointer import Checkpointer  # noqa: E402
from tricorn.parallel.state import group_timeout, init_parallel  # noqa: E402
from tricorn.parallel.te import amax_reduction_group  # noqa: E402
from tricorn.training.main import resolve_config  # noqa: E402

with tempfile.TemporaryDirectory() as tmp:
    cfg = resolve_config(BASE_FLAGS + sys.argv[1:] + ["--save", tmp])
    state = init_parallel(cfg)
    amax_reduction_group(state.mesh)
    Checkpointer(cfg, state, console=lambda _line: None)
    # _world.pg_map: every ProcessGroup created in this process (torch 2.13, distributed_c10d.py), keyed by group.
    groups = list(dist.distributed_c10d._world.pg_map)
    named = {f"{g.group_desc}#{dist.distributed_c10d._get_process_group_name(g)}": group_timeout(g) for g in groups}
    minutes = {name: t.total_seconds() / 60 for name, t in named.items()}
    if state.rank == 0:
        print(json.dumps(minutes))
    dist.barrier()
    dist.destroy_process_group()
