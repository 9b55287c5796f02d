import os
import sys

# Multi-rank tests start several processes on a 2-core machine: one thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

# What tricorn.parallel.state.init_parallel writes into os.environ for a single process (RANK 0 of 1, a free
# MASTER_PORT). A test that runs it in the pytest process must not hand those to later tests' launches: an
# srun task that inherits RANK=0 WORLD_SIZE=1 takes it over SLURM_PROCID (tests/test_slurm_local.py failed so).
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


_SESSION_LAUNCH_ENV = {k: os.environ.get(k) for k in _LAUNCH_VARS}  # as pytest started (module fixtures too)


@pytest.fixture(autouse=True)
def _restore_launch_env():
    yield
    for k, v in _SESSION_LAUNCH_ENV.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
