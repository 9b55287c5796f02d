"""Pipeline parallelism: schedules as data, their simulator, and the layer split over stages.

* ``schedules``: per-rank action lists (forward-only, GPipe, 1F1B, interleaved 1F1B), the
  loop and v stage placements, and ``schedule_for``, which the trainer's executor calls;
* ``zero_bubble``: ZB-H1, ZB-V and DualPipeV, whose W actions run deferred weight gradients;
* ``simulator``: runs the lists with costs and cross-rank dependencies (makespan, bubble,
  activations in flight, deadlock report);
* ``stages``: which global layers each (pipeline rank, model chunk) holds, ``validate_pipeline``;
* ``cli``: ``tricorn schedule``.

Nothing in these modules touches torch.distributed; the executor that runs the lists with
``batch_isend_irecv`` lives next to them.
"""

from tricorn.parallel.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    LOOP,
    RECV_BACKWARD,
    RECV_FORWARD,
    SCHEDULES,
    SEND_BACKWARD,
    SEND_FORWARD,
    WEIGHT,
    ZERO_BUBBLE,
    Action,
    Kind,
    ScheduleError,
    V,
    check_schedule,
    counterpart,
    group_steps,
    is_first_stage,
    is_last_stage,
    next_stage,
    placement_of,
    prev_stage,
    schedule_for,
    stage_owner,
    virtual_stage,
)
from tricorn.parallel.pipeline.simulator import Costs, SimResult, simulate
from tricorn.parallel.pipeline.stages import StageLayout, StageSplitError, layout_from_config, stage_layout, validate_pipeline

__all__ = [
    "BACKWARD",
    "FORWARD",
    "LOOP",
    "RECV_BACKWARD",
    "RECV_FORWARD",
    "SCHEDULES",
    "SEND_BACKWARD",
    "SEND_FORWARD",
    "V",
    "WEIGHT",
    "ZERO_BUBBLE",
    "Action",
    "Costs",
    "Kind",
    "ScheduleError",
    "SimResult",
    "StageLayout",
    "StageSplitError",
    "check_schedule",
    "counterpart",
    "group_steps",
    "is_first_stage",
    "is_last_stage",
    "layout_from_config",
    "next_stage",
    "placement_of",
    "prev_stage",
    "schedule_for",
    "simulate",
    "stage_layout",
    "stage_owner",
    "validate_pipeline",
    "virtual_stage",
]
