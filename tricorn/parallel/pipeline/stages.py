"""Which global transformer layers each (pipeline rank, model chunk) holds, and pipeline config checks.

Layers are contiguous per virtual stage, and virtual stages are numbered as in Megatron:
model chunk ``c`` on pipeline rank ``r`` is virtual stage ``c * pp + r``. So with 8 layers,
pp=2 and 2 chunks per rank, rank 0 holds layers 0-1 (chunk 0) and 4-5 (chunk 1), rank 1
holds 2-3 and 6-7. On the v placement (``--pipeline-schedule zbv`` or ``dualpipev``) rank
``r`` holds stages ``r`` and ``2 pp - 1 - r``: rank 0 holds layers 0-1 and 6-7, rank 1
2-3 and 4-5. The embedding lives on virtual stage 0 and the final norm, head and loss
on the last virtual stage (``schedules.is_first_stage`` / ``is_last_stage``).

Splits:
* even: ``num_layers / (pp * vpp)`` layers per chunk;
* ``--decoder-first-pipeline-num-layers F`` / ``--decoder-last-pipeline-num-layers L``: rank 0
  (rank pp-1) holds F (L) layers, split evenly over its chunks, and the other ranks share the
  rest evenly (Megatron-core's uneven pipeline);
* chunks per rank come from ``--num-virtual-stages-per-pipeline-rank`` or from
  ``--num-layers-per-virtual-pipeline-stage`` (even splits only, as in Megatron).

No collectives and no device work happen here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from tricorn.parallel.pipeline.schedules import (
    LOOP,
    V_SCHEDULES,
    ZERO_BUBBLE,
    ScheduleError,
    placement_of,
    schedule_for,
    stage_owner,
    virtual_stage,
)


class StageSplitError(ValueError):
    """A layer split that cannot be built; the message is one line for the user."""


_FIRST = "--decoder-first-pipeline-num-layers"
_LAST = "--decoder-last-pipeline-num-layers"
_PP = "--pipeline-model-parallel-size"
_VPP_STAGES = "--num-virtual-stages-per-pipeline-rank"
_VPP_LAYERS = "--num-layers-per-virtual-pipeline-stage"


@dataclass(frozen=True)
class StageLayout:
    """Layer counts per virtual stage, in virtual-stage order (``counts[c * pp + r]``)."""

    num_layers: int
    pp: int
    vpp: int
    counts: tuple[int, ...]
    placement: str = LOOP  # schedules.LOOP or schedules.V: which rank holds which virtual stage

    def layers(self, pp_rank: int, chunk: int = 0) -> range:
        """Global layer ids of model chunk ``chunk`` on pipeline rank ``pp_rank``."""
        vs = virtual_stage(pp_rank, chunk, self.pp, self.placement)
        start = sum(self.counts[:vs])
        return range(start, start + self.counts[vs])

    def rank_layers(self, pp_rank: int) -> list[range]:
        """Layer ids of every chunk on a rank, chunk 0 first."""
        return [self.layers(pp_rank, c) for c in range(self.vpp)]

    def owner(self, layer: int) -> tuple[int, int]:
        """(pp rank, chunk) holding a global layer id."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.num_layers} layers")
        end = 0
        for vs, n in enumerate(self.counts):
            end += n
            if layer < end:
                return stage_owner(vs, self.pp, self.placement)
        raise AssertionError("counts do not sum to num_layers")


def stage_layout(num_layers: int, pp: int, vpp: int = 1, first: Optional[int] = None, last: Optional[int] = None) -> StageLayout:
    """Split ``num_layers`` over ``pp`` ranks x ``vpp`` chunks; raises StageSplitError naming the numbers."""
    if pp < 1 or vpp < 1 or num_layers < 1:
        raise StageSplitError(f"need at least one layer, rank and chunk, got {num_layers} layers, pp {pp}, {vpp} chunks")
    if (first is not None or last is not None) and pp == 1:
        raise StageSplitError(f"{_FIRST} / {_LAST} need {_PP} > 1")
    edges = {}
    for name, value, rank in ((_FIRST, first, 0), (_LAST, last, pp - 1)):
        if value is None:
            continue
        if value < 1:
            raise StageSplitError(f"{name} must be at least 1, got {value}")
        if value % vpp != 0:
            raise StageSplitError(f"{name} {value} is not divisible by the {vpp} model chunks per rank ({_VPP_STAGES})")
        edges[rank] = value
    middle_ranks = pp - len(edges)
    middle_layers = num_layers - sum(edges.values())
    if not edges:
        if num_layers % (pp * vpp) != 0:
            chunks = f" x {vpp} chunks per rank = {pp * vpp}" if vpp > 1 else ""
            raise StageSplitError(
                f"--num-layers {num_layers} is not divisible by {_PP} {pp}{chunks}; change the layer count "
                f"or give {_FIRST} / {_LAST} for an uneven split"
            )
    elif middle_ranks == 0:
        if middle_layers != 0:
            raise StageSplitError(
                f"{_FIRST} {first} + {_LAST} {last} = {first + last} must equal --num-layers {num_layers} with {_PP} 2"
            )
    elif middle_layers < middle_ranks * vpp or middle_layers % (middle_ranks * vpp) != 0:
        raise StageSplitError(
            f"--num-layers {num_layers} minus the uneven stages ({sum(edges.values())} layers) leaves {middle_layers}, "
            f"which does not split evenly into at least one layer per chunk over {middle_ranks} middle ranks x {vpp} chunks"
        )
    per_middle = middle_layers // (middle_ranks * vpp) if middle_ranks else 0
    counts = tuple(edges[r] // vpp if r in edges else per_middle for _c in range(vpp) for r in range(pp))
    return StageLayout(num_layers, pp, vpp, counts)


def _virtual_stages(cfg: Any) -> tuple[int, list[str]]:
    """Chunks per rank from the two virtual-pipeline flags, with the errors of combining them."""
    p, num_layers = cfg.parallel, cfg.model.num_layers
    pp = p.pipeline_model_parallel_size
    if p.num_layers_per_virtual_pipeline_stage and p.num_virtual_stages_per_pipeline_rank:
        return 1, [f"give either {_VPP_LAYERS} or {_VPP_STAGES}, not both"]
    if p.num_virtual_stages_per_pipeline_rank is not None:
        v = p.num_virtual_stages_per_pipeline_rank
        return v, [] if v >= 1 else [f"{_VPP_STAGES} must be at least 1, got {v}"]
    n = p.num_layers_per_virtual_pipeline_stage
    if n is None:
        return (2 if p.pipeline_schedule in V_SCHEDULES else 1), []
    if n < 1:
        return 1, [f"{_VPP_LAYERS} must be at least 1, got {n}"]
    if p.decoder_first_pipeline_num_layers is not None or p.decoder_last_pipeline_num_layers is not None:
        return 1, [f"{_VPP_LAYERS} does not combine with {_FIRST} / {_LAST}; use {_VPP_STAGES} instead"]
    if num_layers % (pp * n) != 0:
        return 1, [f"--num-layers {num_layers} is not divisible by {_PP} x {_VPP_LAYERS} = {pp} x {n} = {pp * n}"]
    return num_layers // (pp * n), []


def layout_from_config(cfg: Any) -> StageLayout:
    """The StageLayout of a validated Config (raises StageSplitError otherwise)."""
    vpp, errs = _virtual_stages(cfg)
    if errs:
        raise StageSplitError(errs[0])
    p = cfg.parallel
    layout = stage_layout(
        cfg.model.num_layers,
        p.pipeline_model_parallel_size,
        vpp,
        p.decoder_first_pipeline_num_layers,
        p.decoder_last_pipeline_num_layers,
    )
    return dataclasses.replace(layout, placement=placement_of(p.pipeline_schedule))


def validate_pipeline(cfg: Any) -> list[str]:
    """Every pipeline problem of a Config, one line each: layer split, virtual stages, schedule, microbatches."""
    p = cfg.parallel
    pp = p.pipeline_model_parallel_size
    if pp < 1:
        return []  # config.validate reports it
    vpp, errs = _virtual_stages(cfg)
    if errs:
        return errs
    try:
        layout_from_config(cfg)
    except StageSplitError as e:
        errs.append(str(e))
    if vpp > 1 and pp == 1:
        errs.append(f"virtual pipeline stages need {_PP} > 1, got {vpp} chunks on 1 rank")
    kind = p.pipeline_schedule
    if vpp > 1 and kind in ("gpipe", "zb-h1"):
        errs.append(f"--pipeline-schedule {kind} has no interleaved form; drop it or the virtual stages ({vpp} chunks per rank)")
    elif kind in ZERO_BUBBLE:
        errs += _zero_bubble_errors(cfg, kind, pp, vpp)
    if not errs and pp > 1 and (vpp > 1 or kind in ZERO_BUBBLE):
        errs += _batch_errors(cfg, pp, vpp)
    return errs


def _zero_bubble_errors(cfg: Any, kind: str, pp: int, vpp: int) -> list[str]:
    """What the zero-bubble schedules need of the layout and of the rest of the run."""
    p = cfg.parallel
    if pp < 2:
        return [f"--pipeline-schedule {kind} needs {_PP} >= 2"]
    if kind in V_SCHEDULES:
        if vpp != 2:
            return [
                f"--pipeline-schedule {kind} runs 2 model chunks per rank in a V; drop {_VPP_STAGES} / {_VPP_LAYERS} or set 2"
            ]
        if p.decoder_first_pipeline_num_layers is not None or p.decoder_last_pipeline_num_layers is not None:
            return [f"--pipeline-schedule {kind} needs an even layer split over the 2 x {pp} stages; drop {_FIRST} / {_LAST}"]
        if not cfg.model.untie_embeddings_and_output_weights:
            return [
                f"--pipeline-schedule {kind} puts the embedding and the head on pipeline rank 0 as two chunks; "
                "add --untie-embeddings-and-output-weights"
            ]
    if p.zero_stage_in_effect > 1:
        return [f"--pipeline-schedule {kind} defers weight gradients past the backward; it runs with --zero-stage 1 only"]
    if cfg.model.transformer_impl == "transformer_engine":
        return [f"--pipeline-schedule {kind} defers the weight gradients of tricorn's linears; use --transformer-impl local"]
    if cfg.model.torch_compile:
        return [f"--pipeline-schedule {kind} splits each backward in two; it does not combine with --torch-compile"]
    if cfg.training.fp8_format:
        return [f"--pipeline-schedule {kind} defers the linears' weight gradients, which the FP8 GEMMs do not; drop --fp8-format"]
    return []


def _batch_errors(cfg: Any, pp: int, vpp: int) -> list[str]:
    """Every global batch size the run uses (ramp-up included) must give a microbatch count the schedule can run."""
    from tricorn.parallel.batch_schedule import BatchScheduleError, rampup_batch_sizes

    t = cfg.training
    dp = cfg.data_parallel_size
    if dp < 1 or t.global_batch_size is None or t.micro_batch_size < 1:
        return []
    micro_dp = t.micro_batch_size * dp
    try:
        sizes = rampup_batch_sizes(t.rampup_batch_size, t.global_batch_size) if t.rampup_batch_size else [t.global_batch_size]
    except BatchScheduleError:
        sizes = [t.global_batch_size]  # validate_rampup reports the ramp itself
    kind = cfg.parallel.pipeline_schedule
    kind = kind if kind in ZERO_BUBBLE else None
    for size in sizes:
        if size % micro_dp != 0:
            continue  # reported by the divisibility checks
        try:
            schedule_for(pp, vpp, size // micro_dp, kind)
        except ScheduleError:
            what = "ramp-up global batch size" if size != t.global_batch_size else "--global-batch-size"
            name = kind or "interleaved"
            if kind is None:
                rule, fix = f"microbatches divisible by {_PP} {pp}", f"that are multiples of {pp * micro_dp}"
            else:
                need = 2 * pp if kind == "dualpipev" else pp
                rule, fix = f"at least {need} microbatches", f"of at least {need * micro_dp}"
            return [
                f"the {name} schedule needs {rule}: {what} {size} / "
                f"(--micro-batch-size {t.micro_batch_size} x DP {dp}) = {size // micro_dp} microbatches; "
                f"use global batch sizes {fix}"
            ]
    return []
