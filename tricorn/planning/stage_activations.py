"""Transformer-layer activations alive on a pipeline stage: microbatches in flight, recompute groups, offloaded layers.

A model chunk is a row of *units*, each what one checkpointed region or layer keeps for backward per microbatch
(activations.py ``layout_layer_bytes``): a layer; under full recompute (uniform) a group of N layers keeping its
input, and while its backward runs the group rebuilt (``rebuilt``); under full recompute (block) the first N
layers keeping their inputs and the rest whole, one layer rebuilt at a time.

Activation offload (--cpu-offloading-num-layers N, tricorn/parallel/offload.py) sends the units of the chunk's
first N layers to host memory at the end of each one's forward (under full recompute: the groups whose first
layer is among them). What stays on the device per microbatch (``kept``) is the other units, and - on every chunk
but the first stage's first, whose input is the embedding's output - the chunk's input, which the pipeline
executor holds anyway and offload therefore leaves (e*s*b*h, /TP under SP). When the backward reaches an offloaded
unit it is brought back together with the one before it (prefetched), and the first kept unit's backward already
brings the last offloaded one back: one microbatch then holds the largest pair of neighbours among the first N + 1
units (``transient``), after its later units were freed. So the stage holds, with m microbatches in flight,

    m * kept + rebuilt + max(0, transient - kept_of_the_chunk)

- the end of the forwards in flight, or the backward of the offloaded units if that is higher. (On CUDA a unit's
copy to host overlaps the next unit's forward, so two units of one microbatch are there in forward too: the same
bound.) Host memory: m times the offloaded bytes of every chunk. With no offload, ``kept`` is every unit and the
formula is the plain m * layers + rebuilt.

No collectives, no device work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tricorn.config import ModelConfig
from tricorn.planning.activations import ActivationProfile, activation_element_bytes, layout_layer_bytes, microbatches_in_flight
from tricorn.planning.layout import Layout


@dataclass(frozen=True)
class ChunkUnits:
    """One model chunk of a stage: its units' bytes per microbatch in forward order, and the group its backward rebuilds."""

    units: list[float]
    rebuilt: float
    offloaded: int  # how many of the first units go to host


def chunk_units(model: ModelConfig, layout: Layout, layers: int, profile: ActivationProfile) -> ChunkUnits:
    """The units of a chunk of ``layers`` layers (module docstring)."""
    if layout.recompute != "full":
        units = [layout_layer_bytes(model, layout, profile)] * layers
        return ChunkUnits(units, 0.0, min(layout.offload_layers, layers))
    full_layer = layout_layer_bytes(model, layout, profile, recompute=None)
    stored = layout_layer_bytes(model, layout, profile)
    n = max(1, layout.recompute_num_layers or 1)
    offload = min(layout.offload_layers, layers)
    if layout.recompute_method == "block":
        recomputed = min(n, layers)
        return ChunkUnits([stored] * recomputed + [full_layer] * (layers - recomputed), full_layer, offload)
    groups = -(-layers // n)  # uniform: one stored input per group of n layers, one group rebuilt at a time
    return ChunkUnits([stored] * groups, min(n, layers) * full_layer, -(-offload // n))


def input_bytes(model: ModelConfig, layout: Layout) -> float:
    """A chunk's input for one microbatch (e*s*b*h, the sequence shard under SP)."""
    sp = layout.tp if layout.sequence_parallel else 1
    tokens = model.seq_length // layout.cp * layout.micro_batch
    return activation_element_bytes(layout.precision) * tokens * model.hidden_size / sp


@dataclass(frozen=True)
class StageActivations:
    """Per microbatch on the device (``kept``: all chunks) and in host memory; in the backward, the group rebuilt
    (``rebuilt``) and what the offloaded units' return holds beyond the chunk's kept units (``returned``)."""

    kept: float
    host: float
    rebuilt: float
    returned: float = 0.0


def stage_units(
    model: ModelConfig,
    layout: Layout,
    stage: int,
    layers: int,
    profile: ActivationProfile,
    chunks: Optional[int] = None,
    received: Optional[int] = None,
) -> StageActivations:
    """The ``layers`` of ``stage`` in ``chunks`` model chunks (default: the layout's virtual stages), ``received`` of
    which take a received input (default: all but the first stage's first)."""
    chunks = chunks or (layout.vpp if layout.pp > 1 else 1)
    c = chunk_units(model, layout, layers // chunks, profile)
    if received is None:
        received = chunks - (1 if stage == 0 else 0)
    units, k = c.units, c.offloaded
    if k == 0:
        return StageActivations(sum(units) * chunks, 0.0, c.rebuilt)
    # The first unit's part of a received input stays on the device on `received` chunks; it goes nowhere.
    retained = min(input_bytes(model, layout), units[0])
    moved = [u - (retained if j == 0 else 0.0) for j, u in enumerate(units[:k])]
    kept = sum(units[k:])
    back = moved + units[k : k + 1]  # the offloaded units and the first kept one, whose backward prefetches
    transient = max([back[0]] + [a + b for a, b in zip(back, back[1:])])
    return StageActivations(
        kept=kept * chunks + retained * received,
        host=sum(moved) * chunks + retained * (chunks - received),
        rebuilt=c.rebuilt,
        returned=max(0.0, transient - kept),
    )


def stage_activation_bytes(
    model: ModelConfig,
    layout: Layout,
    stage: int,
    layers: int,
    profile: ActivationProfile,
    in_flight: Optional[float] = None,
    chunks: Optional[int] = None,
    received: Optional[int] = None,
) -> float:
    """Transformer-layer activations alive on ``stage`` at its peak, with ``in_flight`` microbatches (default: the
    schedule's ``microbatches_in_flight``): m * kept + the backward's extra (module docstring)."""
    if in_flight is None:
        in_flight = microbatches_in_flight(layout, stage)
    s = stage_units(model, layout, stage, layers, profile, chunks, received)
    return s.kept * in_flight + s.rebuilt + s.returned


def offload_host_bytes(model: ModelConfig, layout: Layout, stage: int, layers: int, profile: ActivationProfile) -> float:
    """Host memory of the offloaded activations at the stage's peak: every microbatch in flight's offloaded units."""
    return stage_units(model, layout, stage, layers, profile).host * microbatches_in_flight(layout, stage)
