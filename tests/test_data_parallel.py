"""DDP gradient buckets: bucket planning, overlap of the reduction with backward, and equivalence to one process."""

from pathlib import Path

import pytest
import torch
from distopt_common import MBS1, reference_extra
from harness import BASE_FLAGS, assert_equivalent, run_script
from torch import nn

from tricorn.config import config_from_args
from tricorn.parallel.data_parallel import dp_options, plan_param_buckets
from tricorn.validation import validate

WORKER = Path(__file__).parent / "workers" / "dist_opt.py"


def _params(*sizes: int, dtype=torch.float32) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]


def test_buckets_are_reverse_order_and_close_past_the_size():
    params = _params(10, 20, 30, 40)
    buckets = plan_param_buckets(params, bucket_size=50, alone=lambda p: False)
    assert [[p.numel() for p in b] for b in buckets] == [[40, 30], [20, 10]]


def test_one_dtype_per_bucket_and_lone_params():
    params = _params(5, 5) + _params(5, dtype=torch.bfloat16) + _params(5, 5)
    buckets = plan_param_buckets(params, bucket_size=1000, alone=lambda p: p is params[0])
    index = {id(p): i for i, p in enumerate(params)}
    assert [[index[id(p)] for p in b] for b in buckets] == [[4, 3], [2], [1], [0]]


@pytest.mark.parametrize(
    "flags, stage",
    [
        ([], 0),
        (["--use-distributed-optimizer"], 1),
        (["--zero-stage", "2"], 2),  # implies the distributed optimizer
        (["--use-distributed-optimizer", "--zero-stage", "3"], 3),
    ],
)
def test_stage_from_flags(flags, stage):
    cfg = config_from_args(["--mock-data", "--vocab-size", "64", *flags], world_size=2)
    assert dp_options(cfg).stage == stage


def test_param_gather_overlap_needs_the_distributed_optimizer():
    cfg = config_from_args(["--mock-data", "--vocab-size", "64", "--overlap-param-gather"], world_size=2)
    assert any("--overlap-param-gather needs --use-distributed-optimizer" in e for e in validate(cfg))
    cfg = config_from_args(["--mock-data", "--vocab-size", "64", "--overlap-param-gather", "--zero-stage", "2"], world_size=2)
    assert validate(cfg) == [] and dp_options(cfg).overlap_param_gather


def test_overlap_starts_reductions_during_backward():
    """Event trace per bucket: first reduction before the last gradient with --overlap-grad-reduce, after it without,
    and none during the first of two microbatches (DDP and ZeRO-1)."""
    assert run_script(WORKER, 2, ["trace"]).strip().endswith("ok")


@pytest.mark.parametrize(
    "nproc, flags, extra",
    [
        (2, BASE_FLAGS, ["--overlap-grad-reduce", "--ddp-bucket-size", "20000"]),
        (4, MBS1, []),
    ],
    ids=["dp2_overlap_buckets", "dp4"],
)
def test_ddp_equals_one_process(tmp_path, tmp_path_factory, nproc, flags, extra):
    assert_equivalent(flags, nproc, tmp_path, extra, reference_extra=reference_extra(tmp_path_factory, flags))


def test_zero2_and_zero3_peak_gradient_memory():
    """DP=4: the peak of live gradient storage during backward is at most full/DP + 2 buckets (ZeRO-2 and 3)."""
    out = run_script(WORKER, 4, ["peak"], timeout=600)
    assert out.strip().endswith("ok"), out
