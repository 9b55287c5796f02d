"""fp16 loss scaling: the dynamic scaler's rules, and an overflow on one rank skipping the step on every rank.

Scales are powers of two, only ever halved or doubled: exact in binary floating point, so they are compared
with ==; the multi-rank skip is checked bit for bit (a skipped step changes nothing at all).
"""

from pathlib import Path

import pytest
from harness import run_script

from tricorn.config_args import config_from_args
from tricorn.parallel.loss_scaler import ConstantLossScaler, DynamicLossScaler, build_loss_scaler

WORKER = Path(__file__).parent / "workers" / "dist_opt.py"


def test_grows_after_window_without_overflow():
    s = DynamicLossScaler(1024.0, growth_interval=3, hysteresis=2)
    for _ in range(2):
        s.update(found_inf=False)
    assert s.scale == 1024.0
    s.update(found_inf=False)
    assert s.scale == 2048.0
    for _ in range(3):
        s.update(found_inf=False)
    assert s.scale == 4096.0


def test_overflow_resets_growth_window():
    s = DynamicLossScaler(1024.0, growth_interval=3, hysteresis=5)
    s.update(False)
    s.update(False)
    s.update(True)  # tolerated by hysteresis, but the window starts over
    s.update(False)
    s.update(False)
    assert s.scale == 1024.0
    s.update(False)
    assert s.scale == 2048.0


def test_backs_off_only_after_hysteresis_overflows():
    s = DynamicLossScaler(1024.0, growth_interval=1000, hysteresis=2)
    s.update(found_inf=True)
    assert s.scale == 1024.0
    s.update(found_inf=True)
    assert s.scale == 512.0
    s.update(found_inf=True)  # Megatron: hysteresis re-arms only on growth, so every further overflow halves
    assert s.scale == 256.0


def test_growth_rearms_hysteresis():
    s = DynamicLossScaler(1024.0, growth_interval=1, hysteresis=2)
    s.update(True)  # hysteresis 2 -> 1
    s.update(False)  # growth: scale 2048, hysteresis back to 2
    assert s.scale == 2048.0
    s.update(True)
    assert s.scale == 2048.0
    s.update(True)
    assert s.scale == 1024.0


def test_never_below_min_scale():
    s = DynamicLossScaler(4.0, min_scale=1.0, growth_interval=1000, hysteresis=1)
    for _ in range(5):
        s.update(found_inf=True)
    assert s.scale == 1.0


def test_state_round_trip():
    s = DynamicLossScaler(1024.0, growth_interval=4, hysteresis=3)
    s.update(True)
    s.update(False)
    t = DynamicLossScaler(1.0)
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.growth_tracker, t.hysteresis_tracker) == (1024.0, 1, 2)


def test_constant_scaler_never_changes():
    s = ConstantLossScaler(128.0)
    s.update(True)
    s.update(False)
    assert s.scale == 128.0


@pytest.mark.parametrize(
    "flags, expected",
    [
        ([], None),
        (["--bf16"], None),
        (["--fp16"], DynamicLossScaler),
        (["--fp16", "--loss-scale", "64"], ConstantLossScaler),
        (["--bf16", "--loss-scale", "64"], ConstantLossScaler),
    ],
)
def test_which_scaler(flags, expected):
    cfg = config_from_args(["--mock-data", "--vocab-size", "64", *flags], world_size=1)
    scaler = build_loss_scaler(cfg)
    assert (scaler is None) if expected is None else isinstance(scaler, expected)


def test_flags_reach_the_dynamic_scaler():
    argv = ["--mock-data", "--vocab-size", "64", "--fp16", "--initial-loss-scale", "256", "--min-loss-scale", "2"]
    cfg = config_from_args(argv + ["--loss-scale-window", "7", "--hysteresis", "3"], world_size=1)
    s = build_loss_scaler(cfg)
    assert (s.scale, s.min_scale, s.growth_interval, s.hysteresis) == (256.0, 2.0, 7, 3)


def test_inf_on_one_rank_skips_the_step_everywhere():
    """DDP, distributed optimizer and ZeRO-3 at DP=2: parameters and optimizer state bit-identical after the skip."""
    assert run_script(WORKER, 2, ["skip"]).strip().endswith("ok")
