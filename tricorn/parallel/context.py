"""Context parallelism: each CP rank holds a slice of every sample's sequence.

Layout (load-balanced for causal attention): the sequence is cut into 2*CP
chunks and CP rank r keeps chunks r and 2*CP-1-r, so every rank has the same
amount of attention work. Everything outside attention is position-wise and
runs on the local tokens unchanged (RoPE and learned positions use the global
position ids of the kept chunks).

Attention all-gathers the keys and values of the whole sequence over the CP
group (forward: all-gather of k, v; backward: reduce-scatter of their
gradients) and masks causally by global position - the "all-gather KV" form of
CP (as in Llama 3 training) rather than ring attention: simpler, and with GQA
the gathered k/v are small (with GQA they are repeated to the query heads for the
kernel call, so that CUDA runs the memory-efficient kernel: see attention_kernels.py). Memory: activations / CP,
plus the full-sequence k, v of one layer at a time. Parameter gradients are summed over DP x CP by
the data-parallel reduction, like DP replicas.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tricorn.data.base import Batch
from tricorn.model.dropout import AttentionDropout, attention_with_dropout
from tricorn.model.spec import LayerSpec
from tricorn.parallel.tensor import all_gather_dim, reduce_scatter_dim


def local_positions(seq_length: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global positions of the tokens CP rank `cp_rank` keeps out of a `seq_length` sequence."""
    chunk = seq_length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, device=device)
    return torch.cat([first, second])


def slice_batch(batch: Batch, cp_rank: int, cp_size: int) -> Batch:
    if cp_size == 1:
        return batch
    idx = local_positions(batch.tokens.shape[1], cp_rank, cp_size, batch.tokens.device)
    return Batch(batch.tokens[:, idx], batch.labels[:, idx], batch.loss_mask[:, idx], batch.sample_ids)


class _GatherSeqForAttention(torch.autograd.Function):
    """[b, heads, s_local, d] -> [b, heads, s_local * cp, d] in CP-rank order."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim(x, 2, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim(grad, 2, ctx.group), None


def context_parallel_attention(group: dist.ProcessGroup, seq_length_local: int):
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: Optional[AttentionDropout]) -> torch.Tensor:
        s_local = q.shape[2]
        q_pos = local_positions(s_local * cp_size, cp_rank, cp_size, q.device)
        k_pos = torch.cat([local_positions(s_local * cp_size, r, cp_size, q.device) for r in range(cp_size)])
        k = _GatherSeqForAttention.apply(k, group)
        v = _GatherSeqForAttention.apply(v, group)
        if dropout is not None:  # masks drawn by global position: the same as one process draws
            return attention_with_dropout(q, k, v, dropout, q_pos, k_pos)
        mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # True = may attend
        if k.shape[1] != q.shape[1]:
            # On CUDA flash takes no mask and torch 2.13's efficient kernel no GQA, so a masked call with
            # enable_gqa runs the math kernel (fp32 scores [b, h, s/CP, s]). With k, v repeated to q's heads
            # the efficient kernel takes it; the cost is the gathered k, v at full head count for one layer.
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return core


def apply_context_parallel(spec: LayerSpec, group: dist.ProcessGroup, seq_length: int) -> LayerSpec:
    """The spec with CP attention and the kept chunks' position ids; unchanged when CP is 1."""
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    if cp_size == 1:
        return spec
    return dataclasses.replace(
        spec,
        core_attention=context_parallel_attention(group, seq_length // cp_size),
        position_ids=lambda s, device: local_positions(s * cp_size, cp_rank, cp_size, device),
    )
