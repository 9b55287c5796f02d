"""Tensor-parallel layers against torch's single-device layers, and whole-model TP/SP/DP equivalence."""

from pathlib import Path

import pytest
from harness import BASE_FLAGS, assert_equivalent, run_script, with_flag

WORKERS = Path(__file__).parent / "workers"


@pytest.mark.parametrize("nproc", [2, 4])
def test_layers_match_torch(nproc):
    assert "ok" in run_script(WORKERS / "tp_layers.py", nproc)


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
