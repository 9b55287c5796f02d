"""What the logger measures on each rank: memory, the parameter norm, parameter counts, a max over ranks.

Collectives: ``params_norm`` one scalar all-reduce over TP x PP (inside ZeRO-3's parameter gather when
the optimizer has one); ``parameter_counts`` one all-gather of 4 integers per rank over the world;
``max_over_ranks`` one all-reduce (max) of a short vector. Memory: scalars only (plus ZeRO-3's gather).
"""

from __future__ import annotations

import os
import resource
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def memory_bytes(device: torch.device) -> tuple[float, float]:
    """(allocated, max allocated): the CUDA caching allocator's figures, or on CPU the process RSS and its peak."""
    if device.type == "cuda":
        return float(torch.cuda.memory_allocated(device)), float(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    try:
        with open("/proc/self/statm") as fh:
            current = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no /proc (macOS): the peak is the best figure there is
        current = peak
    return float(current), float(max(peak, current))


def params_norm(chunks: list[torch.nn.Module], state: Any, optimizer: Any = None) -> float:
    """L2 norm of all parameters, each counted once over TP/PP (grads.py's rule); DP replicas are equal.

    ZeRO-3 keeps only a shard resident, so the norm is taken inside ``optimizer.gathered_params()``.
    """
    from tricorn.parallel.grads import counts_for_norm

    gathered = getattr(optimizer, "gathered_params", None)
    squares = torch.zeros((), dtype=torch.float32, device=state.device)
    with gathered() if gathered is not None else nullcontext():
        for chunk in chunks:
            for p in chunk.parameters():
                if counts_for_norm(p, state):
                    squares += p.detach().float().pow(2).sum()
    dist.all_reduce(squares, group=state.mp_group)
    return squares.sqrt().item()


@dataclass(frozen=True)
class ParameterCounts:
    total: int  # every parameter once (TP shards summed, TP/DP replicas and the tied head copy once)
    per_rank: list[int]  # what each world rank holds
    per_stage: list[int]  # per pipeline stage, each of its parameters once over TP (a tied head copy included)


def parameter_counts(chunks: list[torch.nn.Module], state: Any) -> ParameterCounts:
    """Collectives: one all-gather over the world (4 integers per rank)."""
    from tricorn.model.init import shard_info
    from tricorn.parallel.grads import counts_for_norm

    def once_over_tp(p: torch.Tensor) -> bool:  # TP shards on every TP rank, TP-replicated ones on TP rank 0
        info = shard_info(p)
        return (info is not None and info.world > 1) or state.tp_rank == 0

    params = [p for c in chunks for p in c.parameters()]
    replica0 = int(state.dp_rank == 0 and state.cp_rank == 0)  # DP/CP replicas hold the same parameters
    counted = sum(p.numel() for p in params if counts_for_norm(p, state)) * replica0
    on_stage = sum(p.numel() for p in params if once_over_tp(p)) * replica0  # a tied head copy counts here
    mine = torch.tensor([sum(p.numel() for p in params), counted, state.pp_rank, on_stage], device=state.device)
    rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    table = torch.stack(rows).cpu().tolist()
    per_stage = [0] * state.pp_size
    for _, _, pp, stage_part in table:
        per_stage[pp] += stage_part
    return ParameterCounts(sum(r[1] for r in table), [r[0] for r in table], per_stage)


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()
