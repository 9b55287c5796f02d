"""Bytes of model state each rank actually holds, measured from tensor storages after the first iteration.

Categories (the memory estimator uses the same keys):
  params_bytes           model parameters: their flat bucket storage (ZeRO-3: the owned shards;
                         gathered layers are freed by the time this runs)
  grads_bytes            main_grad buffers, or the ZeRO-2/3 gradient shards, plus gradient staging
  master_params_bytes    fp32 master copies (0 when fp32 parameters are their own master)
  optimizer_state_bytes  Adam moments and step counters

Peaks (peak.py, during iteration 1 only, so later iterations pay nothing): peak_bytes and peak_<kind>_bytes,
the highest total of live storages and its split by the categories above plus activations (everything
else: saved activations, logits, buffers, temporaries); on CUDA also peak_allocated_bytes from
torch.cuda.max_memory_allocated. rank 0's summary line names the highest peak.

Activations (activation_probe.py, saved-tensor hooks during iteration 1): activation_bytes_per_layer,
activation_bytes_other (embedding, head, loss) per microbatch, and peak_microbatches_in_flight.

Every storage counts once (by data pointer), in the first category that holds
it, at its full allocated size (padding included). Tensors in host memory
(--optimizer-cpu-offload; on a CPU run, what tricorn/pinned.py registers as host)
are reported as host_bytes rather than in the four device categories.

Output: memory_report.json - a JSON list, one entry per rank - written
atomically into --tensorboard-dir, else the --save dir, else nowhere; rank 0
prints one summary line. Collective: one all_gather_object over all ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from tricorn import pinned
from tricorn.config import Config
from tricorn.parallel.state import ParallelState
from tricorn.training.activation_probe import trainer_report_entry
from tricorn.training.peak import PeakTracker

KEYS = ("params_bytes", "grads_bytes", "master_params_bytes", "optimizer_state_bytes")
FILENAME = "memory_report.json"


def measure(tensors: dict[str, list[torch.Tensor]], device: torch.device) -> dict[str, int]:
    """Storage bytes per category; `tensors` maps 'params'/'grads'/'master_params'/'optimizer_state' to tensors."""
    seen: set[int] = set()
    out = {key: 0 for key in KEYS} | {"host_bytes": 0}
    for key in KEYS:
        for t in tensors.get(key.removesuffix("_bytes"), []):
            storage = t.untyped_storage()
            where = storage._cdata  # the StorageImpl (fake tensors, used by `tricorn simulate`, have no data pointer)
            if storage.nbytes() == 0 or where in seen:
                continue
            seen.add(where)
            on_device = t.device.type == device.type and pinned.host_kind(t) is None  # a CPU run registers host memory
            out[key if on_device else "host_bytes"] += storage.nbytes()
    return out


@contextlib.contextmanager
def iteration_peak(optimizer, chunks: list[nn.Module], device: torch.device, by_kind: bool = True) -> Iterator[dict[str, int]]:
    """Around one iteration: its peak bytes by kind (training/peak.py), filled in when the block ends.

    Keys: peak_bytes and peak_<kind>_bytes for params, grads, master_params, optimizer_state and activations;
    on CUDA also peak_allocated_bytes, the caching allocator's own high-water mark (torch.cuda). Without
    `by_kind` (--torch-compile: the tracker is a TorchDispatchMode, under which dynamo would never compile the
    layers, and it could not see the compiled kernels' allocations anyway) only the CUDA high-water mark.
    """
    out: dict[str, int] = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if by_kind:
        existing = [t for ts in optimizer.memory_tensors().values() for t in ts] + [b for c in chunks for b in c.buffers()]
        with PeakTracker(optimizer.memory_tensors, existing) as tracker:
            yield out
        out.update({"peak_bytes": tracker.peak_bytes} | {f"peak_{k}": v for k, v in tracker.peak_by_kind.items()})
    else:
        yield out
    if device.type == "cuda":
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)


def report_path(cfg: Config) -> Optional[Path]:
    folder = cfg.logging.tensorboard_dir or cfg.checkpoint.save
    return Path(folder) / FILENAME if folder else None


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _peak_text(entries: list[dict]) -> str:
    """The highest iteration-1 peak over the ranks, by kind."""
    if not all("peak_bytes" in e for e in entries):
        if entries and all("peak_allocated_bytes" in e for e in entries):  # --torch-compile on CUDA: no split by kind
            top = max(entries, key=lambda e: e["peak_allocated_bytes"])
            return f" | iteration-1 peak {_mib(top['peak_allocated_bytes'])} on rank {top['rank']} (CUDA allocator)"
        return ""
    top = max(entries, key=lambda e: e["peak_bytes"])
    kinds = ", ".join(
        f"{k} {_mib(top[f'peak_{k}_bytes'])}" for k in ("params", "grads", "master_params", "optimizer_state", "activations")
    )
    return f" | iteration-1 peak {_mib(top['peak_bytes'])} on rank {top['rank']} ({kinds})"


def write_memory_report(cfg: Config, state: ParallelState, optimizer, peak: Optional[dict] = None) -> list[dict]:
    """Measure on every rank, gather to all, and (rank 0) write the file and print the summary. Returns the entries.

    `peak`: what ``iteration_peak`` measured during iteration 1 (added to the entry and the summary)."""
    entry = {
        "rank": state.rank,
        **measure(optimizer.memory_tensors(), state.device),
        **(peak or {}),
        "tp_rank": state.tp_rank,
        "pp_rank": state.pp_rank,
        "dp_rank": state.dp_rank,
        "cp_rank": state.cp_rank,
        "params_dtype": cfg.param_dtype_name,
        "use_distributed_optimizer": optimizer.opts.distributed,
        "zero_stage": optimizer.opts.stage,
        "optimizer_cpu_offload": cfg.parallel.optimizer_cpu_offload,
        "device": state.device.type,
    }
    entry["total_bytes"] = sum(entry[k] for k in KEYS)
    entry |= trainer_report_entry()  # activation bytes saved for backward in iteration 1 (activation_probe.py)
    entries: list[dict] = [{}] * state.world_size
    dist.all_gather_object(entries, entry)
    if state.rank == 0:
        path = report_path(cfg)
        if path is not None:
            _write_atomic(path, json.dumps(entries, indent=1) + "\n")
        worst = {k: max(e[k] for e in entries) for k in (*KEYS, "total_bytes")}
        print(
            f"memory report (max per rank over {len(entries)}): params {_mib(worst['params_bytes'])} | "
            f"grads {_mib(worst['grads_bytes'])} | master params {_mib(worst['master_params_bytes'])} | "
            f"optimizer state {_mib(worst['optimizer_state_bytes'])} | total {_mib(worst['total_bytes'])}"
            + _peak_text(entries)
            + (f" -> {path}" if path is not None else ""),
            flush=True,
        )
    return entries
