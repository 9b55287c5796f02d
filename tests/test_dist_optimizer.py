"""Distributed optimizer, ZeRO-2/3, overlap, offload and mixed precision against the single-process fp32 run.

bf16/fp16 tolerance (documented in the README): over 20 iterations each iteration's
`lm loss` of a half-precision run (fp32 main grads and master weights) stays within
relative 2e-3 of the fp32 single-process run; measured: bf16 2.0e-4, fp16 2.3e-5.
"""

import json

import pytest
from distopt_common import DIST, reference_extra
from harness import BASE_FLAGS, assert_close, assert_equivalent, reference, run_layout, with_flag

# Half precision is a different computation, not a reorder: bf16 rounds every weight to 2^-8 relative (3.9e-3); 2e-3 on the loss is the README's documented figure, 10x the measured bf16 gap.
HALF_PRECISION_RTOL = 2e-3

# DP=4 and ZeRO-3 at DP=2 are checked in test_memory_report.py, whose runs also measure memory.
CASES = {
    "dp2": (2, BASE_FLAGS, DIST),
    "zero2_dp2": (2, BASE_FLAGS, DIST + ["--zero-stage", "2"]),
    "overlap_dp2": (2, BASE_FLAGS, DIST + ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "20000"]),
    "tp2_sp_dp2": (4, BASE_FLAGS, DIST + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2_dp2_tied": (4, BASE_FLAGS, DIST + ["--pipeline-model-parallel-size", "2", "--overlap-grad-reduce"]),
    "cpu_offload_dp2": (2, BASE_FLAGS, DIST + ["--optimizer-cpu-offload"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_equals_one_process(tmp_path, tmp_path_factory, case):
    """lm loss and grad norm of iterations 1-5 within relative 1e-5 of one process (fp32)."""
    nproc, flags, extra = CASES[case]
    assert_equivalent(flags, nproc, tmp_path, extra, reference_extra=reference_extra(tmp_path_factory, flags))


@pytest.mark.parametrize("precision, nproc", [("--bf16", 2), ("--fp16", 1)])
def test_half_precision_tracks_fp32(tmp_path, precision, nproc):
    """Distributed optimizer (bf16 at DP=2, fp16 with dynamic loss scaling in one process) over 20 iterations."""
    flags = with_flag(BASE_FLAGS, "--train-iters", "20")
    ref = reference(flags, tmp_path / "ref")
    run = run_layout(flags + DIST + [precision, "--tensorboard-dir", str(tmp_path / "tb")], nproc, tmp_path / "run")
    assert_close(run.losses, ref.losses, HALF_PRECISION_RTOL, f"{precision} lm loss")
    assert not any(r["skipped"] for r in run.records)
    # Half-precision parameters, fp32 gradients and an fp32 master copy of the owned 1/DP: exact ratios.
    for entry in json.loads((tmp_path / "tb" / "memory_report.json").read_text()):
        assert entry["params_dtype"] == precision.lstrip("-")
        assert entry["grads_bytes"] == 2 * entry["params_bytes"]
        assert entry["master_params_bytes"] * nproc == 2 * entry["params_bytes"]
