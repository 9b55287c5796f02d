"""Tensor-parallel layers against torch's single-device layers, and whole-model TP/SP/DP equivalence."""

from pathlib import Path

import pytest
from harness import BASE_FLAGS, assert_equivalent, run_script, with_flag

WORKERS = Path(__file__).parent / "workers"


@pytest.mark.parametrize("nproc", [2, 4])
def test_layers_match_torch(nproc):
    assert "ok" in run_script(WORKERS / "tp_layers.py", nproc)


def test_sp_and_cp_collectives_copy_nothing():
    """Sequence-first tensors: no transposing copy around the SP and CP collectives, no clone before a TP
    all-reduce (tests/workers/tp_copies.py counts aten copy_ and clone outside the collectives)."""
    assert "ok" in run_script(WORKERS / "tp_copies.py", 2)


LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "tp4": (4, ["--tensor-model-parallel-size", "4"]),
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "dp2": (2, []),
    "tp2_dp2_sp": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_single_process(name, tmp_path):
    nproc, extra = LAYOUTS[name]
    assert_equivalent(BASE_FLAGS, nproc, tmp_path, extra)


def test_gqa_under_tp(tmp_path):
    flags = BASE_FLAGS + ["--num-query-groups", "2", "--group-query-attention", "--swiglu"]
    assert_equivalent(flags, 2, tmp_path, ["--tensor-model-parallel-size", "2", "--sequence-parallel"])


def test_untied_learned_positions_layernorm(tmp_path):
    flags = BASE_FLAGS + [
        "--untie-embeddings-and-output-weights",
        "--position-embedding-type",
        "learned_absolute",
        "--normalization",
        "LayerNorm",
    ]
    assert_equivalent(flags, 2, tmp_path, ["--tensor-model-parallel-size", "2", "--sequence-parallel"])


def test_vocab_not_divisible_by_tp(tmp_path):
    # 501 tokens: padded to 501 at TP=1 and to 502 at TP=2; padding must never change the loss.
    flags = with_flag(with_flag(BASE_FLAGS, "--vocab-size", "501"), "--make-vocab-size-divisible-by", "1")
    assert_equivalent(flags, 2, tmp_path, ["--tensor-model-parallel-size", "2"])


def _tb_scalars(logdir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_tensorboard_lm_loss_tp2_equals_single_process(tmp_path):
    """The Foundation acceptance as a user checks it: TensorBoard `lm loss` for iterations 1-5."""
    from harness import run_layout

    run_layout(BASE_FLAGS + ["--tensorboard-dir", str(tmp_path / "tb1")], 1, tmp_path / "one")
    run_layout(
        BASE_FLAGS + ["--tensorboard-dir", str(tmp_path / "tb2"), "--tensor-model-parallel-size", "2"], 2, tmp_path / "two"
    )
    one, two = _tb_scalars(tmp_path / "tb1", "lm loss"), _tb_scalars(tmp_path / "tb2", "lm loss")
    assert sorted(one) == sorted(two) == [1, 2, 3, 4, 5]
    for step in one:  # TB stores float32: compare at float32 resolution
        # FP32_RTOL's argument (tests/harness.py): TP reorders fp32 sums; TB's float32 storage adds one rounding.
        assert abs(one[step] - two[step]) <= 1e-5 * abs(one[step]), (step, one[step], two[step])
