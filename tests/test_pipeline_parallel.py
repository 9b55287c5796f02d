"""Pipeline parallelism in the trainer: every layout's lm loss and grad norm equal one process (fp32, rtol 1e-5).

The issue's acceptance layouts (PP=2, PP=4, PP=2 with 2 virtual stages, PP=2xTP=2, PP=2xDP=2,
PP=2xTP=2xDP=2), each with tied and untied embeddings, on the Foundation flags plus
--num-layers 4 --global-batch-size 8; plus an uneven split with GPipe on an odd pipeline, a
batch-size ramp-up under CP with evaluation, and the distributed optimizer with overlapped
reduction on interleaved chunks (combined to keep the run count down).
"""

import pytest
from harness import BASE_FLAGS, assert_close, assert_equivalent, reference, run_layout, with_flag

FLAGS = with_flag(BASE_FLAGS, "--global-batch-size", "8") + ["--num-layers", "4"]
UNTIED = ["--untie-embeddings-and-output-weights"]
PP2, TP2 = ["--pipeline-model-parallel-size", "2"], ["--tensor-model-parallel-size", "2"]

# name: (ranks, extra flags). TP=2 runs once with sequence parallelism (the stage boundary
# tensor is then sequence-sharded) and once without, in the 8-rank layout.
LAYOUTS = {
    "pp2": (2, PP2),
    "pp4": (4, ["--pipeline-model-parallel-size", "4"]),
    "pp2_vpp2": (2, PP2 + ["--num-virtual-stages-per-pipeline-rank", "2"]),
    "pp2_tp2_sp": (4, PP2 + TP2 + ["--sequence-parallel"]),
    "pp2_dp2": (4, PP2),
    "pp2_tp2_dp2": (8, PP2 + TP2),
}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_single_process(name, tied, tmp_path):
    nproc, extra = LAYOUTS[name]
    flags = FLAGS if tied else FLAGS + UNTIED
    assert_equivalent(flags, nproc, tmp_path, extra)


def test_uneven_split_gpipe_on_three_stages(tmp_path):
    # 4 layers on 3 stages: 2 on the first, 1 on each of the others; all forwards, then all backwards.
    extra = ["--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "2", "--pipeline-schedule", "gpipe"]
    assert_equivalent(FLAGS, 3, tmp_path, extra)


def test_rampup_with_context_parallel_and_evaluation_matches_single_process(tmp_path):
    # Batch 4, 4, 6, 6, 8: 2, 2, 3, 3, 4 microbatches per iteration through 1F1B, each split over CP=2;
    # validation (forward-only schedule) after iterations 2 and 4.
    flags = FLAGS + ["--rampup-batch-size", "4", "2", "16", "--eval-interval", "2", "--eval-iters", "1"]
    run = assert_equivalent(flags, 4, tmp_path, PP2 + ["--context-parallel-size", "2"])
    assert [r["batch_size"] for r in run.records if "batch_size" in r] == [4, 4, 6, 6, 8]
    valid = [r["valid_loss"] for r in run.records if "valid_loss" in r]
    assert_close(valid, [r["valid_loss"] for r in reference(flags, tmp_path / "ref").records if "valid_loss" in r])
    assert len(valid) == 2


def test_distributed_optimizer_with_overlap_on_interleaved_chunks(tmp_path):
    # Per-chunk DDP buckets: each chunk's reduction starts on that chunk's last backward (is_last, chunk=c).
    extra = PP2 + ["--num-virtual-stages-per-pipeline-rank", "2", "--use-distributed-optimizer", "--overlap-grad-reduce"]
    assert_equivalent(FLAGS, 4, tmp_path, extra)


def test_interleaving_refuses_a_ramp_with_odd_microbatch_counts(tmp_path):
    flags = FLAGS + PP2 + ["--num-virtual-stages-per-pipeline-rank", "2", "--rampup-batch-size", "4", "2", "16"]
    run = run_layout(flags, 2, tmp_path, check=False)
    assert run.returncode == 2 and not run.records
    assert "ramp-up global batch size 6" in run.stderr and "3 microbatches" in run.stderr
