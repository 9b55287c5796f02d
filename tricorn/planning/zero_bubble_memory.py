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
    for layer_id in reversed(layer_ids):
        queue += layer_deferred_linears(model, layer_id, layout.tp)
    return queue


def _tokens(model: ModelConfig, layout: Layout) -> int:
    return model.seq_length // layout.cp * layout.micro_batch


def weight_grad_store_bytes(model: ModelConfig, layout: Layout, layer_ids: range, head: bool = False) -> float:
    """Bytes a chunk of ``layer_ids`` (and the head) keeps from a microbatch's B to its W (module docstring)."""
    e, tokens = activation_element_bytes(layout.precision), _tokens(model, layout)
    return e * tokens * sum(d.input_per_token + d.grad_per_token for d in _chunk_queue(model, layout, layer_ids, head))


def weight_pass_excess_bytes(model: ModelConfig, layout: Layout, layer_ids: range, head: bool = False) -> float:
    """At its highest, what a chunk's W holds beyond its store: the weight gradient in hand, less the pairs
    already consumed (the W runs the queue in order and drops each pair once its gradient is handed over)."""
    e, tokens = activation_element_bytes(layout.precision), _tokens(model, layout)
    freed, excess = 0.0, 0.0
    for d in _chunk_queue(model, layout, layer_ids, head):
        excess = max(excess, e * d.weight_elements - freed)
        freed += e * tokens * (d.input_per_token + d.grad_per_token)
    return excess


@functools.lru_cache(maxsize=64)
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
    from tricorn.parallel.pipeline.actions import (
        BACKWARD,
        FORWARD,
        WEIGHT,
        V,
        is_first_stage,
        is_last_stage,
        virtual_stage,
    )
    from tricorn.parallel.pipeline.schedules import placement_of

    placement = placement_of(layout.schedule)
    chunks = 2 if placement == V else 1
    actions = _compute_actions(layout.pp, chunks, layout.num_microbatches, layout.schedule)[stage]
    per_chunk = layers // chunks
    ids = _ids_bytes(layout) * _tokens(model, layout)
    held, rebuilt, store, excess, loss = [], [], [], [], []
    for c in range(chunks):
        head = is_last_stage(stage, c, layout.pp, chunks, placement)
        start = virtual_stage(stage, c, layout.pp, placement) * per_chunk if placement == V else first_layer
        ids_c = range(start, start + per_chunk)  # which layers: MoE layers have fewer deferred linears
        rebuild = stage_activation_bytes(model, layout, stage, per_chunk, profile, in_flight=0)
        held.append(stage_activation_bytes(model, layout, stage, per_chunk, profile, in_flight=1) - rebuild)
        held[-1] += ids if is_first_stage(stage, c) else 0.0
        # Under full recompute one group is rebuilt during the B; on the first stage the B ends in the embedding's.
        rebuilt.append(max(rebuild, embedding_backward_bytes(model, layout) if is_first_stage(stage, c) else 0.0))
        store.append(weight_grad_store_bytes(model, layout, ids_c, head))
        excess.append(weight_pass_excess_bytes(model, layout, ids_c, head))
        loss.append(loss_part_bytes(model, layout, layout.head_stage, profile) if head else 0.0)
    state, forwarded, stored = 0.0, 0, 0
    best = ZeroBubblePeak(0.0, 0.0, 0, 0)

    def moment(total: float, loss_part: float = 0.0) -> None:
        nonlocal best
        if total > best.activations:
            best = ZeroBubblePeak(total, loss_part, forwarded, stored)

    for a in actions:
        c = a.chunk
        if a.kind is FORWARD:
            forwarded += 1
            state += held[c]
            moment(state + loss[c], loss[c])
        elif a.kind is BACKWARD:
            forwarded, stored = forwarded - 1, stored + 1
            state += store[c] - held[c]
            moment(state + rebuilt[c])
        elif a.kind is WEIGHT:
            moment(state + excess[c])
            stored -= 1
            state -= store[c]
    return best
