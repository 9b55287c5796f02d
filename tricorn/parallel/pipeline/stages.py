"""Which global transformer layers each (pipeline rank, model chunk) holds, and pipeline config checks.

Layers are contiguous per virtual stage, and virtual stages are numbered as in Megatron:
model chunk ``c`` on pipeline rank ``r`` is virtual stage ``c * pp + r``. So with 8 layers,
pp=2 and 2 chunks per rank, rank 0 holds layers 0-1 (chunk 0) and 4-5 (chunk 1), rank 1
holds 2-3 and 6-7. The embedding lives on virtual stage 0 and the final norm, head and loss
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

from dataclasses import dataclass
from typing import Any, Optional

from tricorn.parallel.pipeline.schedules import ScheduleError, check_interleaving, virtual_stage


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

    def layers(self, pp_rank: int, chunk: int = 0) -> range:
        """Global layer ids of model chunk ``chunk`` on pipeline rank ``pp_rank``."""
        vs = virtual_stage(pp_rank, chunk, self.pp)
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
                return vs % self.pp, vs // self.pp
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
        return 1, []
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
    return stage_layout(
        cfg.model.num_layers,
        p.pipeline_model_parallel_size,
        vpp,
        p.decoder_first_pipeline_num_layers,
        p.decoder_last_pipeline_num_layers,
    )


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
    if vpp > 1 and p.pipeline_schedule == "gpipe":
        errs.append(f"--pipeline-schedule gpipe has no interleaved form; drop it or the virtual stages ({vpp} chunks per rank)")
    if vpp > 1 and pp > 1:
        errs += _interleaving_batch_errors(cfg, pp, vpp)
    return errs


def _interleaving_batch_errors(cfg: Any, pp: int, vpp: int) -> list[str]:
    """Every global batch size the run uses (ramp-up included) must give a microbatch count divisible by pp."""
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
    for size in sizes:
        if size % micro_dp != 0:
            continue  # reported by the divisibility checks
        try:
            check_interleaving(pp, vpp, size // micro_dp)
        except ScheduleError:
            what = "ramp-up global batch size" if size != t.global_batch_size else "--global-batch-size"
            return [
                f"the interleaved schedule needs microbatches divisible by {_PP} {pp}: {what} {size} / "
                f"(--micro-batch-size {t.micro_batch_size} x DP {dp}) = {size // micro_dp} microbatches; "
                f"use global batch sizes that are multiples of {pp * micro_dp}"
            ]
    return []
