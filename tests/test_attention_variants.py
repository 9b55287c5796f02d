"""--qk-layernorm, --add-qkv-bias and --kv-channels (issue 40): one model that turns all three on, through the layouts.

The model: the harness's shapes with SwiGLU, GQA (2 groups), biases on Q, K and V only (Qwen2) and per-head RMSNorm
of queries and keys (Qwen3), at head dim 24 (hidden 64 / 4 heads would be 16: the attention width is 96, not
the hidden size). Every layout equals the single-process run (harness.FP32_RTOL, its argument unchanged: the
layouts only reorder fp32 sums). What a layout can get wrong here: the per-head norms are replicated over TP but
each TP rank normalises only its own heads, so their gradients must be summed over TP with or without SP (the
sharp check is tests/workers/tp_layers.py in float64; here, without the sum, tp2-sp's grad norm misses the bound
at iteration 2); the QKV bias is split with QKV's rows per query group; a2a CP moves heads between ranks after
the norms; zero-bubble W defers the norms' weight gradients; ZeRO-3 and the distributed optimizer shard the new
parameters. torch.compile is checked in float64 at layer level (tests/test_compile.py, whose model has the three
features), FP8 here against FP8's own single-process run, and the TE spec in tests/test_te_backend.py.
"""

from __future__ import annotations

import pytest
from harness import BASE_FLAGS, assert_close, assert_equivalent, reference, run_layout, with_flag
from test_fp8 import GRAD_NORM_RTOL, LOSS_RTOL

FEATURES = "--disable-bias-linear --add-qkv-bias --qk-layernorm --kv-channels 24".split()
FLAGS = with_flag(BASE_FLAGS, "--train-iters", "3") + "--swiglu --group-query-attention --num-query-groups 2".split() + FEATURES
TP2 = ["--tensor-model-parallel-size", "2"]
CP2 = ["--context-parallel-size", "2"]
FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()

LAYOUTS = {  # name: (ranks, flags added to FLAGS)
    "tp2-sp": (2, TP2 + ["--sequence-parallel"]),
    "tp2-full-recompute": (2, TP2 + FULL),  # TP without SP: the per-head norms' gradients are still partial
    "pp2-zb-h1": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"]),
    "cp2-p2p": (2, CP2 + ["--cp-comm-type", "p2p"]),
    "cp2-a2a": (2, CP2 + ["--cp-comm-type", "a2a"]),
    "cp2-allgather": (2, CP2 + ["--cp-comm-type", "allgather"]),
    "dp2-distopt-selective-recompute": (
        2,
        "--use-distributed-optimizer --overlap-grad-reduce --recompute-granularity selective --recompute-modules core_attn mlp".split(),
    ),
    "dp2-zero3": (2, ["--use-distributed-optimizer", "--zero-stage", "3"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_single_process(tmp_path, layout):
    nproc, extra = LAYOUTS[layout]
    assert_equivalent(FLAGS, nproc, tmp_path, extra)


def test_fp8_tp2_sp_equals_fp8_single_process(tmp_path):
    """Native FP8 runs the biased QKV GEMM; the norms stay bf16 (tests/test_fp8.py's bounds and their argument)."""
    flags = FLAGS + ["--bf16", "--fp8-format", "e4m3"]
    ref = reference(flags, tmp_path / "ref")
    run = run_layout(flags + TP2 + ["--sequence-parallel"], 2, tmp_path / "run")
    assert_close(run.losses, ref.losses, LOSS_RTOL, "lm loss")
    assert_close(run.grad_norms, ref.grad_norms, GRAD_NORM_RTOL, "grad norm")
