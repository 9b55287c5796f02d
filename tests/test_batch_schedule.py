"""Microbatch calculator: microbatches per iteration and Megatron's batch-size ramp-up."""

from __future__ import annotations

import pytest

from tricorn.config_args import config_from_args
from tricorn.parallel.batch_schedule import BatchScheduleError, MicrobatchCalculator, RampStage, validate_rampup


def _cfg(*flags: str, world_size: int = 2):
    return config_from_args([*flags, "--mock-data", "--vocab-size", "128", "--device", "cpu"], world_size=world_size)


def test_num_microbatches_is_global_over_micro_times_dp():
    calc = MicrobatchCalculator(global_batch_size=16, micro_batch_size=2, data_parallel_size=2)
    assert calc.get(0) == (16, 4) and calc.get(10**9) == (16, 4)
    cfg = _cfg("--global-batch-size", "24", "--micro-batch-size", "3", world_size=4)
    assert MicrobatchCalculator.from_config(cfg).get(0) == (24, 2) == (24, cfg.num_microbatches)
    with pytest.raises(
        BatchScheduleError, match="--global-batch-size 10 is not divisible by --micro-batch-size x DP = 2 x 2 = 4"
    ):
        MicrobatchCalculator(10, 2, 2)


def test_rampup_produces_the_documented_sequence():
    # START 4, INCREMENT 4, SAMPLES 48 towards 16: 3 increments, one every 48 / 3 = 16 samples.
    calc = MicrobatchCalculator(16, 1, 2, rampup=(4, 4, 48))
    assert calc.stages() == [
        RampStage(4, 2, 0, 16),
        RampStage(8, 4, 16, 32),
        RampStage(12, 6, 32, 48),
        RampStage(16, 8, 48, None),
    ]
    assert calc.iteration_batch_sizes(10) == [4, 4, 4, 4, 8, 8, 12, 12, 16, 16]
    assert [calc.get(c) for c in (0, 15, 16, 31, 32, 47, 48, 1000)] == [
        (4, 2), (4, 2), (8, 4), (8, 4), (12, 6), (12, 6), (16, 8), (16, 8),
    ]  # fmt: skip


def test_rampup_matches_megatron_formula_off_boundaries():
    start, increment, samples, final = 32, 32, 1000, 256
    calc = MicrobatchCalculator(final, 4, 8, rampup=(start, increment, samples))
    per_increment = samples / ((final - start) // increment)  # Megatron's float stage length
    for consumed in range(0, 1200, 7):
        expected = final if consumed > samples else start + int(consumed / per_increment) * increment
        if consumed * ((final - start) // increment) % samples:  # skip exact stage boundaries (float rounding)
            assert calc.global_batch_size_at(consumed) == expected, consumed
    ends = [s.end_sample for s in calc.stages()]
    assert ends[:-1] == [-(-k * samples // 7) for k in range(1, 8)] and ends[-1] is None


def test_rampup_from_config_and_start_equal_to_global():
    cfg = _cfg("--global-batch-size", "8", "--rampup-batch-size", "2", "2", "30")
    calc = MicrobatchCalculator.from_config(cfg)
    assert [s.global_batch_size for s in calc.stages()] == [2, 4, 6, 8]
    assert validate_rampup(cfg) == []
    assert MicrobatchCalculator(8, 1, 1, rampup=(8, 4, 100)).stages() == [RampStage(8, 8, 0, None)]


def test_non_divisible_ramp_is_refused_before_launch():
    cfg = _cfg("--global-batch-size", "32", "--micro-batch-size", "2", "--rampup-batch-size", "8", "2", "100")
    errs = validate_rampup(cfg)
    assert errs == [
        "--rampup-batch-size 8 2 100 reaches global batch size 10, 14, 18, 22, 26 and 1 more, not divisible by "
        "--micro-batch-size x DP = 2 x 2 = 4; make START, INCREMENT and --global-batch-size multiples of 4"
    ]
    with pytest.raises(BatchScheduleError, match="global batch size 10, 14"):
        MicrobatchCalculator.from_config(cfg)


@pytest.mark.parametrize(
    "rampup, message",
    [
        ((40, 8, 100), "START 40 exceeds --global-batch-size 32"),
        ((8, 5, 100), "minus START 8 = 24 is not divisible by INCREMENT 5"),
    ],
)
def test_ramp_shape_errors(rampup, message):
    errs = validate_rampup(_cfg("--global-batch-size", "32", "--rampup-batch-size", *map(str, rampup), world_size=1))
    assert len(errs) == 1 and message in errs[0]
    with pytest.raises(BatchScheduleError, match=message):
        MicrobatchCalculator(32, 1, 1, rampup=rampup)


def test_ramp_values_below_one_are_refused():
    """The flag's range check (tricorn/fields.py) refuses it before any validator; the API refuses it too."""
    from tricorn.config import ConfigError

    with pytest.raises(ConfigError, match="--rampup-batch-size must be at least 1, got 0"):
        _cfg("--global-batch-size", "32", "--rampup-batch-size", "8", "8", "0", world_size=1)
    with pytest.raises(BatchScheduleError, match="must all be at least 1"):
        MicrobatchCalculator(32, 1, 1, rampup=(8, 8, 0))
