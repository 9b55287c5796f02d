"""Dropout that does not depend on the layout: every parallel layout drops what one process drops.

Masks are drawn by (seed, global sample, layer, site, global position / head) in tricorn/model/dropout.py,
so the layouts below must equal the single-process run with hidden and attention dropout 0.1, at the
harness's fp32 bound (only summation order differs between layouts; the masks are identical).
"""

import pytest
import torch
import torch.nn.functional as F
from harness import BASE_FLAGS, assert_equivalent

from tricorn.model.dropout import ATTENTION_OUTPUT, AttentionDropout, DropoutKey, attention_with_dropout, hidden_dropout

DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
FLAGS = BASE_FLAGS + DROPOUT

LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "cp2": (2, ["--context-parallel-size", "2"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "dp2_distopt": (2, ["--use-distributed-optimizer"]),
    "tp2_sp_cp2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2"]),
    "dp2_recompute_full": (
        2,
        ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dropout_equals_one_process(tmp_path, layout):
    nproc, extra = LAYOUTS[layout]
    run = assert_equivalent(FLAGS, nproc, tmp_path, extra)
    assert all(r["loss"] == r["loss"] for r in run.records)  # no NaN slipped through


def test_dropout_is_on(tmp_path):
    """The runs above compare dropout against dropout: check it actually changes the loss."""
    from harness import reference

    with_dropout = reference(FLAGS, tmp_path / "with").losses
    without = reference(BASE_FLAGS, tmp_path / "without").losses
    assert with_dropout[0] != without[0]


def _key(sample_ids=(7, 12), layer=3, site=ATTENTION_OUTPUT, seq=16) -> DropoutKey:
    return DropoutKey(seed=1234, sample_ids=sample_ids, layer=layer, site=site, seq_length=seq)


def test_hidden_mask_is_drawn_by_global_position():
    """A shard's mask is the full mask's rows: any split of the sequence drops the same elements."""
    x = torch.ones(2, 16, 8, dtype=torch.float64)
    full = hidden_dropout(x, 0.3, _key(), torch.arange(16))
    rows = torch.tensor([2, 3, 12, 13])  # e.g. CP rank 1 of 4 keeps chunks 1 and 6
    assert torch.equal(hidden_dropout(x[:, rows], 0.3, _key(), rows), full[:, rows])  # same draws: exact
    assert torch.equal(hidden_dropout(x[1:], 0.3, _key(sample_ids=(12,)), torch.arange(16)), full[1:])
    assert not torch.equal(full, hidden_dropout(x, 0.3, _key(layer=4), torch.arange(16)))
    kept = (full != 0).double().mean().item()
    assert 0.5 < kept < 0.9  # 256 draws at keep 0.7: far inside these bounds unless the mask is broken


def test_attention_with_dropout_matches_the_math_in_float64():
    """Explicit attention: heads sliced over TP see the global heads' masks; with p -> 0 it is SDPA."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(16)
    tiny = AttentionDropout(1e-12, _key(), head_offset=0)  # keeps everything (rand < 1e-12 has odds ~1e-10)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # float64 on both sides: the difference is rounding of a 16-term softmax/matmul, far below 1e-12.
    torch.testing.assert_close(attention_with_dropout(q, k, v, tiny, pos, pos), ref, rtol=1e-12, atol=1e-12)
    drop = AttentionDropout(0.2, _key(), head_offset=0)
    whole = attention_with_dropout(q, k, v, drop, pos, pos)
    upper = attention_with_dropout(q[:, 2:], k[:, 2:], v[:, 2:], AttentionDropout(0.2, _key(), head_offset=2), pos, pos)
    # Same masks; a batched matmul over 2 vs 4 heads may block differently: float64 rounding, << 1e-12.
    torch.testing.assert_close(upper, whole[:, 2:], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(whole, ref)  # ... and p = 0.2 does drop something
