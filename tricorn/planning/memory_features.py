"""The memory features `tricorn plan` turns on where a layout does not fit (issue 43), cheapest first.

    bf16 moments        --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16: Adam's moments
                        stored in bf16 (4 bytes per parameter less, sharded like them); the update stays fp32, the
                        master fp32 (parallel/precision.py). No time; a small change of the numerics
                        (docs/distributed-optimizer.md states the bound).
    FP8 weights         --fp8-param-gather, only where the run is FP8 already (native, tensorwise) with the
                        distributed optimizer: the four linears' weights stored and gathered in FP8.
    activation offload  --cpu-offloading-num-layers N, the least N that fits: each chunk's first N layers' saved
                        activations wait in host memory (parallel/offload.py); costs what the host link does not
                        hide behind compute (host_time.py).
    optimizer offload   --optimizer-cpu-offload: master weights and moments in host memory, the host steps; costs
                        the gradients' trip down and the host's AdamW (host_time.py). Its host memory must fit in
                        HOST_MEMORY_FRACTION of this GPU's share of the node's (hardware.py).

A layout that fits as it is gets no feature (each costs time or changes numerics). One that does not is tried
with each set in ``SETS`` (and FP8 weights beside each where they apply); every set that fits is a candidate,
ranked by predicted time like any other layout, and among ties the one with fewer features is preferred.
Before the sets, the leanest of them all (optimizer offload with every layer offloaded) is tried: if even that
does not fit, neither does any set, nor a larger micro batch of the same layout.

No collectives, no device work.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Optional

from tricorn.config import ModelConfig
from tricorn.planning.layout import Layout
from tricorn.planning.memory import MemoryEstimate, stage_layer_counts

HOST_MEMORY_FRACTION = 0.8  # assumption: the OS, the data loader's workers and pinned pools take the rest
BF16_MOMENTS = dict(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
# The sets tried, in order of what they cost: (bf16 moments, activation offload, optimizer offload).
SETS: tuple[tuple[bool, bool, bool], ...] = (
    (True, False, False),
    (False, True, False),
    (True, True, False),
    (False, False, True),
    (False, True, True),
)


def features_of(lay: Layout) -> tuple[str, ...]:
    """The memory features a layout uses, as short names (the planner's table)."""
    out = []
    if lay.exp_avg_dtype != "fp32" or lay.exp_avg_sq_dtype != "fp32":
        out.append("bf16-moments")
    if lay.fp8_param_gather:
        out.append("fp8-weights")
    if lay.offload_layers:
        out.append(f"act-offload:{lay.offload_layers}")
    if lay.optimizer_offload:
        out.append("opt-offload")
    return tuple(out)


def chunk_layers(model: ModelConfig, lay: Layout) -> int:
    """Layers of the smallest model chunk: the most --cpu-offloading-num-layers may be (validation's rule)."""
    counts = stage_layer_counts(model.num_layers, lay.pp, lay.first_stage_layers, lay.last_stage_layers)
    chunks = lay.vpp if lay.pp > 1 else 1
    return min(c // chunks for c in counts)


def _with(lay: Layout, moments: bool, offload: int, optimizer: bool, fp8: bool) -> Layout:
    extra = dict(BF16_MOMENTS) if moments else {}
    return dataclasses.replace(lay, offload_layers=offload, optimizer_offload=optimizer, fp8_param_gather=fp8, **extra)


def leanest_variant(model: ModelConfig, lay: Layout) -> Layout:
    """``lay`` with the features that free the most device memory: optimizer offload, every layer's activations
    offloaded, and FP8 primary weights where they apply."""
    return _with(lay, False, chunk_layers(model, lay), True, _fp8_options(lay)[-1])


def fastest_variant(lay: Layout) -> Layout:
    """The layout with the two features that make a step faster (bf16 moments: a lighter AdamW; FP8 weights: a
    lighter gather, where they apply) and none that cost time: no variant of ``lay`` predicts a shorter step."""
    return _with(lay, True, 0, False, bool(_fp8_options(lay)[-1]))


def _fp8_options(lay: Layout) -> tuple[bool, ...]:
    eligible = lay.fp8_recipe == "tensorwise" and lay.transformer_impl == "local" and lay.zero_stage
    return (False, True) if eligible else (False,)


def fits(est: MemoryEstimate, usable: float, host_usable: float) -> bool:
    return est.total_bytes <= usable and est.host_bytes <= host_usable


def variants(
    model: ModelConfig, lay: Layout, usable: float, host_usable: float, estimate: Callable[[Layout], MemoryEstimate]
) -> tuple[list[tuple[Layout, MemoryEstimate]], Optional[tuple[Layout, MemoryEstimate]]]:
    """(every feature set with which ``lay`` fits, as (layout, estimate); the leanest variant tried), for a
    layout that does not fit as it is. ``estimate``: the worst rank's estimate of a layout."""
    most = chunk_layers(model, lay)
    fp8_options = _fp8_options(lay)
    leanest = leanest_variant(model, lay)
    lean = estimate(leanest)
    if not fits(lean, usable, host_usable):
        return [], (leanest, lean)
    found = []
    for fp8 in fp8_options:
        fitted: list[tuple[bool, bool]] = []  # (moments, optimizer) of the sets that fit without activation offload
        for moments, offload, optimizer in SETS:
            if offload and any(m <= moments and o <= optimizer for m, o in fitted):
                continue  # offloading activations on top of a set that fits already only costs time
            if not offload:
                v = _with(lay, moments, 0, optimizer, fp8)
                est = estimate(v)
                if fits(est, usable, host_usable):
                    found.append((v, est))
                    fitted.append((moments, optimizer))
                continue
            best = _least_offload(lay, moments, optimizer, fp8, most, usable, host_usable, estimate)
            if best is not None:
                found.append(best)
    return found, (leanest, lean)


def _least_offload(
    lay: Layout, moments: bool, optimizer: bool, fp8: bool, most: int, usable: float, host_usable: float, estimate
) -> Optional[tuple[Layout, MemoryEstimate]]:
    """The fewest offloaded layers (1..most) with which the layout fits; None if even ``most`` does not. The device
    memory falls about linearly in N (each layer's share of every microbatch in flight): start from the N the line
    through N = 0 and N = most asks for, then step up to the first that fits (or down while one still does)."""
    top = _with(lay, moments, most, optimizer, fp8)
    top_est = estimate(top)
    if not fits(top_est, usable, host_usable):
        return None
    base = estimate(_with(lay, moments, 0, optimizer, fp8)).total_bytes
    saved_per_layer = (base - top_est.total_bytes) / most
    n = min(most, max(1, math.ceil((base - usable) / saved_per_layer))) if saved_per_layer > 0 else most
    best: Optional[tuple[Layout, MemoryEstimate]] = None
    while n <= most:
        v = _with(lay, moments, n, optimizer, fp8)
        est = estimate(v) if n < most else top_est
        if fits(est, usable, host_usable):
            best = (v, est)
            break
        n += 1
    assert best is not None  # n = most fits
    while best[0].offload_layers > 1:  # fewer may fit where the line was pessimistic (the transient of two layers)
        v = _with(lay, moments, best[0].offload_layers - 1, optimizer, fp8)
        est = estimate(v)
        if not fits(est, usable, host_usable):
            break
        best = (v, est)
    return best
