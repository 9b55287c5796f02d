"""All-to-all context parallelism (``--cp-comm-type a2a``, DeepSpeed Ulysses): trade sequence shards for heads.

Each CP rank holds its head-tail chunks of q, k, v for all of its (TP-local) heads. One all-to-all per tensor
turns that into the whole sequence, in global order, for 1/CP of the heads; attention is then one
full-sequence causal call (flash on CUDA, the same call as a single process makes), and one all-to-all turns
the output back into sequence chunks with all heads.

Query heads must divide by CP. Key/value heads that do not (GQA with fewer groups than CP, or a count CP does
not divide) are replicated first: each is repeated CP / gcd(groups, CP) times, the least that splits evenly
and keeps every query head with its own group. That multiplies the K/V traffic (and the K/V all-to-all
buffers) by the same factor; the validation refuses query heads that CP does not divide.

Collectives (CP group): forward 3 all-to-alls (q, k and v; each moves (CP-1)/CP of the tensor) and 1 for the
output; backward the same 4 in reverse (dout in; dq, dk, dv out). Memory: the full-sequence q, k, v and output
of H/CP heads - the same bytes as the local chunks of all heads - plus one a2a buffer each. Attention dropout
runs here with the keyed masks of dropout.py (each rank draws the masks of its global heads).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.distributed as dist

from tricorn.model.dropout import AttentionDropout
from tricorn.model.masking import AttentionMask
from tricorn.model.spec import sdpa_causal
from tricorn.parallel.context.layout import global_order


def kv_replicas(kv_heads: int, cp: int) -> int:
    """How often each key/value head is repeated so that CP ranks get whole, equal sets of them."""
    return cp // math.gcd(kv_heads, cp)


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, to_global: torch.Tensor) -> torch.Tensor:
    """[b, h, s_local, d] (head-tail chunks) -> [b, h/CP, s, d] in global order."""
    cp = dist.get_world_size(group)
    b, h, s_local, d = x.shape
    send = x.reshape(b, cp, h // cp, s_local, d).transpose(0, 1).contiguous()  # [CP, b, h/CP, s_local, d]: rank j's heads
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's chunks of my heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s_local, d).index_select(2, to_global)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, to_gathered: torch.Tensor) -> torch.Tensor:
    """[b, h/CP, s, d] in global order -> [b, h, s_local, d] of this rank's chunks; the inverse of _seq_to_heads."""
    cp = dist.get_world_size(group)
    b, hc, s, d = x.shape
    send = x.index_select(2, to_gathered).view(b, hc, cp, s // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)  # [CP, b, h/CP, s_local, d]: recv[j] is rank j's heads of my chunks
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(b, cp * hc, s // cp, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, to_global, to_gathered):
        ctx.args = (group, to_global, to_gathered)
        return _seq_to_heads(x, group, to_global)

    @staticmethod
    def backward(ctx, grad):
        group, to_global, to_gathered = ctx.args
        return _heads_to_seq(grad, group, to_gathered), None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, to_global, to_gathered):
        ctx.args = (group, to_global, to_gathered)
        return _heads_to_seq(x, group, to_gathered)

    @staticmethod
    def backward(ctx, grad):
        group, to_global, to_gathered = ctx.args
        return _seq_to_heads(grad, group, to_global), None, None, None


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout: Optional[AttentionDropout],
    group: dist.ProcessGroup,
    mask: Optional[AttentionMask] = None,
) -> torch.Tensor:
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    order = global_order(q.shape[2] * cp, cp, q.device)
    reps = kv_replicas(k.shape[1], cp)
    if reps > 1:  # the documented extra traffic: whole K/V heads for every rank
        k, v = k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1)
    q, k, v = (_SeqToHeads.apply(t, group, *order) for t in (q, k, v))
    if dropout is not None:  # this rank's global heads start cp_rank x H/CP after the TP rank's first head
        dropout = dataclasses.replace(dropout, head_offset=dropout.head_offset + rank * q.shape[1])
    out = sdpa_causal(q, k, v, dropout, mask)  # the whole sequence: documents and windows as on one device
    return _HeadsToSeq.apply(out, group, *order)
