"""Checks around `tricorn plan`'s answer: why nothing fits, the real build of the chosen layout, published runs.

- ``explain_impossible`` / ``min_gpus``: when no layout fits, the leanest one's memory beside the device's and
  the smallest power-of-two GPU count that would fit (the memory-lean search of planner.lean_fit);
- ``compare_with_published``: the planner's choice against a published Megatron-LM layout
  (tests/test_plan_calibration.py, bench/plan_calibration.py).

No collectives, no device work. (`tricorn plan --verify`, the real build on fake tensors, is tricorn/plan_cli.py's.)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from tricorn.config import ModelConfig
from tricorn.planning import calibration
from tricorn.planning.hardware import GiB
from tricorn.planning.memory import bytes_per_param, total_params
from tricorn.planning.planner import PlanResult, evaluate, layout_text, lean_fit, plan
from tricorn.planning.step_time import Cluster


def explain_impossible(
    model: ModelConfig, name: str, cluster: Cluster, global_batch: int, result: PlanResult, precision: str
) -> str:
    """One paragraph: why no layout fits (divisibility, or memory: the leanest layout's need), and what would."""
    head = f"{name} does not fit on {cluster.gpus} x {cluster.gpu.name}"
    if result.considered == 0:
        return (
            f"{head}: no layout divides evenly - the global batch {global_batch} must be divisible by the data-parallel size "
            f"and the micro batch, and --gpus {cluster.gpus} by TP x PP x CP; try a global batch that is a multiple of "
            f"{cluster.gpus} or a GPU count that is a power of two"
        )
    lay, mem = result.leanest  # type: ignore[misc]
    p_b, g_b, m_b, o_b = bytes_per_param(precision)
    n = total_params(model)
    state_gib = n * (p_b + g_b + m_b + o_b) / GiB
    need = min_gpus(model, cluster, global_batch, precision, features=result.features_searched)
    more = f"it needs at least {need} GPUs of this type (--gpus {need})" if need else "no GPU count up to 65536 fits it"
    return (
        f"{head}: the leanest layout ({layout_text(lay)}) needs {mem / GiB:.1f} GiB per GPU and "
        f"{cluster.usable_bytes / GiB:.1f} GiB are usable ({cluster.gpu.memory_gb:.1f} GiB less the "
        f"{cluster.memory_margin:.0%} margin); its model state alone is {state_gib:.0f} GiB "
        f"({n / 1e9:.1f} B parameters x {p_b + g_b + m_b + o_b} bytes) before sharding; {more}"
    )


def min_gpus(
    model: ModelConfig, cluster: Cluster, global_batch: int, precision: str, limit: int = 65536, features: bool = True
) -> Optional[int]:
    """The smallest power-of-two GPU count up to `limit` on which some memory-lean layout fits (``features``: with
    its leanest memory features, as `tricorn plan` tries them)."""
    n = 1
    while n <= limit:
        if lean_fit(model, dataclasses.replace(cluster, gpus=n), global_batch, precision, features):
            return n
        n *= 2
    return None


def compare_with_published(run: calibration.Run) -> str:
    """'ok' when the planner's choice for ``run``'s model, cluster and batch predicts at least the published
    layout's throughput, 'tie' when it is within the interval of it, 'worse' otherwise (both predicted with
    tricorn's features); 'n/a' when nothing fits tricorn's memory estimate."""
    cluster = run.cluster(calibration.efficiency_for(run.gpu))
    result = plan(run.model, cluster, run.global_batch, run.layout.precision, top_k=1)
    if not result.plans:
        return "n/a"
    published = evaluate(run.model, run.layout, cluster, run.global_batch, 0.0)
    choice = result.plans[0]
    if choice.step_time_s <= published.step_time_s:
        return "ok"
    return "tie" if choice.bounds("step_time_s")[0] <= published.bounds("step_time_s")[1] else "worse"
