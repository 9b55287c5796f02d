"""Context parallelism's traffic and transient buffers per ``--cp-comm-type`` (tricorn/parallel/context/).

Per rank, per transformer layer and microbatch, in elements of the activation dtype (the ring's dK/dV
accumulator travels in fp32: ``backward_fp32``). With s tokens per sample, CP ranks, TP ranks, micro batch b,
query heads a and key/value heads g of dimension d, a rank's share of one K (or V) is N = b (s/CP) (g/TP) d and
of q (or the output) Q = b (s/CP) (a/TP) d:

    p2p        forward   CP-1 messages of the K/V pair: 2 (CP-1) N, the minimum for every rank to see all K/V
               backward  K/V again, 2 (CP-1) N, plus CP-1 messages of the fp32 dK/dV accumulator, 2 (CP-1) N
               (the minimum a ring reduce can: each pair's home keeps its own block's part)
    allgather  forward   all-gather of k and v: 2 (CP-1) N (bus bytes of a ring all-gather)
               backward  reduce-scatter of dk and dv: 2 (CP-1) N; nothing overlaps either
    a2a        forward   all-to-all of q, k, v and the output, (CP-1)/CP of each: (CP-1)/CP (2Q + 2 R N), where R
               is the replication of key/value heads CP does not divide (ulysses.kv_replicas); the minimum
               has R = 1
               backward  the same four in reverse (dout in; dq, dk, dv out)

Transient buffers of one layer's attention, beyond what it saves for backward (planning/activations.py), at the
larger of its forward and backward: p2p forward two K/V pairs in flight (the stacked pair and the one arriving)
and the fp32 output / lse accumulators, backward the two pairs, the fp32 dq and three fp32 dK/dV pairs;
allgather the gathered K/V in rank order while it is put in sequence order, and in backward the fp32 dk / dv
of the whole sequence with their reduce-scatter inputs; a2a one send and one receive buffer of the largest
tensor it moves, in backward for dq, dk and dv at once.

Documents and windows (tricorn/model/masking.py) add the masked op's own buffers (``masked_transient_bytes``):
forward its output and lse before they are merged or returned, backward its dq, dk and dv in the compute dtype and,
where its blocks share rows or keys (window tiles, a CP step's two query chunks), fp32 accumulators of the same
sizes; the keys are the whole sequence's under allgather. Counted from the code's allocations, not measured (a
fake-tensor simulation runs the op's shapes only). No collectives, no device work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tricorn.config import CP_COMM_TYPES, ModelConfig  # noqa: F401 - re-exported for the planner
from tricorn.planning.activations import activation_element_bytes
from tricorn.planning.layout import Layout


@dataclass(frozen=True)
class CPTraffic:
    """Elements one rank sends per layer and microbatch (``backward_fp32``: the part sent in fp32)."""

    forward: float = 0.0
    backward: float = 0.0
    backward_fp32: float = 0.0
    minimum_forward: float = 0.0
    minimum_backward: float = 0.0

    def bytes(self, e: float) -> float:
        return (self.forward + self.backward - self.backward_fp32) * e + 4 * self.backward_fp32

    def minimum_bytes(self, e: float) -> float:
        return (self.minimum_forward + self.minimum_backward) * e


def _shares(model: ModelConfig, layout: Layout) -> tuple[float, float, int]:
    """(N, Q, R): a rank's K elements, its q elements, the a2a key/value replication."""
    tokens = layout.micro_batch * model.seq_length / layout.cp
    kv_local = max(model.kv_heads // layout.tp, 1)
    n = tokens * kv_local * model.head_dim
    q = tokens * model.num_attention_heads / layout.tp * model.head_dim
    return n, q, layout.cp // math.gcd(kv_local, layout.cp)


def cp_traffic(model: ModelConfig, layout: Layout) -> CPTraffic:
    cp = layout.cp
    if cp == 1:
        return CPTraffic()
    n, q, reps = _shares(model, layout)
    ring = 2 * (cp - 1) * n
    if layout.cp_comm_type == "a2a":
        part = (cp - 1) / cp
        moved = part * (2 * q + 2 * reps * n)
        least = part * (2 * q + 2 * n)
        return CPTraffic(moved, moved, 0.0, least, least)
    if layout.cp_comm_type == "allgather":
        return CPTraffic(ring, ring, 0.0, ring, ring)
    return CPTraffic(ring, 2 * ring, ring, ring, 2 * ring)


def cp_transient_bytes(model: ModelConfig, layout: Layout) -> float:
    """The largest transient buffers one layer's CP attention holds beyond its saved tensors (module docstring)."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    e = activation_element_bytes(layout.precision)
    n, q, reps = _shares(model, layout)
    lse = 4 * q / model.head_dim
    if layout.cp_comm_type == "a2a":
        largest = max(q, reps * n)
        return max(2 * largest * e, 2 * (q + 2 * reps * n) * e)
    if layout.cp_comm_type == "allgather":
        forward = 2 * cp * n * e
        backward = 2 * cp * n * (4 + e)
        return max(forward, backward)
    pair = 2 * n
    forward = 2 * pair * e + 4 * q + lse
    backward = 2 * pair * e + 4 * q + 3 * 4 * pair
    return max(forward, backward)


def masked_transient_bytes(model: ModelConfig, layout: Layout) -> float:
    """The masked attention op's buffers beyond its saved tensors (module docstring); 0 without documents or window."""
    if not (layout.document_bounds or model.attention_window is not None):
        return 0.0
    e = activation_element_bytes(layout.precision)
    n, q, reps = _shares(model, layout)
    if layout.cp > 1 and layout.cp_comm_type == "allgather":
        n *= layout.cp  # the gathered keys
    elif layout.cp > 1 and layout.cp_comm_type == "a2a":
        n *= reps  # the whole sequence of H/CP heads: q's bytes, K/V with its replication
    forward = q * e + 4 * q / model.head_dim
    backward = (q + 2 * n) * (e + 4)
    return max(forward, backward)
