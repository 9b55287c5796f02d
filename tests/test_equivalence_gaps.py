"""Layout combinations no other file covers, each against the one single-process run (fp32, FP32_RTOL).

One flag set for every case, so the harness computes the reference once: micro batch 1 and
global batch 8 (4 microbatches per rank at DP=2: gradient accumulation), evaluation after
iterations 2 and 4 (2 validation batches each). Every case checks lm loss, grad norm and the
validation loss against one process.
- DP=2 with gradient accumulation, DDP and the distributed optimizer; evaluation under DP=2.
- ZeRO-3 with TP=2, with PP=2, and with full and selective recompute.
- CP=2 with the distributed optimizer, alone (DP=1) and with DP=2.
"""

import pytest
from harness import BASE_FLAGS, assert_close, assert_equivalent, reference, with_flag

# 4 iterations (not 5) keep the file's eight multi-rank runs within the CI budget.
FLAGS = with_flag(
    with_flag(with_flag(BASE_FLAGS, "--micro-batch-size", "1"), "--global-batch-size", "8"), "--train-iters", "4"
) + [
    "--eval-interval",
    "2",
    "--eval-iters",
    "2",
]
DIST = ["--use-distributed-optimizer"]
ZERO3 = DIST + ["--zero-stage", "3"]

CASES = {
    "dp2_accumulate": (2, []),
    "dp2_accumulate_distopt": (2, DIST),
    "zero3_tp2_dp2": (4, ZERO3 + ["--tensor-model-parallel-size", "2"]),
    "zero3_pp2_dp2": (4, ZERO3 + ["--pipeline-model-parallel-size", "2"]),
    "zero3_dp2_full_recompute": (
        2,
        ZERO3 + ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    ),
    "zero3_dp2_selective_recompute": (2, ZERO3 + ["--recompute-granularity", "selective"]),
    "cp2_distopt": (2, DIST + ["--context-parallel-size", "2"]),
    "cp2_dp2_distopt": (4, DIST + ["--context-parallel-size", "2"]),
}


def _valid_losses(records: list[dict]) -> list[float]:
    return [r["valid_loss"] for r in records if "valid_loss" in r]


@pytest.mark.parametrize("case", list(CASES))
def test_equals_one_process(tmp_path, case):
    nproc, extra = CASES[case]
    run = assert_equivalent(FLAGS, nproc, tmp_path, extra)
    expected = _valid_losses(reference(FLAGS, tmp_path / "ref").records)
    assert len(expected) >= 2, "the reference evaluated fewer than twice"
    # Validation is a forward-only mean over the same tokens: the same float-reorder bound as the training loss.
    assert_close(_valid_losses(run.records), expected, what="validation loss")
