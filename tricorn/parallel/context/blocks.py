"""Attention on blocks of the sequence, merged through the log-sum-exp: what ring and all-gather CP compute with.

A CP rank never sees a whole [s, s] attention: it attends its queries to one block of keys at a time and
merges the partial results. Each block call is a fused kernel that returns the output and the per-row
log-sum-exp (lse) of the scores:

- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (any float dtype, GQA native; its lse is laid
  out [B, S, H], so it is made contiguous before the backward, which reads it as [B, H, S]).
- CUDA: ``aten._scaled_dot_product_flash_attention`` where flash takes the block (attention_kernels.flash_refusal:
  fp16/bf16, head dim <= 256, sm80+; GQA native; no mask; causal only on square blocks, which is all the
  schedules here ask of it). Otherwise ``aten._scaled_dot_product_efficient_attention``
  (its lse is padded to a multiple of 32 rows; it takes no GQA in torch 2.13, so k, v are repeated to q's heads
  for the call only - never before a message is sent). The CUDA branch follows the ops' schemas and torch's own
  ring attention (torch/distributed/tensor/experimental/_context_parallel); no GPU was lent to run it here.

Merging block results o_i, l_i of the same rows: l = logaddexp(l_1, l_2, ...), o = sum_i exp(l_i - l) o_i,
accumulated in fp32 (fp64 for fp64 inputs). A row that saw no key in a block has lse -inf (flash reports +inf
for a fully masked row: it is read as -inf); a row that saw none so far keeps weight 0 instead of the NaN
that exp(-inf - -inf) gives. The backward of a block needs only the *global* output and lse (flash attention's
backward recomputes the probabilities from them), so each block's dq, dk, dv are exact partial sums.

Attention dropout (BlockDropout): a block runs as explicit fp32 math instead, with the layer's keyed masks drawn
for the block's global query and key positions (model/dropout.py), so any split into blocks drops what one
process drops; the merge is the same, since dropout scales the probabilities after the softmax. It keeps the
block's [b, h, rows, keys] scores transiently (the fused kernels draw their own, layout-dependent masks).

No collectives; memory: the block call's output and lse, plus the caller's fp32 accumulators.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from tricorn.attention_kernels import AttentionCall, flash_refusal
from tricorn.model.dropout import AttentionDropout
from tricorn.model.lean import at_least_fp32

_aten = torch.ops.aten


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold_heads(g: torch.Tensor, heads: int) -> torch.Tensor:
    """Gradient of _repeat_heads: sum the copies of each key/value head."""
    b, h, s, d = g.shape
    return g if h == heads else g.view(b, heads, h // heads, s, d).sum(2)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _flash_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> bool:
    """Whether the flash op accepts this block on this GPU (attention_kernels.py's rules; the efficient op otherwise)."""
    call = AttentionCall.of(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
    return flash_refusal(call, _capability(q.device)) is None


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, h, sq, d] in q's dtype, lse [b, h, sq] fp32 or wider). q [b, h, sq, d]; k, v [b, hkv, sk, d]."""
    if q.device.type != "cuda":
        return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)  # lse viewed [B, H, S]
    if _flash_takes(q, k, v, causal):
        out, lse, *_ = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
        return out, lse
    heads = q.shape[1]
    out, lse, *_ = _aten._scaled_dot_product_efficient_attention(
        q, _repeat_heads(k, heads), _repeat_heads(v, heads), None, True, 0.0, causal
    )
    return out, lse[:, :, : q.shape[2]].contiguous()


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one block given the rows' global out and lse (dk, dv at k's head count)."""
    if q.device.type != "cuda":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)
    sq, sk = q.shape[2], k.shape[2]
    none = torch.empty(0, device=q.device, dtype=torch.int64)
    if _flash_takes(q, k, v, causal):
        # Dense inputs: no cumulative sequence lengths; dropout 0: the rng state is never read.
        return _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, none, none, sq, sk, 0.0, causal, none, none
        )
    heads, kv = q.shape[1], k.shape[1]
    pad = -sq % 32  # the efficient kernel reads its lse padded to a multiple of 32 rows
    lse_padded = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, _repeat_heads(k, heads), _repeat_heads(v, heads), None, out, lse_padded, none, none, 0.0,
        [True, True, True, False], causal,
    )  # fmt: skip
    return dq, _fold_heads(dk, kv), _fold_heads(dv, kv)


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
    kf = _repeat_heads(at_least_fp32(k), heads)
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
    return torch.matmul(probs, _repeat_heads(at_least_fp32(v), q.shape[1])), lse


def dropout_block_backward(dout, q, k, v, out, lse, rows, keys, causal, drop: BlockDropout):
    """dq, dk, dv of one dropout block from the rows' global out and lse (flash attention's backward, explicit)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    scores, keep = _dropout_scores(q, k, rows, keys, causal, drop)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    scale = keep.to(probs.dtype) * (1.0 / (1.0 - drop.dropout.p))  # in the math dtype (bool * float is fp32)
    dout = at_least_fp32(dout)
    dv = torch.matmul((probs * scale).transpose(-1, -2), dout)
    dprobs = torch.matmul(dout, _repeat_heads(at_least_fp32(v), heads).transpose(-1, -2)) * scale
    dscores = probs * (dprobs - (dout * at_least_fp32(out)).sum(-1, keepdim=True)) * (q.shape[-1] ** -0.5)
    dq = torch.matmul(dscores, _repeat_heads(at_least_fp32(k), heads))
    dk = torch.matmul(dscores.transpose(-1, -2), at_least_fp32(q))
    return dq, _fold_heads(dk, kv_heads), _fold_heads(dv, kv_heads)


def merge_(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into the running fp32 (out_acc, lse_acc) of the same rows, in place."""
    lse = lse.masked_fill(lse == float("inf"), float("-inf"))  # flash: +inf marks a row that saw no key
    new = torch.logaddexp(lse_acc, lse)
    safe = new.masked_fill(new == float("-inf"), 0.0)  # no key yet in either: both weights exp(-inf) = 0
    out_acc.mul_(torch.exp(lse_acc - safe).unsqueeze(-1)).add_(at_least_fp32(out) * torch.exp(lse - safe).unsqueeze(-1))
    lse_acc.copy_(new)


@dataclass(frozen=True)
class Block:
    """One kernel call: query rows [q0, q1) against key rows [k0, k1) of the operands, causal or unmasked."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def empty_accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (or fp64) zero output and -inf lse for q's rows."""
    dtype = accumulator_dtype(q.dtype)
    b, h, s, _ = q.shape
    return q.new_zeros(q.shape, dtype=dtype), q.new_full((b, h, s), float("-inf"), dtype=dtype)


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


def finish_output(q: torch.Tensor, out_acc: torch.Tensor) -> torch.Tensor:
    """The merged output in q's dtype and memory layout (the decoder's [s, b, h, d] view then costs no copy)."""
    out = torch.empty_like(q)
    out.copy_(out_acc)
    return out


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
