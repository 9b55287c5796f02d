"""The global rectangles a rank's owned range of a parameter maps to (tricorn/checkpoint/pieces.py)."""

from __future__ import annotations

import pytest
import torch

from tricorn.checkpoint.pieces import owned_pieces
from tricorn.model.init import SHARD_ATTR, ShardInfo


def _param(shape: tuple[int, ...], info: ShardInfo | None = None) -> torch.Tensor:
    p = torch.zeros(shape)
    if info is not None:
        setattr(p, SHARD_ATTR, info)
    return p


def _cover(p: torch.Tensor, ranges: list[tuple[int, int]], global_shape: tuple[int, ...]) -> torch.Tensor:
    """How often each global element is written when every range's pieces are laid out at their offsets."""
    hits = torch.zeros(global_shape, dtype=torch.int64)
    for start, stop in ranges:
        total = 0
        for piece in owned_pieces(p, start, stop):
            index = tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.sizes))
            hits[index] += 1
            assert piece.hi - piece.lo == hits[index].numel()
            total += piece.hi - piece.lo
        assert total <= stop - start
    return hits


@pytest.mark.parametrize("cuts", [[0, 24], [0, 5, 24], [0, 7, 13, 24], [0, 1, 2, 23, 24], [3, 3, 24]])
def test_any_split_of_a_matrix_covers_it_once(cuts):
    p = _param((4, 6))
    ranges = [(a, b) for a, b in zip([0, *cuts], cuts) if b > a]
    assert torch.equal(_cover(p, ranges, (4, 6)), torch.ones(4, 6, dtype=torch.int64))


def test_a_range_is_at_most_three_rectangles():
    p = _param((5, 6))
    pieces = owned_pieces(p, 4, 27)  # the end of row 0, rows 1-3, the start of row 4
    assert [(x.offsets, x.sizes) for x in pieces] == [((0, 4), (1, 2)), ((1, 0), (3, 6)), ((4, 0), (1, 3))]
    assert [(x.lo, x.hi) for x in pieces] == [(0, 2), (2, 20), (20, 23)]


def test_tensor_parallel_offsets_and_vocabulary_padding():
    """TP rank 1 of 2 of a vocabulary of 7 rows padded to 4 rows per rank: rows 4-6 globally, row 3 is padding."""
    info = ShardInfo(dim=0, rank=1, world=2, full_size=7)
    p = _param((4, 3), info)
    pieces = owned_pieces(p, 0, 12)
    assert [(x.offsets, x.sizes) for x in pieces] == [((4, 0), (3, 3))]
    assert owned_pieces(p, 9, 12) == []  # only padding
    row_parallel = _param((2, 3), ShardInfo(dim=1, rank=1, world=2, full_size=6))
    assert [(x.offsets, x.sizes) for x in owned_pieces(row_parallel, 1, 6)] == [((0, 4), (1, 2)), ((1, 3), (1, 3))]


def test_vectors():
    assert [(x.offsets, x.sizes) for x in owned_pieces(_param((10,)), 3, 8)] == [((3,), (5,))]
