"""Attention on blocks of the sequence, merged through the log-sum-exp: fused kernels, never a mask.

Document masking, sliding windows (tricorn/model/masking.py) and context parallelism's ring and all-gather
(tricorn/parallel/context/) all attend a query row to a union of rectangles of keys. Each rectangle is one
fused kernel call that returns the output and the per-row log-sum-exp (lse) of the scores, in one of three forms:

- unmasked: every row of the block sees every key of it;
- causal: a square block on the diagonal (row i sees keys up to its own position);
- anti-causal: a square block whose row i sees keys from its own position on (the lower edge of a sliding
  window). The kernels have no such mask, so the block runs as a causal call on its rows and keys reversed
  (fresh copies of the block's q, k, v, and of dout, out and lse in backward: linear in the block, no mask).

A block may be one sample's (`sample`: the documents differ per sample) or every sample's (None).

Kernels (``block_forward`` / ``block_backward``, no mask tensor anywhere):
- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (any float dtype, GQA native; its lse is laid
  out [B, S, H], so it is made contiguous before the backward, which reads it as [B, H, S]).
- CUDA: ``aten._scaled_dot_product_flash_attention`` where flash takes the block (attention_kernels.flash_refusal:
  fp16/bf16, head dim <= 256, sm80+; GQA native; no mask; causal only on square blocks, which is all the
  callers ask of it). Otherwise ``aten._scaled_dot_product_efficient_attention``
  (its lse is padded to a multiple of 32 rows; it takes no GQA in torch 2.13, so k, v are repeated to q's heads
  for the call only). The CUDA branch follows the ops' schemas and torch's own ring attention
  (torch/distributed/tensor/experimental/_context_parallel); no GPU was lent to run it here.

Merging block results o_i, l_i of the same rows: l = logaddexp(l_1, l_2, ...), o = sum_i exp(l_i - l) o_i,
accumulated in fp32 (fp64 for fp64 inputs). A row that saw no key in a block has lse -inf (flash reports +inf
for a fully masked row: it is read as -inf); a row that saw none so far keeps weight 0 instead of the NaN
that exp(-inf - -inf) gives. The backward of a block needs only the *global* output and lse (flash attention's
backward recomputes the probabilities from them), so each block's dq, dk, dv are exact partial sums.

``attend`` / ``attend_backward`` run a whole list of blocks. When every row is covered by blocks of one row
range only (documents without a window: one causal block per document), each block's result is written in place
in the compute dtype, exactly what one kernel call over the rows gives; otherwise the blocks of a row range merge
in fp32 (tile-sized accumulators when the row ranges are disjoint, whole-q ones when not). Gradients of keys that
several blocks read accumulate in fp32.

No collectives; memory: the outputs (q's shape and its lse), plus the transient accumulators above.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from tricorn.attention_kernels import AttentionCall, flash_refusal
from tricorn.model.lean import at_least_fp32

_aten = torch.ops.aten

UNMASKED, CAUSAL, ANTICAUSAL = 0, 1, 2


@dataclass(frozen=True)
class Block:
    """One kernel call: query rows [q0, q1) against key rows [k0, k1) of the operands, of sample `sample` (None:
    every sample). `causal`: a square block on the diagonal; `anticausal`: a square block, keys from the row on."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    sample: Optional[int] = None
    anticausal: bool = False

    @property
    def rows(self) -> slice:
        return slice(self.q0, self.q1)

    @property
    def keys(self) -> slice:
        return slice(self.k0, self.k1)

    @property
    def batch(self) -> slice:
        return slice(None) if self.sample is None else slice(self.sample, self.sample + 1)

    def operands(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This block's q rows and k, v rows (views of the whole operands)."""
        return q[self.batch, :, self.rows], k[self.batch, :, self.keys], v[self.batch, :, self.keys]


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def fold_heads(g: torch.Tensor, heads: int) -> torch.Tensor:
    """Gradient of repeat_heads: sum the copies of each key/value head."""
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
        q, repeat_heads(k, heads), repeat_heads(v, heads), None, True, 0.0, causal
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
        dout, q, repeat_heads(k, heads), repeat_heads(v, heads), None, out, lse_padded, none, none, 0.0,
        [True, True, True, False], causal,
    )  # fmt: skip
    return dq, fold_heads(dk, kv), fold_heads(dv, kv)


def _flip(t: torch.Tensor, dim: int = 2) -> torch.Tensor:
    return t.flip(dim)


def call_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blk: Block) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of block `blk`'s rows (q, k, v: the whole operands)."""
    qb, kb, vb = blk.operands(q, k, v)
    if not blk.anticausal:
        return block_forward(qb, kb, vb, blk.causal)
    out, lse = block_forward(_flip(qb), _flip(kb), _flip(vb), True)
    return _flip(out), _flip(lse, -1)


def call_backward(dout, q, k, v, out, lse, blk: Block) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of block `blk` (dout, out, lse: the rows' global ones; all tensors whole)."""
    b, rows, keys = blk.batch, blk.rows, blk.keys
    args = (dout[b, :, rows], q[b, :, rows], k[b, :, keys], v[b, :, keys], out[b, :, rows], lse[b, :, rows])
    if not blk.anticausal:
        *tensors, row_lse = args
        return block_backward(*tensors, row_lse.contiguous(), blk.causal)
    flipped = [_flip(t) for t in args[:5]] + [_flip(args[5], -1).contiguous()]
    dq, dk, dv = block_backward(*flipped, True)
    return _flip(dq), _flip(dk), _flip(dv)


def merge_(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into the running fp32 (out_acc, lse_acc) of the same rows, in place."""
    lse = lse.masked_fill(lse == float("inf"), float("-inf"))  # flash: +inf marks a row that saw no key
    new = torch.logaddexp(lse_acc, lse)
    safe = new.masked_fill(new == float("-inf"), 0.0)  # no key yet in either: both weights exp(-inf) = 0
    out_acc.mul_(torch.exp(lse_acc - safe).unsqueeze(-1)).add_(at_least_fp32(out) * torch.exp(lse - safe).unsqueeze(-1))
    lse_acc.copy_(new)


def empty_accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (or fp64) zero output and -inf lse for q's rows."""
    dtype = accumulator_dtype(q.dtype)
    b, h, s, _ = q.shape
    return q.new_zeros(q.shape, dtype=dtype), q.new_full((b, h, s), float("-inf"), dtype=dtype)


def finish_output(q: torch.Tensor, out_acc: torch.Tensor) -> torch.Tensor:
    """The merged output in q's dtype and memory layout (the decoder's [s, b, h, d] view then costs no copy)."""
    out = torch.empty_like(q)
    out.copy_(out_acc)
    return out


# ---------------------------------------------------------------- a list of blocks


def _groups(blocks: Sequence[Block]) -> Optional[list[list[Block]]]:
    """The blocks grouped by (sample, rows), when no two groups' rows meet in a sample; else None."""
    groups: dict[tuple, list[Block]] = {}
    for blk in blocks:
        groups.setdefault((blk.sample, blk.q0, blk.q1), []).append(blk)
    spans = sorted(groups)
    shared = [(q0, q1) for sample, q0, q1 in spans if sample is None]
    for sample in {s for s, _, _ in spans}:
        mine = sorted([(q0, q1) for s, q0, q1 in spans if s == sample] + (shared if sample is not None else []))
        if any(a[1] > b[0] for a, b in zip(mine, mine[1:])):
            return None
    return list(groups.values())


def _disjoint_keys(blocks: Sequence[Block]) -> bool:
    """No key row is read by two blocks of the same sample (so their gradients can be written, not added)."""
    by_sample: dict[Optional[int], list[tuple[int, int]]] = {}
    for blk in blocks:
        by_sample.setdefault(blk.sample, []).append((blk.k0, blk.k1))
    shared = by_sample.get(None, [])
    for sample, spans in by_sample.items():
        spans = sorted(spans + (shared if sample is not None else []))
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
            return False
    return True


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: Sequence[Block]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype and layout, lse [b, h, sq] fp32 or wider) of q's rows over the union of `blocks`.
    Rows no block covers get out 0 and lse -inf (a context-parallel step they have nothing to see in)."""
    out = torch.zeros_like(q)
    lse = q.new_full(q.shape[:3], float("-inf"), dtype=accumulator_dtype(q.dtype))
    groups = _groups(blocks)
    if groups is None:  # rows met by blocks of different row ranges: merge everything in whole-q accumulators
        out_acc, lse_acc = empty_accumulators(q)
        for blk in blocks:
            merge_(out_acc[blk.batch, :, blk.rows], lse_acc[blk.batch, :, blk.rows], *call_forward(q, k, v, blk))
        out.copy_(out_acc)
        return out, lse_acc
    for group in groups:
        first = group[0]
        where = (first.batch, slice(None), first.rows)
        o, row_lse = call_forward(q, k, v, first)
        row_lse = row_lse.masked_fill(row_lse == float("inf"), float("-inf"))  # flash: +inf for a row that saw no key
        if len(group) == 1:  # exactly one kernel call over these rows: its result as is
            out[where], lse[where] = o, row_lse
            continue
        out_acc, lse_acc = at_least_fp32(o).clone(), row_lse.to(lse.dtype)
        for blk in group[1:]:
            merge_(out_acc, lse_acc, *call_forward(q, k, v, blk))
        out[where], lse[where] = out_acc, lse_acc
    return out, lse


def attend_backward(dout, q, k, v, out, lse, blocks: Sequence[Block]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (q's, k's, v's dtype and layout) of `attend` given the rows' global out and lse."""
    acc = accumulator_dtype(q.dtype)
    groups = _groups(blocks)
    rows_once = groups is not None and all(len(g) == 1 for g in groups)
    keys_once = _disjoint_keys(blocks)
    # In the operands' layouts (a custom op's outputs must have the strides its fake implementation promises).
    dq = torch.zeros_like(q, dtype=q.dtype if rows_once else acc)
    dk, dv = (torch.zeros_like(t, dtype=t.dtype if keys_once else acc) for t in (k, v))
    for blk in blocks:
        gq, gk, gv = call_backward(dout, q, k, v, out, lse, blk)
        if rows_once:
            dq[blk.batch, :, blk.rows] = gq
        else:
            dq[blk.batch, :, blk.rows] += gq
        if keys_once:
            dk[blk.batch, :, blk.keys], dv[blk.batch, :, blk.keys] = gk, gv
        else:
            dk[blk.batch, :, blk.keys] += gk
            dv[blk.batch, :, blk.keys] += gv
    return _as(dq, q), _as(dk, k), _as(dv, v)


def _as(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if grad.dtype == like.dtype:
        return grad
    out = torch.empty_like(like)
    out.copy_(grad)
    return out
