"""Zero-bubble schedules in the trainer: each layout's lm loss and grad norm equal one process (fp32, rtol 1e-5).

Few combined launches (the suite's time budget) rather than the full cross product; which launch
covers which claim of the issue:

- zbv at PP2 with TP2 + sequence parallelism and full recompute (the V's local edge, deferred dW
  of column/row linears under SP, W's inside recomputed backwards), saving at iteration 3; then
  a resume from that checkpoint that must repeat iterations 4-5 bit for bit;
- dualpipev at PP2 x DP2 with --use-distributed-optimizer and --overlap-grad-reduce (the bucket
  reduction starts only at each chunk's last W), micro batch 1 (4 microbatches = 2 x pp), and MoE
  experts over EP2 (the linears, the norms and the routed experts' loop of GEMMs defer their weight
  gradients to the W: the experts' W computes from the rows the all_to_all delivered, with no message), saving at
  iteration 3 and resuming bit for bit;
- zb-h1 at PP4 with tied embeddings (m = p: every rank defers a different number of W's; the embedding
  gradient crosses from the last stage to the first), saving at iteration 3 and resuming bit for bit.

zb-h1 (PP2 and PP4, where every rank defers a different number of W's), dualpipev at PP4,
zbv/dualpipev at PP2 and the bitwise equality of one iteration's gradients with 1F1B (zb-h1: the same stages and,
for every parameter, the same microbatch order) run on real chunks in tests/workers/pp_executor.py
(test_pipeline_executor.py), compared with one process in float64.
"""

from __future__ import annotations

from harness import BASE_FLAGS, assert_equivalent, run_layout, with_flag

FLAGS = with_flag(BASE_FLAGS, "--global-batch-size", "8") + ["--num-layers", "4"]
UNTIED = FLAGS + ["--untie-embeddings-and-output-weights"]
PP2 = ["--pipeline-model-parallel-size", "2"]
MOE = ["--num-experts", "2", "--disable-bias-linear"]


def _losses(run) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in run.records if "loss" in r}


def _equivalent_and_resumes_bitwise(flags: list[str], nproc: int, tmp_path, extra: list[str]) -> None:
    """flags + extra equal one process; saved at iteration 3 and resumed, iterations 4-5 repeat bit for bit."""
    extra = extra + ["--save", str(tmp_path / "ckpt"), "--save-interval", "3"]
    run = assert_equivalent(flags, nproc, tmp_path, extra)
    resumed = run_layout(flags + extra + ["--load", str(tmp_path / "ckpt"), "--ckpt-step", "3"], nproc, tmp_path / "resumed")
    want, got = _losses(run), _losses(resumed)
    assert sorted(got) == [4, 5], got
    for it in (4, 5):
        assert got[it] == want[it], f"iteration {it}: resumed {got[it]!r} vs uninterrupted {want[it]!r}"  # same ops, same order


def test_zbv_tp2_sp_full_recompute_equals_one_process_and_resumes_bitwise(tmp_path):
    extra = PP2 + ["--pipeline-schedule", "zbv", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    extra += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    _equivalent_and_resumes_bitwise(UNTIED, 4, tmp_path, extra)


def test_zb_h1_pp4_tied_equals_one_process_and_resumes_bitwise(tmp_path):
    # 4 microbatches on 4 stages (m = p, the least ZB-H1 takes): rank r defers its first r W's into the tail; the
    # tied embedding's gradient meets across the first and last stage after the last W.
    _equivalent_and_resumes_bitwise(FLAGS, 4, tmp_path, ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "zb-h1"])


def test_dualpipev_dp2_distributed_optimizer_overlapped_reduce_and_experts_equal_one_process_and_resume(tmp_path):
    extra = PP2 + ["--pipeline-schedule", "dualpipev", "--use-distributed-optimizer", "--overlap-grad-reduce"]
    extra += ["--expert-model-parallel-size", "2", "--micro-batch-size", "1"]
    _equivalent_and_resumes_bitwise(UNTIED + MOE, 4, tmp_path, extra)
