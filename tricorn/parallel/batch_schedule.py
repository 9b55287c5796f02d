"""Global batch size and number of microbatches per iteration, with Megatron's batch-size ramp-up.

``num_microbatches = global_batch_size / (micro_batch_size x DP)``: each DP rank runs that
many microbatches (gradient accumulation, or the pipeline's microbatches) per iteration.

``--rampup-batch-size START INCREMENT SAMPLES`` (Megatron's classic semantics): the global
batch starts at START and grows by INCREMENT in ``n = (GLOBAL - START) / INCREMENT`` equal
steps spread over the first SAMPLES consumed samples. With ``consumed`` samples so far, the
batch is ``START + floor(consumed * n / SAMPLES) * INCREMENT``, capped at GLOBAL; each
stage lasts ``SAMPLES / n`` samples. Megatron computes the same floor in floating point;
we use exact integers, which can only differ exactly on a stage boundary.

Every batch size of the ramp must divide by micro x DP; ``validate_rampup`` refuses the run
up front, naming the offending size. No collectives, no device work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

_RAMP = "--rampup-batch-size"


class BatchScheduleError(ValueError):
    """A batch configuration that cannot run; the message is one line for the user."""


@dataclass(frozen=True)
class RampStage:
    """One constant-batch stretch of training: consumed samples in [first_sample, end_sample)."""

    global_batch_size: int
    num_microbatches: int
    first_sample: int
    end_sample: Optional[int]  # None: until the end of training


def _ramp_errors(rampup: Sequence[int], global_batch_size: int) -> list[str]:
    if len(rampup) != 3:
        return [f"{_RAMP} takes three numbers START INCREMENT SAMPLES, got {len(rampup)}"]
    start, increment, samples = rampup
    if start < 1 or increment < 1 or samples < 1:
        return [f"{_RAMP} START INCREMENT SAMPLES must all be at least 1, got {start} {increment} {samples}"]
    if start > global_batch_size:
        return [f"{_RAMP} START {start} exceeds --global-batch-size {global_batch_size}"]
    if (global_batch_size - start) % increment != 0:
        return [
            f"{_RAMP}: --global-batch-size {global_batch_size} minus START {start} = {global_batch_size - start} "
            f"is not divisible by INCREMENT {increment}"
        ]
    return []


def rampup_batch_sizes(rampup: Sequence[int], global_batch_size: int) -> list[int]:
    """START, START + INCREMENT, ..., GLOBAL: every global batch size the ramp uses."""
    errs = _ramp_errors(rampup, global_batch_size)
    if errs:
        raise BatchScheduleError(errs[0])
    start, increment, _ = rampup
    return list(range(start, global_batch_size + 1, increment))


def _batch_errors(
    global_batch_size: int, micro_batch_size: int, data_parallel_size: int, rampup: Optional[Sequence[int]]
) -> list[str]:
    if global_batch_size < 1 or micro_batch_size < 1 or data_parallel_size < 1:
        return [
            f"global batch, micro batch and DP sizes must be at least 1, got {global_batch_size}, {micro_batch_size}, "
            f"{data_parallel_size}"
        ]
    micro_dp = micro_batch_size * data_parallel_size
    if not rampup:
        if global_batch_size % micro_dp != 0:
            return [
                f"--global-batch-size {global_batch_size} is not divisible by --micro-batch-size x DP = "
                f"{micro_batch_size} x {data_parallel_size} = {micro_dp}"
            ]
        return []
    errs = _ramp_errors(rampup, global_batch_size)
    if errs:
        return errs
    bad = [b for b in rampup_batch_sizes(rampup, global_batch_size) if b % micro_dp != 0]
    if bad:
        shown = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        return [
            f"{_RAMP} {' '.join(map(str, rampup))} reaches global batch size {shown}, not divisible by "
            f"--micro-batch-size x DP = {micro_batch_size} x {data_parallel_size} = {micro_dp}; "
            f"make START, INCREMENT and --global-batch-size multiples of {micro_dp}"
        ]
    return []


def validate_rampup(cfg: Any) -> list[str]:
    """Batch-size problems of a Config, one line each (empty when fine); checked before launch."""
    t = cfg.training
    dp = cfg.data_parallel_size
    if t.global_batch_size is None or dp < 1 or not t.rampup_batch_size:
        return []  # config.validate covers the plain global/micro/DP divisibility
    return _batch_errors(t.global_batch_size, t.micro_batch_size, dp, t.rampup_batch_size)


@dataclass(frozen=True)
class MicrobatchCalculator:
    """(global batch size, num microbatches) as a function of samples consumed so far.

    ``MicrobatchCalculator(global_batch_size=8, micro_batch_size=1, data_parallel_size=2)`` or
    ``MicrobatchCalculator.from_config(cfg)``; raises BatchScheduleError for sizes that cannot run.
    """

    global_batch_size: int
    micro_batch_size: int
    data_parallel_size: int
    rampup: Optional[tuple[int, int, int]] = None

    def __post_init__(self) -> None:
        if self.rampup is not None:
            object.__setattr__(self, "rampup", tuple(self.rampup))
        errs = _batch_errors(self.global_batch_size, self.micro_batch_size, self.data_parallel_size, self.rampup)
        if errs:
            raise BatchScheduleError(errs[0])

    @classmethod
    def from_config(cls, cfg: Any) -> MicrobatchCalculator:
        t = cfg.training
        rampup = tuple(t.rampup_batch_size) if t.rampup_batch_size else None
        return cls(t.global_batch_size, t.micro_batch_size, cfg.data_parallel_size, rampup)

    @property
    def micro_times_dp(self) -> int:
        return self.micro_batch_size * self.data_parallel_size

    def global_batch_size_at(self, consumed_samples: int) -> int:
        if not self.rampup:
            return self.global_batch_size
        start, increment, samples = self.rampup
        if consumed_samples >= samples:
            return self.global_batch_size
        num_increments = (self.global_batch_size - start) // increment
        return start + (max(consumed_samples, 0) * num_increments // samples) * increment

    def get(self, consumed_samples: int) -> tuple[int, int]:
        """(global batch size, microbatches per DP rank) for the iteration after ``consumed_samples``."""
        size = self.global_batch_size_at(consumed_samples)
        return size, size // self.micro_times_dp

    def stages(self) -> list[RampStage]:
        """The documented ramp: each batch size with the consumed-sample range it applies to."""
        if not self.rampup:
            return [RampStage(self.global_batch_size, self.global_batch_size // self.micro_times_dp, 0, None)]
        start, increment, samples = self.rampup
        num_increments = (self.global_batch_size - start) // increment
        out = []
        for k in range(num_increments + 1):
            size = start + k * increment
            # Smallest consumed count c with floor(c * n / samples) >= k.
            first = -(-k * samples // num_increments) if num_increments else 0
            end = -(-(k + 1) * samples // num_increments) if k < num_increments else None
            out.append(RampStage(size, size // self.micro_times_dp, first, end))
        return out

    def iteration_batch_sizes(self, num_iterations: int, consumed_samples: int = 0) -> list[int]:
        """Global batch size of each of the next iterations, consuming each batch in turn."""
        sizes = []
        for _ in range(num_iterations):
            size = self.global_batch_size_at(consumed_samples)
            sizes.append(size)
            consumed_samples += size
        return sizes
