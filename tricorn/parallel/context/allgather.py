"""All-gather context parallelism (``--cp-comm-type allgather``): every rank gathers the whole sequence's K/V.

The form Llama 3 was trained with. K and V (at their own head count: GQA is never repeated) are all-gathered
over CP and put in sequence order; each of this rank's two chunks (global chunk g, c rows) then attends to the
prefix it may see as two fused kernel calls merged through the lse (blocks.py): the g*c earlier rows unmasked,
and its own c x c diagonal block causal. No mask tensor exists, so flash takes both calls on CUDA.

Collectives (CP group): forward one all-gather each of k and v; backward one reduce-scatter each of their
gradients. Nothing overlaps the gather. Memory: the whole sequence's k and v of one layer (and their fp32
gradient accumulators in backward), on top of activations / CP. Attention dropout runs each block as explicit
math with the keyed masks of its global positions (blocks.py). Documents and windows (tricorn/model/masking.py):
the masked op plans this rank's two chunks against the gathered sequence by global positions (one call per
document piece and window tile; prefixes no document spans are never called).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from tricorn.model.dropout import AttentionDropout
from tricorn.model.masking import AttentionMask, attend_masked, whole
from tricorn.parallel.context.blocks import Block, BlockDropout, block_attention
from tricorn.parallel.context.layout import chunk_runs, global_order, local_positions
from tricorn.parallel.tensor import all_gather_dim, reduce_scatter_dim


class _GatherSeq(torch.autograd.Function):
    """[b, heads, s_local, d] -> [b, heads, s, d] in CP-rank order; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim(x, 2, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim(grad, 2, ctx.group), None


def prefix_blocks(cp_rank: int, cp_size: int, chunk: int) -> list[Block]:
    """Each kept chunk (global chunk g) against rows [0, g*c) unmasked and its diagonal block causal."""
    blocks = []
    for j, g in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
        rows = (j * chunk, (j + 1) * chunk)
        if g > 0:
            blocks.append(Block(*rows, 0, g * chunk, False))
        blocks.append(Block(*rows, g * chunk, (g + 1) * chunk, True))
    return blocks


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout: Optional[AttentionDropout],
    group: dist.ProcessGroup,
    mask: Optional[AttentionMask] = None,
) -> torch.Tensor:
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    s_local = q.shape[2]
    to_global, _ = global_order(s_local * cp, cp, q.device)
    k, v = (_GatherSeq.apply(t, group).index_select(2, to_global) for t in (k, v))
    if mask is not None:  # documents / window: this rank's chunks against the gathered sequence by global positions
        s, window = s_local * cp, -1 if mask.window is None else mask.window
        runs = chunk_runs(rank, cp, s_local // 2)
        return attend_masked(q, k, v, mask.documents, runs, whole(s), s, window)[0]
    drop = None
    if dropout is not None:  # masks drawn by global position: the same as one process draws
        q_pos = local_positions(s_local * cp, rank, cp, q.device)
        drop = BlockDropout(dropout, q_pos, torch.arange(s_local * cp, device=q.device))
    return block_attention(q, k, v, prefix_blocks(rank, cp, s_local // 2), drop)
