"""How a run that cannot go on ends: one `tricorn: error:` line, an exit code, and torchrun's error file.

Exit codes: 2 for a config found bad before launch (a flag, the YAML, the layout, an output path, data
that does not fit the vocabulary), 1 for a damaged checkpoint, a NaN loss, or a bug (which prints its
traceback), 3 for a rank that ran out of memory (training/oom.py), 75 for a rank that stopped, died or got stuck
(the hang watchdog, training/watchdog.py). docs/launch-errors.md shows what a user sees under one process, torchrun and srun.

One rank prints the line (rank 0, or the survivor that names a dead rank 0), so a 512-rank launch shows
it once. Every failing rank also writes it to torchelastic's error file ($TORCHELASTIC_ERROR_FILE, which
torchrun sets for each worker) in the JSON layout of torch's ErrorHandler: torchrun's failure summary then
shows the line as the root cause's `traceback` instead of "To enable traceback see: ...".

Under a launcher that stops every worker once one has failed (torchrun; srun --kill-on-bad-exit=1, as in
scripts/slurm), a rank that does not print waits up to HEAD_START_S before it exits. Otherwise it could
exit first, and the launcher could stop the printing rank before its line is out. On the node of the
printing rank the wait ends as soon as that rank exits (the launcher stops the others then); a node
without it ends after the wait, with the line in its error file. No collectives, no torch import.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Optional

PREFIX = "tricorn: error: "
CONFIG_ERROR = 2  # found before launch: fix the command line, the YAML or a path
RUN_ERROR = 1  # a damaged checkpoint or data file, a NaN loss, a dead peer, a bug
# A rank stopped, died or got stuck (training/watchdog.py): sysexits' EX_TEMPFAIL, "try again" - the sbatch
# scripts requeue on it, from the last checkpoint.
HANG_ERROR = 75
# A rank ran out of device (or host) memory: each rank that did prints its own line (training/oom.py) and nothing is
# saved after it. Not requeued: the same layout runs out again.
OOM_ERROR = 3
HEAD_START_S = 10.0


def srun_task(env: Mapping[str, str] = os.environ) -> bool:
    """A task of an srun step not under torchrun: its identity is SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID alone.
    sbatch hands the submitting shell's environment on, so a RANK or WORLD_SIZE there (a torchrun session's) must
    not count; torchrun started by srun (one agent per node) sets TORCHELASTIC_RUN_ID and its RANK is right."""
    return "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "TORCHELASTIC_RUN_ID" not in env


def launch_rank(env: Mapping[str, str] = os.environ) -> int:
    """This process's global rank before any process group exists (torchrun's RANK, srun's SLURM_PROCID)."""
    if srun_task(env):
        return int(env["SLURM_PROCID"])
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"])
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return int(env["SLURM_PROCID"])
    return 0


_SLURM_OF = {"RANK": "SLURM_PROCID", "WORLD_SIZE": "SLURM_NTASKS", "LOCAL_RANK": "SLURM_LOCALID"}


def inherited_identity(env: Mapping[str, str] = os.environ) -> Optional[str]:
    """The one line for launch variables an srun task inherited that contradict SLURM's (None when none do)."""
    if not srun_task(env):
        return None
    wrong = [f"{k}={env[k]}" for k, slurm in _SLURM_OF.items() if k in env and env[k] != env.get(slurm, env[k])]
    if not wrong:
        return None
    return (
        f"ignoring {' '.join(wrong)} from the environment (exported by the shell that submitted the job): each srun task "
        f"takes its rank from SLURM (this is task {env['SLURM_PROCID']} of {env['SLURM_NTASKS']}); unset them before sbatch"
    )


def launcher_stops_peers(env: Mapping[str, str] = os.environ) -> bool:
    """True under torchrun (its agent stops every worker when one fails) or srun with several tasks."""
    if "TORCHELASTIC_RUN_ID" in env:
        return int(env.get("WORLD_SIZE", "1")) > 1
    return "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1


def fail(message: str, code: int, prints: bool, env: Mapping[str, str] = os.environ) -> int:
    """End this rank's run with `tricorn: error: message`: print it if `prints`, record it, return `code`."""
    line = PREFIX + message
    if prints:
        print(line, file=sys.stderr, flush=True)
    elif launcher_stops_peers(env):
        time.sleep(HEAD_START_S)  # the printing rank exits first; the launcher then stops this one
    write_error_file(line, env=env)
    return code


def write_error_file(message: str, callstack: Optional[str] = None, env: Mapping[str, str] = os.environ) -> None:
    """The root cause torchrun's summary shows for this rank (`callstack` is shown when given, else `message`)."""
    path = env.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    extra = {"py_callstack": callstack or message, "timestamp": str(int(time.time()))}
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": extra}}, f)
    except OSError:  # the summary then says "To enable traceback see ..."; the printed line still stands
        pass
