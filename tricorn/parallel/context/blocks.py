"""Context parallelism's blocks: the kernels on blocks, and attention dropout on blocks.

A CP rank never sees a whole [s, s] attention: it attends its queries to one block of keys at a time and merges
the partial results through the log-sum-exp. The kernels, the block description and the merge are the model's
(tricorn/model/attention_blocks.py: fused calls, never a mask); this module runs lists of blocks for the ring and
the all-gather, with or without attention dropout.

Attention dropout (BlockDropout): a block runs as explicit fp32 math instead, with the layer's keyed masks drawn
for the block's global query and key positions (model/dropout.py), so any split into blocks drops what one
process drops; the merge is the same, since dropout scales the probabilities after the softmax. It keeps the
block's [b, h, rows, keys] scores transiently (the fused kernels draw their own, layout-dependent masks).

No collectives; memory: the block call's output and lse, plus the caller's fp32 accumulators.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tricorn.model.attention_blocks import (
    Block,
    accumulator_dtype,
    block_backward,
    block_forward,
    empty_accumulators,
    finish_output,
    fold_heads,
    merge_,
    repeat_heads,
)
from tricorn.model.dropout import AttentionDropout
from tricorn.model.lean import at_least_fp32

__all__ = [
    "Block",
    "BlockDropout",
    "accumulator_dtype",
    "backward_blocks",
    "block_attention",
    "empty_accumulators",
    "finish_output",
    "forward_blocks",
    "merge_",
]


@dataclass(frozen=True)
class BlockDropout:
    """Attention dropout on blocks: the layer's keyed masks (model/dropout.py) and the global positions of the
    query rows and of the key rows of the operands, so each block draws exactly the single-process mask."""

    dropout: AttentionDropout
    q_pos: torch.Tensor
    k_pos: torch.Tensor


def _dropout_scores(q, k, rows, keys, causal, drop: BlockDropout):
    """fp32 scores [b, h, r, k] of one block (k repeated to q's heads), its keep mask and allowed mask."""
    heads = q.shape[1]
    kf = repeat_heads(at_least_fp32(k), heads)
    scores = torch.matmul(at_least_fp32(q), kf.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    q_pos, k_pos = drop.q_pos[rows], drop.k_pos[keys]
    if causal:
        scores = scores.masked_fill(k_pos.unsqueeze(0) > q_pos.unsqueeze(1), float("-inf"))
    keep = drop.dropout.keep_mask(heads, q_pos, k_pos, q.device)
    return scores, keep


def dropout_block_forward(q, k, v, rows, keys, causal, drop: BlockDropout):
    """One block of explicit attention with keyed dropout of its probabilities: (out, lse) like block_forward."""
    scores, keep = _dropout_scores(q, k, rows, keys, causal, drop)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)) * keep * (1.0 / (1.0 - drop.dropout.p))  # as dropout.py scales
    return torch.matmul(probs, repeat_heads(at_least_fp32(v), q.shape[1])), lse


def dropout_block_backward(dout, q, k, v, out, lse, rows, keys, causal, drop: BlockDropout):
    """dq, dk, dv of one dropout block from the rows' global out and lse (flash attention's backward, explicit)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    scores, keep = _dropout_scores(q, k, rows, keys, causal, drop)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    scale = keep.to(probs.dtype) * (1.0 / (1.0 - drop.dropout.p))  # in the math dtype (bool * float is fp32)
    dout = at_least_fp32(dout)
    dv = torch.matmul((probs * scale).transpose(-1, -2), dout)
    dprobs = torch.matmul(dout, repeat_heads(at_least_fp32(v), heads).transpose(-1, -2)) * scale
    dscores = probs * (dprobs - (dout * at_least_fp32(out)).sum(-1, keepdim=True)) * (q.shape[-1] ** -0.5)
    dq = torch.matmul(dscores, repeat_heads(at_least_fp32(k), heads))
    dk = torch.matmul(dscores.transpose(-1, -2), at_least_fp32(q))
    return dq, fold_heads(dk, kv_heads), fold_heads(dv, kv_heads)


def forward_blocks(q, k, v, blocks, out_acc, lse_acc, drop: Optional[BlockDropout] = None) -> None:
    """Attend q's rows to k/v's rows block by block, merging into the accumulators."""
    for blk in blocks:
        rows = slice(blk.q0, blk.q1)
        keys = slice(blk.k0, blk.k1)
        if drop is not None:
            out, lse = dropout_block_forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], rows, keys, blk.causal, drop)
        else:
            out, lse = block_forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], blk.causal)
        merge_(out_acc[:, :, rows], lse_acc[:, :, rows], out, lse)


def backward_blocks(dout, q, k, v, out, lse, blocks, dq_acc, dk_acc, dv_acc, drop: Optional[BlockDropout] = None) -> None:
    """Add every block's dq, dk, dv (given the global out and lse of q's rows) to the accumulators."""
    for blk in blocks:
        rows = slice(blk.q0, blk.q1)
        keys = slice(blk.k0, blk.k1)
        args = (dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows], lse[:, :, rows].contiguous())
        if drop is not None:
            dq, dk, dv = dropout_block_backward(*args, rows, keys, blk.causal, drop)
        else:
            dq, dk, dv = block_backward(*args, blk.causal)
        dq_acc[:, :, rows] += dq
        dk_acc[:, :, keys] += dk
        dv_acc[:, :, keys] += dv


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, blocks, drop):
        out_acc, lse_acc = empty_accumulators(q)
        forward_blocks(q, k, v, blocks, out_acc, lse_acc, drop)
        out = finish_output(q, out_acc)
        ctx.blocks, ctx.drop = blocks, drop
        ctx.save_for_backward(q, k, v, out, lse_acc)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        acc = accumulator_dtype(q.dtype)
        dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
        backward_blocks(dout, q, k, v, out, lse, ctx.blocks, dq, dk, dv, ctx.drop)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def block_attention(q, k, v, blocks: list[Block], drop: Optional[BlockDropout] = None) -> torch.Tensor:
    """Attention of q's rows over the union of `blocks` (each a fused kernel call), merged through the lse."""
    return _BlockAttention.apply(q, k, v, blocks, drop)
