"""Context parallelism: each CP rank holds a slice of every sample's sequence.

Layout (layout.py, load-balanced for causal attention): the sequence is cut into 2*CP chunks and CP rank r
keeps chunks r and 2*CP-1-r. Everything outside attention is position-wise and runs on the local tokens
unchanged (RoPE and learned positions use the global position ids of the kept chunks). Parameter gradients
are summed over DP x CP by the data-parallel reduction, like DP replicas.

Attention meets the rest of the sequence one of three ways (``--cp-comm-type``, Megatron's flag), one module each:

- ``p2p`` (ring.py, the default): K/V pairs travel a ring of point-to-point messages overlapped with one
  fused kernel call per step; at most two K/V pairs in flight.
- ``a2a`` (ulysses.py): all-to-all from sequence chunks to head shards, one full-sequence causal call on
  H/CP heads, all-to-all back. Needs query heads divisible by CP.
- ``allgather`` (allgather.py): all-gather of the whole K/V, two fused calls per kept chunk.

All three compute with fused kernels that return the log-sum-exp (blocks.py) and never build an [s/CP, s]
mask or score tensor. Documents (--reset-attention-mask) and windows (--window-size) follow one rule on global
positions with every comm type (tricorn/model/masking.py): the ring and the all-gather plan each chunk's blocks by
the global positions of its rows and keys, a2a attends its gathered whole sequences as one device does. Attention dropout keeps its layout-independent keyed masks with every comm type: the
ring and allgather draw each block's masks by its global positions, a2a those of its global heads.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from tricorn.config import CP_COMM_TYPES
from tricorn.model.dropout import AttentionDropout
from tricorn.model.masking import AttentionMask
from tricorn.model.spec import LayerSpec
from tricorn.parallel.context.allgather import allgather_attention
from tricorn.parallel.context.layout import local_positions, slice_batch
from tricorn.parallel.context.ring import Ring, ring_attention
from tricorn.parallel.context.ulysses import ulysses_attention

COMM_TYPES = CP_COMM_TYPES
# The comm types that draw the keyed attention-dropout masks (validation names them).
DROPOUT_COMM_TYPES = ("a2a", "allgather")

__all__ = [
    "COMM_TYPES",
    "DROPOUT_COMM_TYPES",
    "apply_context_parallel",
    "context_parallel_attention",
    "local_positions",
    "slice_batch",
]


def context_parallel_attention(group: dist.ProcessGroup, comm_type: str = "p2p"):
    """The core_attention of a CP rank: causal attention of its kept chunks over the whole sequence."""
    if comm_type not in COMM_TYPES:
        raise ValueError(f"--cp-comm-type must be one of {', '.join(COMM_TYPES)}, got {comm_type!r}")
    ring = Ring(group) if comm_type == "p2p" else None

    def core(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dropout: Optional[AttentionDropout],
        mask: Optional[AttentionMask] = None,
    ) -> torch.Tensor:
        if comm_type == "a2a":
            return ulysses_attention(q, k, v, dropout, group, mask)
        if comm_type == "allgather":
            return allgather_attention(q, k, v, dropout, group, mask)
        return ring_attention(q, k, v, ring, dropout, mask)

    return core


def apply_context_parallel(spec: LayerSpec, group: dist.ProcessGroup, comm_type: str = "p2p") -> LayerSpec:
    """The spec with CP attention and the kept chunks' position ids; unchanged when CP is 1."""
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    if cp_size == 1:
        return spec
    return dataclasses.replace(
        spec,
        core_attention=context_parallel_attention(group, comm_type),
        position_ids=lambda s, device: local_positions(s * cp_size, cp_rank, cp_size, device),
    )
