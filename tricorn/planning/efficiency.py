"""How close real runs come to the datasheet: the Efficiency factors and the stored fit the planner reads.

A leaf of planning/: step_time.py prices a step with these factors, calibration.py fits them to published runs
(bench/plan_calibration.py writes the fit to data/step_time_calibration.json), the planner reads the fit and its
out-of-sample interval here. Pure arithmetic and one JSON file; no collectives, no trainer.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

from tricorn.planning.hardware import BUS_EFFICIENCY

FIT_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "step_time_calibration.json")
FIT_GPU = {"h200-141gb": "h100-80gb"}  # same chip as the H100, more HBM: the H100's factors apply


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the datasheet figure the work reaches: GEMMs, attention core, NVLink and network collectives.

    The defaults (typical figures, nccl-tests' busbw for the links) are the fit's starting point and prior."""

    gemm: float = 0.75
    attention: float = 0.50
    nvlink: float = BUS_EFFICIENCY["nvlink"]
    network: float = BUS_EFFICIENCY["network"]

    def as_dict(self) -> dict:
        return dict(gemm=self.gemm, attention=self.attention, nvlink=self.nvlink, network=self.network)


@functools.lru_cache(maxsize=1)
def stored() -> dict:
    with open(FIT_FILE) as fh:
        return json.load(fh)


def efficiency_for(gpu_name: str) -> Efficiency:
    """The calibrated factors of a GPU type (the defaults for a type no published run covers)."""
    factors = stored()["factors"].get(FIT_GPU.get(gpu_name, gpu_name))
    return Efficiency(**factors) if factors else Efficiency()


def interval() -> tuple[float, float]:
    """(p10, p90) of measured / predicted seconds out of sample: a predicted time T lies in [T x p10, T x p90]."""
    p10, _, p90 = stored()["leave_one_out_p10_p50_p90"]
    return p10, p90


def with_interval(seconds: float) -> tuple[float, float]:
    """(p10, p90) seconds of a predicted time."""
    lo, hi = interval()
    return seconds * lo, seconds * hi
