"""Activation memory of a zero-bubble pipeline rank (zb-h1, zbv, dualpipev), walked along its own action list.

A zero-bubble rank holds a microbatch's chunk in two forms (tricorn/parallel/wgrad.py, pipeline/executor.py):

* from its ``F`` to its ``B``: the chunk's saved activations, as in any schedule (activations.py);
* from its ``B`` to its ``W``: the weight-gradient store, every deferred linear's input and output gradient
  (``weight_grad_store_bytes``). The rest of the graph is freed at ``B``.

Per layer, one microbatch of T tokens on this rank (T = seq / CP x micro batch: the whole sequence, since
under sequence parallelism the column-parallel inputs are the all-gathered ones and the row-parallel output
gradients are all-gathered too), hidden h, query width q = a d, key/value width g d, MLP width f, TP t,
element size e:

    linear   input kept         output gradient kept
    QKV      e T h              e T (q + 2 g d) / t
    wo       e T q / t          e T h
    w1       e T h              e T f (2 with SwiGLU) / t
    w2       e T f / t          e T h

and the head, on the chunk that holds it, e T h + e T V / t (its logit gradient). An MoE layer's routed experts
and router compute their weight gradients in ``B``, so its MLP rows are the shared expert's (width of the
shared expert) or none. Without SP the inputs are the same sizes (the norm outputs) and so are the gradients.
For llama3-70b at TP 4 that is 1.7 x the layer's saved activations: the store is what a deferred W costs.

The walk (``zero_bubble_activation_peak``): over the rank's compute actions, F adds the chunk's activations
(on the head's chunk with the loss part of activations.py, live until the backward starts), a B swaps them
for the store (under full recompute one group is rebuilt meanwhile; on the first stage it ends in the
embedding's backward, activations.embedding_backward_bytes), a W releases the store; a W computes
one weight gradient at a time and drops each linear's pair as soon as it is handed over (wgrad.py), so it
peaks at what is still queued plus the gradient in hand. The rank's peak is the largest of these moments -
what the schedule's real order of F, B and W holds, not a count of microbatches.

No collectives, no device work; the action lists come from tricorn.parallel.pipeline (no torch).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tricorn.config import ModelConfig
from tricorn.planning.activations import (
    ActivationProfile,
    _ids_bytes,
    activation_element_bytes,
    embedding_backward_bytes,
    loss_part_bytes,
    stage_activation_bytes,
)
from tricorn.planning.layout import Layout


@dataclass(frozen=True)
class DeferredLinear:
    """One linear whose weight gradient waits for the W, per token of a microbatch on this rank (elements)."""

    input_per_token: float
    grad_per_token: float
    weight_elements: float


def _mlp_linears(h: int, f: int, swiglu: bool, tp: int) -> list[DeferredLinear]:
    up = f * (2 if swiglu else 1)
    return [DeferredLinear(f / tp, h, h * f / tp), DeferredLinear(h, up / tp, up / tp * h)]  # w2, then w1


def layer_deferred_linears(model: ModelConfig, layer_id: int, tp: int) -> list[DeferredLinear]:
    """The deferred linears of layer ``layer_id`` in the order its B queues them (backward order)."""
    h, q, gd = model.hidden_size, model.num_attention_heads * model.head_dim, model.kv_heads * model.head_dim
    if not model.is_moe_layer(layer_id):
        mlp = _mlp_linears(h, model.ffn_size, model.swiglu, tp)
    else:  # routed experts and the router: weight gradients in B; the shared expert is a dense MLP of its width
        shared = model.moe_shared_expert_intermediate_size
        mlp = _mlp_linears(h, shared, model.swiglu, tp) if shared else []
    attention = [DeferredLinear(q / tp, h, h * q / tp), DeferredLinear(h, (q + 2 * gd) / tp, (q + 2 * gd) / tp * h)]
    return mlp + attention


def _chunk_queue(model: ModelConfig, layout: Layout, layer_ids: range, head: bool) -> list[DeferredLinear]:
    """What a chunk's B queues, in order: the head first (the backward starts there), then the layers downwards."""
    queue = []
    if head:
        h, vocab = model.hidden_size, model.padded_vocab_size(layout.tp)
        queue.append(DeferredLinear(h, vocab / layout.tp, vocab / layout.tp * h))
    kinds: dict[bool, list[DeferredLinear]] = {}  # a dense layer's linears, an MoE layer's
    for layer_id in reversed(layer_ids):
        moe = model.is_moe_layer(layer_id)
        if moe not in kinds:
            kinds[moe] = layer_deferred_linears(model, layer_id, layout.tp)
        queue += kinds[moe]
    return queue


def _tokens(model: ModelConfig, layout: Layout) -> int:
    return model.seq_length // layout.cp * layout.micro_batch


def weight_grad_store_bytes(model: ModelConfig, layout: Layout, layer_ids: range, head: bool = False) -> tuple[float, float]:
    """(store, excess) of a chunk of ``layer_ids`` (and the head): the bytes it keeps from a microbatch's B to
    its W (module docstring), and at its highest what its W holds beyond that store - the weight gradient in
    hand less the pairs already consumed (the W runs the queue in order and drops each pair once its gradient
    is handed over)."""
    e, tokens = activation_element_bytes(layout.precision), _tokens(model, layout)
    freed, excess = 0.0, 0.0
    for d in _chunk_queue(model, layout, layer_ids, head):
        excess = max(excess, e * d.weight_elements - freed)
        freed += e * tokens * (d.input_per_token + d.grad_per_token)
    return freed, excess


# A zero-bubble schedule's steady phase repeats one pattern, so a rank's peak is the same for every
# microbatch count from 3 pp on (tests/test_pipeline_zero_bubble.py walks the lists up to 6 pp): the walk
# runs that many, whatever the batch (the planner asks for thousands of microbatches).
STEADY_MICROBATCHES = 3


@functools.lru_cache(maxsize=256)
def _compute_actions(pp: int, chunks: int, m: int, schedule: str) -> tuple[tuple, ...]:
    """Each rank's F, B and W in order (the planner asks for the same pipeline many times: cached)."""
    from tricorn.parallel.pipeline.schedules import schedule_for

    return tuple(tuple(a for a in actions if a.kind.is_compute) for actions in schedule_for(pp, chunks, m, schedule))


@dataclass(frozen=True)
class ZeroBubblePeak:
    """The walk's highest moment on one rank: activations and stores (``activations``), of which the last
    stage's loss part (``loss_part``), and the (microbatch, chunk) pairs it held in each form then."""

    activations: float
    loss_part: float
    forwarded: int  # pairs between F and B
    stored: int  # pairs between B and W


def zero_bubble_activation_peak(
    model: ModelConfig, layout: Layout, stage: int, layers: int, profile: ActivationProfile, first_layer: int = 0
) -> ZeroBubblePeak:
    """The highest activation bytes of pipeline rank ``stage`` (``layers`` transformer layers from global layer
    ``first_layer`` on the loop placement; on the v placement two chunks of ``layers / 2`` placed by their
    virtual stage), walking the rank's action list (module docstring)."""
    from tricorn.parallel.pipeline.actions import V, is_first_stage, is_last_stage, virtual_stage
    from tricorn.parallel.pipeline.schedules import placement_of

    placement = placement_of(layout.schedule)
    chunks = 2 if placement == V else 1
    m = min(layout.num_microbatches, STEADY_MICROBATCHES * layout.pp)  # the same peak for any larger m
    per_chunk = layers // chunks
    ids = _ids_bytes(layout) * _tokens(model, layout)
    held, rebuilt, store, excess, loss = [], [], [], [], []
    # Both chunks hold the same layer count: one microbatch's layers (under full recompute the stored inputs,
    # and the group a B rebuilds).
    rebuild = stage_activation_bytes(model, layout, stage, per_chunk, profile, in_flight=0)
    chunk_held = stage_activation_bytes(model, layout, stage, per_chunk, profile, in_flight=1) - rebuild
    for c in range(chunks):
        head = is_last_stage(stage, c, layout.pp, chunks, placement)
        start = virtual_stage(stage, c, layout.pp, placement) * per_chunk if placement == V else first_layer
        ids_c = range(start, start + per_chunk)  # which layers: MoE layers have fewer deferred linears
        held.append(chunk_held + (ids if is_first_stage(stage, c) else 0.0))
        # Under full recompute one group is rebuilt during the B; on the first stage the B ends in the embedding's.
        rebuilt.append(max(rebuild, embedding_backward_bytes(model, layout) if is_first_stage(stage, c) else 0.0))
        kept, extra = weight_grad_store_bytes(model, layout, ids_c, head)
        store.append(kept)
        excess.append(extra)
        loss.append(loss_part_bytes(model, layout, layout.head_stage, profile) if head else 0.0)
    return peak_of(_rank_moments(layout.pp, chunks, m, layout.schedule, stage), ChunkBytes(held, rebuilt, store, excess, loss))


@dataclass(frozen=True)
class ChunkBytes:
    """Per chunk of a rank: activations from F to B, the B's own extra (a rebuilt group, the embedding's
    gradient), the store from B to W, the W's extra (``weight_grad_store_bytes``), the loss part at its F."""

    held: list[float]
    rebuilt: list[float]
    store: list[float]
    excess: list[float]
    loss: list[float]


Moment = tuple[tuple[int, ...], tuple[int, ...], str, int]  # pairs per chunk between F-B, B-W; what else; chunk


def moments(actions, chunks: int) -> tuple[Moment, ...]:
    """The distinct moments of one rank's compute actions that can be its peak, in order: after each F (with
    the loss part on the head's chunk), after each B (with what it rebuilt), before each W's release (with the
    weight gradient in hand). Each is the count of (microbatch, chunk) pairs of every chunk in either form."""
    from tricorn.parallel.pipeline.actions import BACKWARD, FORWARD

    forwarded, stored = [0] * chunks, [0] * chunks
    out: dict[Moment, None] = {}
    for a in actions:
        c = a.chunk
        if a.kind is FORWARD:
            forwarded[c] += 1
            out[(tuple(forwarded), tuple(stored), "loss", c)] = None
        elif a.kind is BACKWARD:
            forwarded[c], stored[c] = forwarded[c] - 1, stored[c] + 1
            out[(tuple(forwarded), tuple(stored), "rebuilt", c)] = None
        else:
            out[(tuple(forwarded), tuple(stored), "excess", c)] = None
            stored[c] -= 1
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def _rank_moments(pp: int, chunks: int, m: int, schedule: str, rank: int) -> tuple[Moment, ...]:
    return moments(_compute_actions(pp, chunks, m, schedule)[rank], chunks)


def peak_of(points: tuple[Moment, ...], b: ChunkBytes) -> ZeroBubblePeak:
    """The highest of ``points`` for the chunks' bytes ``b`` (the first one, of equals)."""
    best = ZeroBubblePeak(0.0, 0.0, 0, 0)
    for forwarded, stored, extra, c in points:
        state = sum(n * x for n, x in zip(forwarded, b.held)) + sum(n * x for n, x in zip(stored, b.store))
        part = getattr(b, extra)[c]
        if state + part > best.activations:
            best = ZeroBubblePeak(state + part, part if extra == "loss" else 0.0, sum(forwarded), sum(stored))
    return best


def walk_peak(actions, b: ChunkBytes) -> ZeroBubblePeak:
    """The highest moment along one rank's compute actions (module docstring)."""
    return peak_of(moments(actions, len(b.held)), b)
