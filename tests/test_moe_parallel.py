"""MoE end to end: the same losses in every layout (DP, TP, PP, distributed optimizer), resume, TensorBoard.

The MoE layer is collective-free, so every layout replicates the experts; what these tests pin down is
that the router statistics (aux loss, capacity dropping, expert-bias update) see the same tokens in every
layout: each is computed per microbatch, and the micro batch size is the same in all runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import BASE_FLAGS, assert_close, assert_equivalent, run_layout, with_flag

# Every MoE feature at once: aux loss, dropping (capacity factor 1 drops at this size), sigmoid routing
# with the expert bias, a shared expert; --moe-layer-freq 2 makes layer 0 MoE and layer 1 dense.
MOE = (
    "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 96 --disable-bias-linear --swiglu "
    "--moe-aux-loss-coeff 0.01 --moe-expert-capacity-factor 1.0 --moe-token-drop-policy probs "
    "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 0.01 "
    "--moe-shared-expert-intermediate-size 64"
).split()
FLAGS = with_flag(BASE_FLAGS, "--num-layers", "4") + MOE + ["--moe-layer-freq", "2"]
FLAGS = with_flag(FLAGS, "--micro-batch-size", "1")
EP2 = ["--expert-model-parallel-size", "2"]


@pytest.mark.parametrize(
    "nproc,extra",
    [
        (2, []),  # DP2
        (2, ["--use-distributed-optimizer"]),
        (2, ["--tensor-model-parallel-size", "2"]),
        (2, ["--pipeline-model-parallel-size", "2"]),
        (2, EP2),
        (4, ["--expert-model-parallel-size", "4"]),
        (4, EP2 + ["--tensor-model-parallel-size", "2"]),
        (4, EP2 + ["--pipeline-model-parallel-size", "2"]),
        (4, EP2 + ["--use-distributed-optimizer"]),
        (2, EP2 + "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()),
    ],
    ids=["dp2", "distopt-dp2", "tp2", "pp2", "ep2", "ep4", "ep2-tp2", "ep2-pp2", "ep2-distopt-dp4", "ep2-full-recompute"],
)
def test_moe_layouts_equal_single_process(tmp_path, nproc, extra):
    assert_equivalent(FLAGS, nproc, tmp_path, extra)


def test_ep_with_context_parallel_dropless(tmp_path):
    # CP refuses the router statistics (aux loss, dropping, expert bias): the dropless router alone.
    flags = with_flag(BASE_FLAGS, "--micro-batch-size", "1") + "--num-experts 4 --disable-bias-linear --swiglu".split()
    assert_equivalent(flags, 4, tmp_path, ["--context-parallel-size", "2"] + EP2)


def test_moe_stats_reach_tensorboard_and_resume_is_exact(tmp_path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    flags = with_flag(FLAGS, "--train-iters", "4")
    full = run_layout(
        flags + ["--tensorboard-dir", str(tmp_path / "tb"), "--save", str(tmp_path / "ckpt"), "--save-interval", "2"],
        1,
        tmp_path / "a",
    )
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"moe/aux-loss", "moe/dropped-tokens", "moe/layer-0/tokens-expert-3", "moe/layer-2/tokens-expert-0"} <= tags
    assert "moe/layer-1/tokens-expert-0" not in tags  # layer 1 is dense
    counts = [acc.Scalars(f"moe/layer-0/tokens-expert-{e}")[0].value for e in range(4)]
    # Per iteration: 4 samples x 64 tokens, each routed to 2 experts.
    assert sum(counts) == 4 * 64 * 2
    assert acc.Scalars("moe/aux-loss")[0].value > 0
    # Resuming at iteration 2 (expert biases included) reproduces iterations 3-4 bit for bit.
    resumed = run_layout(flags + ["--load", str(tmp_path / "ckpt"), "--ckpt-step", "2"], 1, tmp_path / "b")
    want = {r["iteration"]: r["loss"] for r in full.records if "loss" in r and r["iteration"] > 2}
    got = {r["iteration"]: r["loss"] for r in resumed.records if "loss" in r}
    assert got == want
    # Hugging Face export writes dense Llama: an MoE checkpoint is refused in one line.
    from tricorn.training.hf_convert import export_main

    assert export_main(["--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf")]) == 2
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("distopt", [False, True], ids=["ddp", "distopt"])
def test_checkpoint_saved_at_ep2_resumes_at_ep4_and_ep1(tmp_path: Path, distopt: bool):
    flags = with_flag(FLAGS, "--train-iters", "4") + (["--use-distributed-optimizer"] if distopt else [])
    full = run_layout(flags + EP2 + ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"], 2, tmp_path / "ep2")
    want = [r["loss"] for r in full.records if "loss" in r and r["iteration"] > 2]
    for nproc, extra in ((4, ["--expert-model-parallel-size", "4"]), (1, [])):
        resumed = run_layout(
            flags + extra + ["--load", str(tmp_path / "ckpt"), "--ckpt-step", "2"], nproc, tmp_path / f"n{nproc}"
        )
        # Another layout reorders fp32 sums from the resume on: the harness's FP32_RTOL reasoning.
        assert_close([r["loss"] for r in resumed.records if "loss" in r], want)
