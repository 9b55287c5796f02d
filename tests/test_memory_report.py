"""memory_report.json: storage accounting, where it is written, and how model state scales with DP and ZeRO."""

import json
from pathlib import Path

import pytest
import torch
from distopt_common import DIST, MBS1, reference_extra, reference_tb
from harness import BASE_FLAGS, assert_equivalent, run_layout, with_flag

from tricorn.config_args import config_from_args
from tricorn.training.memory_report import KEYS, measure, report_path


def test_each_storage_counts_once_in_the_first_category():
    flat = torch.zeros(100)
    views = [flat[:50], flat[50:]]
    other = torch.zeros(10, dtype=torch.float64)
    out = measure({"params": views, "grads": [flat, other], "optimizer_state": [other]}, torch.device("cpu"))
    assert out["params_bytes"] == 400 and out["grads_bytes"] == 80 and out["optimizer_state_bytes"] == 0


def test_freed_storage_counts_nothing_and_host_tensors_are_separate():
    freed = torch.zeros(100)
    freed.untyped_storage().resize_(0)
    host = torch.zeros(8)
    out = measure({"params": [freed], "master_params": [host]}, torch.device("cuda"))
    assert out["params_bytes"] == 0 and out["master_params_bytes"] == 0 and out["host_bytes"] == 32


@pytest.mark.parametrize(
    "flags, where",
    [(["--tensorboard-dir", "tb", "--save", "ck"], "tb"), (["--save", "ck"], "ck"), ([], None)],
)
def test_report_goes_to_tensorboard_dir_else_save_dir(flags, where):
    cfg = config_from_args(["--mock-data", "--vocab-size", "64", *flags], world_size=1)
    path = report_path(cfg)
    assert (path is None) if where is None else path == Path(where) / "memory_report.json"


def _report(tb: Path, nproc: int) -> list[dict]:
    entries = json.loads((tb / "memory_report.json").read_text())
    assert sorted(e["rank"] for e in entries) == list(range(nproc)) and all(set(KEYS) <= set(e) for e in entries)
    return entries


def _equivalent_with_report(flags, nproc, tmp_path, tmp_path_factory, extra) -> tuple[dict, list[dict]]:
    """The run equals one process (loss, grad norm) and both wrote memory_report.json; returns (reference, run) entries."""
    tb = tmp_path / "tb"
    run = assert_equivalent(
        flags, nproc, tmp_path, extra + ["--tensorboard-dir", str(tb)], reference_extra=reference_extra(tmp_path_factory, flags)
    )
    assert "memory report" in run.stdout
    (one,) = _report(reference_tb(tmp_path_factory, flags), 1)
    return one, _report(tb, nproc)


def test_dp4_distributed_optimizer_shards_optimizer_state(tmp_path, tmp_path_factory):
    one, entries = _equivalent_with_report(MBS1, 4, tmp_path, tmp_path_factory, DIST)
    sharded = one["optimizer_state_bytes"] + one["master_params_bytes"]
    for e in entries:
        # Optimizer state and master weights: 1/4 per rank, up to padding (< 1%); full params and grads (ZeRO-1).
        # Byte counts: each DP shard is padded to equal size, under 1% here.
        assert e["optimizer_state_bytes"] + e["master_params_bytes"] == pytest.approx(sharded / 4, rel=0.01)
        assert e["params_bytes"] == pytest.approx(one["params_bytes"], rel=0.01)
        assert e["grads_bytes"] == pytest.approx(one["grads_bytes"], rel=0.01)


def test_zero3_shards_parameters_too(tmp_path, tmp_path_factory):
    one, entries = _equivalent_with_report(BASE_FLAGS, 2, tmp_path, tmp_path_factory, DIST + ["--zero-stage", "3"])
    for e in entries:
        for key in ("params_bytes", "grads_bytes", "optimizer_state_bytes"):
            # Byte counts: each DP shard is padded to equal size, under 1% here.
            assert e[key] == pytest.approx(one[key] / 2, rel=0.01), key


def test_iteration_one_peak_by_kind(tmp_path):
    """The peak of iteration 1 sits beside the steady state: at least the model state, split into the same kinds."""
    run = run_layout(with_flag(MBS1, "--train-iters", "2") + ["--tensorboard-dir", str(tmp_path / "tb")], 1, tmp_path)
    assert "iteration-1 peak" in run.stdout
    (one,) = _report(tmp_path / "tb", 1)
    kinds = ("params", "grads", "master_params", "optimizer_state")
    assert one["peak_bytes"] == sum(one[f"peak_{k}_bytes"] for k in (*kinds, "activations"))
    for k in kinds:  # no ZeRO here: the model state is alive throughout, as after the iteration
        assert one[f"peak_{k}_bytes"] == one[f"{k}_bytes"]
    assert one["peak_activations_bytes"] > one["activation_bytes_per_layer"] > 0
