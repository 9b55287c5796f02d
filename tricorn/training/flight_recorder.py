"""The flight recorder: each rank's last collectives, dumped by every live rank when the watchdog names a hang.

``--flight-recorder-dump-path DIR`` (Megatron's name) turns torch's recorder on before the process group exists:
TORCH_FR_BUFFER_SIZE (``--flight-recorder-trace-buffer-size``, 2000 collectives), TORCH_FR_DUMP_TEMP_FILE and
its older name TORCH_NCCL_DEBUG_INFO_TEMP_FILE (``DIR/rank_``: NCCL's own dump on a timeout lands there as
``rank_<R>``) and TORCH_NCCL_DUMP_ON_TIMEOUT. A variable already set in the environment wins (one line says so).
gloo (torch 2.13) records into the same recorder as NCCL does, so the CPU tests run the real thing.

``dump`` (called by the watchdog's thread when it concludes: the main thread may be stuck in a collective)
writes this rank's buffer as torch's pickle, ``torch._C._distributed_c10d._dump_fr_trace`` (NCCL's own buffer,
``_dump_nccl_trace``, on CUDA builds), to ``<prefix><rank>`` atomically. gloo leaves the dump's ``pg_config``
empty, so each group's name, description and ranks are filled in as NCCL writes them: torch's analyser
(``python -m torch.distributed.flight_recorder.fr_trace DIR``) then reads the gloo dumps too, and
``tricorn fr-trace DIR`` (tricorn/fr_trace.py) adds tricorn's group names (``tricorn_groups``: "dp 0,2").
No collectives; the buffer holds a few hundred bytes per collective.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import MutableMapping
from typing import Optional

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
OLD_BUFFER_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"  # the pre-2.10 name, which torch 2.13 still reads (with a warning)
DUMP_ENV = "TORCH_FR_DUMP_TEMP_FILE"
OLD_DUMP_ENV = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
ON_TIMEOUT_ENV = "TORCH_NCCL_DUMP_ON_TIMEOUT"
FILE_PREFIX = "rank_"


def configure(cfg, env: MutableMapping[str, str] = os.environ, rank: int = 0) -> Optional[str]:
    """Set torch's recorder variables from the flags (before init_process_group); returns the dump prefix, or None
    when the recorder is off."""
    p = cfg.parallel
    if p.flight_recorder_dump_path:
        wanted = {
            BUFFER_ENV: str(p.flight_recorder_trace_buffer_size),
            DUMP_ENV: os.path.join(os.path.abspath(p.flight_recorder_dump_path), FILE_PREFIX),
            ON_TIMEOUT_ENV: "1",
        }
        kept = [f"{k}={env[k]}" for k, v in wanted.items() if k in env and env[k] != v]
        for k, v in wanted.items():
            env.setdefault(k, v)
        env.setdefault(OLD_DUMP_ENV, env[DUMP_ENV])
        if kept and rank == 0:
            print(f"tricorn: warning: flight recorder: keeping {', '.join(kept)} from the environment over the flags", flush=True)
    return dump_prefix(env)


def dump_prefix(env: MutableMapping[str, str] = os.environ) -> Optional[str]:
    """Where this job's dumps go (`prefix` + rank), when the recorder's buffer is on and a dump file is named."""
    size = env.get(BUFFER_ENV) or env.get(OLD_BUFFER_ENV) or "0"
    prefix = env.get(DUMP_ENV) or env.get(OLD_DUMP_ENV)
    return prefix if prefix and size.isdigit() and int(size) > 0 else None


def group_table(labels: dict[int, str]) -> tuple[dict, dict]:
    """(pg_config as NCCL writes it, c10d group name -> tricorn's "dp 0,2") for every process group of this rank."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    config, names = {}, {}
    for pg, name in list(_world.pg_names.items()):
        try:
            ranks = dist.get_process_group_ranks(pg)
        except (RuntimeError, ValueError):  # destroyed meanwhile
            continue
        config[name] = {"name": name, "desc": getattr(pg, "group_desc", "") or "", "ranks": str(ranks)}
        if id(pg) in labels:
            names[name] = labels[id(pg)]
    return config, names


def dump(prefix: str, rank: int, labels: dict[int, str], backend: str) -> str:
    """Write this rank's flight-recorder buffer to ``prefix<rank>`` (atomically); returns the path."""
    import torch._C._distributed_c10d as c10d

    raw = getattr(c10d, "_dump_nccl_trace", None) if backend == "nccl" else None
    data = pickle.loads((raw or c10d._dump_fr_trace)())
    config, names = group_table(labels)
    recorded = {k: v for k, v in (data.get("pg_config") or {}).items() if k and v.get("ranks") not in (None, "[]")}
    data["pg_config"] = {**config, **recorded}  # NCCL's own entries, where it wrote them, stay as they are
    data["tricorn_groups"] = names
    data["tricorn_rank"] = rank
    path = f"{prefix}{rank}"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as fh:
        pickle.dump(data, fh)
    os.replace(tmp, path)
    return path
