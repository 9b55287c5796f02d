"""Ring attention (``--cp-comm-type p2p``): K/V chunks travel a ring of point-to-point messages.

CP rank r holds sequence chunks r and 2CP-1-r of q, k, v (c rows each). At step i it attends to the K/V pair
that started on rank src = (r - i) mod CP, which arrived from rank r-1 at the end of step i-1:

- step 0: its own pair, one causal call on the 2c x 2c block (the head-tail layout makes top-left causal
  exactly the global causal mask);
- i <= r (src < r): all 2c queries against src's first chunk, unmasked (src's second chunk is in the future);
- i > r (src > r): the second query chunk against both of src's chunks, unmasked (the first query chunk
  precedes both).

Every rank does the same work per step. Partial results merge through the lse (blocks.py) in fp32.

Collectives (all over the CP group, ring order r -> r+1): forward CP-1 messages of the K/V pair
(2 x b x hkv x 2c x d elements each, at k's head count: GQA never repeats K/V); backward CP-1 messages of K/V
again plus CP-1 messages of the fp32 dK/dV accumulator, which starts on the rank after the pair's home, travels
the ring with the pair it belongs to and whose last message brings it home (to the home's own block's part). Each step's next message is posted (batch_isend_irecv) before the step's
attention, so communication overlaps compute (on NCCL the messages run on NCCL's stream; on gloo they are
async ops). Memory: at most two K/V pairs in flight (the one in use and the one arriving), the fp32 output
and lse accumulators of the local rows; backward adds the fp32 dq accumulator and three fp32 dK/dV pairs
(the home's own part, the accumulator being added to and the one arriving). Saved for backward: q, k, v, the output and the lse -
the same as one flash call on the local rows. No [s, s] or [s/CP, s] tensor is ever made. Attention dropout
runs each step's block as explicit math with the keyed masks of its global positions (blocks.py).

Documents and windows (tricorn/model/masking.py): each step runs the masked op on this rank's two chunks against the
visiting pair's two by global positions, so a step's blocks no document spans (a document that ended before this
rank's chunks begin, keys beyond the window) are never called; the pair still travels (every rank's next step
needs it), and the head-tail layout that balances causal work stays as it is.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from tricorn.model.dropout import AttentionDropout
from tricorn.model.masking import AttentionMask, attend_masked, attend_masked_backward
from tricorn.parallel.context.blocks import (
    Block,
    BlockDropout,
    accumulator_dtype,
    backward_blocks,
    empty_accumulators,
    finish_output,
    forward_blocks,
    merge_,
)
from tricorn.parallel.context.layout import chunk_runs, local_positions


class Ring:
    """Send to CP rank r+1, receive from r-1, asynchronously."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def shift(self, send: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Post `send` to the next rank and a receive of the same shape from the previous one; (buffer, works)."""
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, group=self.group, group_peer=(self.rank + 1) % self.size),
            dist.P2POp(dist.irecv, recv, group=self.group, group_peer=(self.rank - 1) % self.size),
        ]
        return recv, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def ring_blocks(step: int, rank: int, chunk: int) -> list[Block]:
    """The kernel calls of ring step `step` on CP rank `rank` (rows of the local q and of the visiting K/V pair)."""
    two = 2 * chunk
    if step == 0:
        return [Block(0, two, 0, two, True)]
    if step <= rank:
        return [Block(0, two, 0, chunk, False)]
    return [Block(chunk, two, 0, two, False)]


def _step_dropout(dropout: Optional[AttentionDropout], ring: Ring, step: int, s_local: int, device) -> Optional[BlockDropout]:
    """The keyed masks of step `step`: this rank's query positions against those of the visiting K/V pair."""
    if dropout is None:
        return None
    s = s_local * ring.size
    src = (ring.rank - step) % ring.size
    return BlockDropout(dropout, local_positions(s, ring.rank, ring.size, device), local_positions(s, src, ring.size, device))


def _masked_args(mask: AttentionMask, ring: Ring, step: int, chunk: int) -> tuple:
    """The masked op's arguments for step `step`: this rank's chunks against those of the pair's home rank."""
    src = (ring.rank - step) % ring.size
    window = -1 if mask.window is None else mask.window
    return (
        mask.documents,
        chunk_runs(ring.rank, ring.size, chunk),
        chunk_runs(src, ring.size, chunk),
        2 * chunk * ring.size,
        window,
    )


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, dropout: Optional[AttentionDropout], mask: Optional[AttentionMask]):
        chunk = q.shape[2] // 2
        out_acc, lse_acc = empty_accumulators(q)
        kv = torch.stack([k, v])  # one message per step: [2, b, hkv, 2c, d]
        for step in range(ring.size):
            works: list = []
            if step + 1 < ring.size:
                nxt, works = ring.shift(kv)
            if mask is not None:  # documents / window: the blocks of this step some document spans (masking.py)
                merge_(out_acc, lse_acc, *attend_masked(q, kv[0], kv[1], *_masked_args(mask, ring, step, chunk)))
            else:
                drop = _step_dropout(dropout, ring, step, q.shape[2], q.device)
                forward_blocks(q, kv[0], kv[1], ring_blocks(step, ring.rank, chunk), out_acc, lse_acc, drop)
            if works:
                _wait(works)
                kv = nxt
        out = finish_output(q, out_acc)
        ctx.ring, ctx.dropout, ctx.mask = ring, dropout, mask
        ctx.save_for_backward(q, k, v, out, lse_acc)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring: Ring = ctx.ring
        chunk = q.shape[2] // 2
        acc = accumulator_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        # Step 0's block (this rank's own K/V) is kept here; the accumulator of every other pair starts on the
        # rank after its home and travels on with it: CP-1 messages bring each home, the least a ring can.
        own = torch.zeros(kv.shape, dtype=acc, device=q.device)
        dkv: Optional[torch.Tensor] = None  # the travelling accumulator of the pair now here
        dkv_works: list = []
        for step in range(ring.size):
            kv_works: list = []
            if step + 1 < ring.size:
                nxt, kv_works = ring.shift(kv)
            _wait(dkv_works)
            if step == 0:
                target = own
            else:
                target = dkv if step > 1 else torch.zeros(kv.shape, dtype=acc, device=q.device)
            if ctx.mask is not None:
                gq, gk, gv = attend_masked_backward(dout, q, kv[0], kv[1], out, lse, *_masked_args(ctx.mask, ring, step, chunk))
                dq += gq
                target[0] += gk
                target[1] += gv
            else:
                blocks = ring_blocks(step, ring.rank, chunk)
                drop = _step_dropout(ctx.dropout, ring, step, q.shape[2], q.device)
                backward_blocks(dout, q, kv[0], kv[1], out, lse, blocks, dq, target[0], target[1], drop)
            if step > 0:
                sending = target  # referenced until the wait that ends its message (next step, or after the loop)
                dkv, dkv_works = ring.shift(sending)  # on with its pair; after the last step, home
            if kv_works:
                _wait(kv_works)
                kv = nxt
        _wait(dkv_works)
        dkv = own if dkv is None else own.add_(dkv)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(
    q, k, v, ring: Ring, dropout: Optional[AttentionDropout] = None, mask: Optional[AttentionMask] = None
) -> torch.Tensor:
    """Causal attention of this rank's head-tail chunks over the whole sequence (q [b, h, 2c, d], k, v [b, hkv, 2c, d]),
    limited further by `mask` (documents, window)."""
    return _RingAttention.apply(q, k, v, ring, dropout, mask)
