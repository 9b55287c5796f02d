"""Worker (2 ranks, TP=2 with SP, then CP=2 for rowwise): the FP8 column- and row-parallel GEMMs of every rank against the float64
product of one process's quantised values (tests/fp8_reference.py), for tensorwise e4m3 and rowwise hybrid.

The data makes per-shard scales visible: in each tensor TP splits, rank 0's half is large and rank 1's tiny
(1e-7 of it), and the weight half that multiplies the tiny half of the other operand... is what carries the
result: scaled over the whole tensor, the tiny half rounds to exact zeros (below FP8's smallest subnormal),
so one process computes exact zeros there, and a rank that scaled its own shard would not."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from fp8_reference import assert_gemm, dequantized  # noqa: E402

from tricorn.parallel.fp8 import DTYPES, FP8Recipe  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
group = dist.group.WORLD
S, B, H, F = 32, 2, 64, 32  # sequence, batch, hidden, the column linear's outputs (= the row linear's inputs)
gen = torch.Generator().manual_seed(7)


def halves(shape, dim):
    """randn with the second half along `dim` scaled to 1e-5 of the first (bf16)."""
    t = torch.randn(*shape, generator=gen) * 10
    t.narrow(dim, shape[dim] // 2, shape[dim] // 2).mul_(1e-7)
    return t.bfloat16()


def mine(t, dim):
    return t.chunk(world, dim)[rank]


for fmt, recipe_name in (("e4m3", "tensorwise"), ("hybrid", "rowwise")):
    recipe = FP8Recipe.from_config(fmt, recipe_name, group, None, group)
    rowwise, gdt = recipe.rowwise, recipe.grad_dtype
    e4m3 = DTYPES["e4m3"]
    # Column-parallel under SP: x split along the sequence, W [F, H] along its rows, g along its columns.
    x, g = halves((S, B, H), 0), halves((S, B, F), 2)
    w = torch.randn(F, H, generator=gen).bfloat16()
    w[: F // 2] = 0  # rank 0's rows: the dgrad's tiny g half (rank 1's) alone meets non-zero weights
    xs = mine(x, 0).clone().requires_grad_()
    ws = mine(w, 0).clone().requires_grad_()
    y = recipe.linear(xs, ws, None, group)
    y.backward(mine(g, 2).contiguous())
    x2, g2 = x.reshape(S * B, H), g.reshape(S * B, F)
    cols = slice(rank * F // world, (rank + 1) * F // world)
    xq = dequantized(x2, 1 if rowwise else None, e4m3)
    assert_gemm(y, xq, dequantized(w, 1 if rowwise else None, e4m3)[cols].t(), f"{recipe_name} column forward")
    gq = dequantized(g2, 1 if rowwise else None, gdt)
    wq = dequantized(w, 0 if rowwise else None, e4m3)
    # dx is reduce-scattered over TP: two bf16 partial sums and their bf16 sum (3 roundings)
    assert_gemm(xs.grad, gq[: S * B][rank * S * B // world : (rank + 1) * S * B // world], wq, "column dgrad", 3)
    gqt = dequantized(g2, 0, gdt) if rowwise else gq
    xqt = dequantized(x2, 0, e4m3) if rowwise else xq
    assert_gemm(ws.grad, gqt[:, cols].t(), xqt, f"{recipe_name} column wgrad")
    # Row-parallel: x [S, B, F] split along its features, W [H, F] along its columns; g [S, B, H] whole.
    x, g = halves((S, B, F), 2), halves((S, B, H), 0)
    w = torch.randn(H, F, generator=gen).bfloat16()
    w[:, : F // 2] = 0  # rank 0's columns: the forward's tiny x half (rank 1's) alone meets non-zero weights
    xs = mine(x, 2).contiguous().requires_grad_()
    ws = mine(w, 1).contiguous().requires_grad_()
    part = recipe.linear(xs, ws, None, in_split=True)
    part.backward(g)
    y = part.detach().clone()
    dist.all_reduce(y, group=group)  # the row-parallel sum (tensor.py's reduce_from_tp), in bf16
    x2, g2 = x.reshape(S * B, F), g.reshape(S * B, H)
    xq = dequantized(x2, 1 if rowwise else None, e4m3)
    assert_gemm(y, xq, dequantized(w, 1 if rowwise else None, e4m3).t(), f"{recipe_name} row forward", 3)
    gq = dequantized(g2, 1 if rowwise else None, gdt)
    wq = dequantized(w, 0 if rowwise else None, e4m3)
    cols = slice(rank * F // world, (rank + 1) * F // world)
    assert_gemm(xs.grad, gq, wq[:, cols], f"{recipe_name} row dgrad")
    gqt = dequantized(g2, 0, gdt) if rowwise else gq
    xqt = dequantized(x2, 0, e4m3) if rowwise else xq
    assert_gemm(ws.grad, gqt.t(), xqt[:, cols], f"{recipe_name} row wgrad")
# Rowwise under CP=2 (the two ranks hold the two halves of the sequence): the weight gradient's per-feature
# maxima run over all tokens, so rank 1's tiny tokens quantise to zeros as in one process.
recipe = FP8Recipe.from_config("hybrid", "rowwise", None, group, group)
x, g = halves((S, B, H), 0), halves((S, B, F), 0)
w = torch.randn(F, H, generator=gen).bfloat16().requires_grad_()
xs = mine(x, 0).clone().requires_grad_()
recipe.linear(xs, w, None).backward(mine(g, 0).contiguous())
rows = slice(rank * S * B // world, (rank + 1) * S * B // world)
gqt, xqt = dequantized(g.reshape(S * B, F), 0, DTYPES["e5m2"]), dequantized(x.reshape(S * B, H), 0, DTYPES["e4m3"])
assert_gemm(w.grad, gqt[rows].t(), xqt[rows], "rowwise wgrad under CP")
dist.destroy_process_group()
