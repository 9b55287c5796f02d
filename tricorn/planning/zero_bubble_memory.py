"""Activation memory of a zero-bubble pipeline rank (zb-h1, zbv, dualpipev), walked along its own action list.

A zero-bubble rank holds a microbatch's chunk in two forms (tricorn/parallel/wgrad.py, pipeline/executor.py):

* from its ``F`` to its ``B``: the chunk's saved activations, as in any schedule (activations.py);
* from its ``B`` to its ``W``: the weight-gradient store, what every deferred weight gradient's thunk holds
  (``weight_grad_store_bytes``). The rest of the graph is freed at ``B``.

Per layer, one microbatch of T tokens on this rank (T = seq / CP x micro batch: the whole sequence, since
under sequence parallelism the column-parallel inputs are the all-gathered ones and the row-parallel output
gradients are all-gathered too), hidden h, query width q = a d, key/value width g d, MLP width f, TP t,
element size e:

    deferred            input kept          output gradient kept
    QKV                 e T h               e T (q + 2 g d) / t
    wo                  e T q / t           e T h
    w1                  e T h               e T f (2 with SwiGLU) / t
    w2                  e T f / t           e T h
    each of two norms   4 T h / t under SP (T h without): the fp32 product of output gradient and normalised input
    q and k norms       4 T (q + g d) / t (--qk-layernorm: the same product over this rank's heads)

and the head, on the chunk that holds it, e T h + e T V / t (its logit gradient), with the final norm. An MoE
layer's MLP rows are the shared expert's (a dense MLP of its width) and the routed experts' loop of GEMMs: w1 and
w2 as above over the layer's C token copies (activations.moe_copies; f the expert width / ETP), for the rank's
E/EP experts; its router computes its weight gradient in ``B``. Without SP the inputs are the same sizes (the
norm outputs) and so are the gradients. Where torch's fused kernels run instead (``norms_defer``,
``experts_defer``: eager CUDA norms, CUDA bf16 experts' grouped matmul) those weight gradients are computed in
``B`` and their rows drop out. For llama3-70b at TP 4 the linears' rows are 1.7 x the layer's saved activations
(482 MB against 281 MB per microbatch) and the CPU's norms add 67 MB: the store is what a deferred W costs.

The walk (``zero_bubble_activation_peak``): over the rank's compute actions, F adds the chunk's activations
(on the head's chunk with the loss part of activations.py, live until the backward starts), a B swaps them
for the store (under full recompute one group is rebuilt meanwhile; a layer's backward transient - an MoE
layer's workspace, activations.moe_backward_workspace, which with deferred experts keeps the SwiGLU output their W
needs and builds no stacked weight gradient - rides on it; on the first stage it ends in the embedding's
backward, activations.embedding_backward_bytes), a W releases the store; a W computes
one weight gradient at a time and drops each thunk's tensors as soon as it is handed over (wgrad.py), so it
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
    moe_copies,
)
from tricorn.planning.layout import Layout
from tricorn.planning.stage_activations import stage_activation_bytes


@dataclass(frozen=True)
class Deferred:
    """One weight gradient that waits for the W: the bytes its B queues for one microbatch, and the elements of the
    gradient its W computes."""

    held: float
    weight_elements: float


def _linear(e: float, tokens: float, inp: float, grad: float, weight: float) -> Deferred:
    """A linear (or a loop of expert GEMMs) of ``tokens`` rows: its input and output gradient, e bytes each."""
    return Deferred(e * tokens * (inp + grad), weight)


def _mlp(e: float, tokens: float, h: int, f: int, swiglu: bool, tp: int) -> list[Deferred]:
    up = f * (2 if swiglu else 1)
    return [_linear(e, tokens, f / tp, h, h * f / tp), _linear(e, tokens, h, up / tp, up / tp * h)]  # w2, then w1


def norms_defer(layout: Layout) -> bool:
    """The norms run lean._Norm, whose weight gradient can wait for the W: everywhere but eager CUDA (torch's fused
    kernels compute theirs in B) and compiled layers (a traced backward calls no hook)."""
    return layout.device != "cuda" and not layout.compiled


def experts_defer(layout: Layout) -> bool:
    """The routed experts run the loop of GEMMs (model/moe.py), whose weight gradients can wait for the W, unless
    torch's grouped matmul runs them: on CUDA in bf16 (taken to be a GPU that has its kernel: moe.grouped_mm_fast)."""
    return not (layout.device == "cuda" and layout.precision == "bf16") and not layout.compiled


def _norm(model: ModelConfig, layout: Layout, tokens: float) -> Deferred:
    """A norm: the fp32 product of its output gradient and normalised input (lean._Norm), over its tokens (under
    SP the sequence shard)."""
    shards = layout.tp if layout.sequence_parallel else 1
    return Deferred(4 * tokens / shards * model.hidden_size, model.hidden_size)


def _routed_experts(model: ModelConfig, layout: Layout, e: float, tokens: float) -> list[Deferred]:
    """The loop of expert GEMMs of one MoE layer: w2 then w1 over the layer's token copies (those of the rank's
    sequence shard under SP, of every shard at expert TP: as moe_backward_workspace), the rank's E/EP experts."""
    shards = layout.tp if layout.sequence_parallel else 1
    copies = moe_copies(model, int(tokens) // shards) * (shards if layout.etp > 1 else 1)
    per_expert = _mlp(e, copies, model.hidden_size, model.moe_ffn_size, model.swiglu, layout.etp)
    local = model.num_experts // layout.ep
    return [Deferred(d.held, d.weight_elements * local) for d in per_expert]


def layer_deferred(model: ModelConfig, layout: Layout, layer_id: int) -> list[Deferred]:
    """The deferred weight gradients of layer ``layer_id`` in the order its B queues them (backward order)."""
    e, tokens, tp = activation_element_bytes(layout.precision), _tokens(model, layout), layout.tp
    h, q, gd = model.hidden_size, model.num_attention_heads * model.head_dim, model.kv_heads * model.head_dim
    if not model.is_moe_layer(layer_id):
        mlp = _mlp(e, tokens, h, model.ffn_size, model.swiglu, tp)
    else:  # the router's weight gradient is computed in B; the shared expert is a dense MLP of its width
        shared = model.moe_shared_expert_intermediate_size
        mlp = _mlp(e, tokens, h, shared, model.swiglu, tp) if shared else []
        mlp += _routed_experts(model, layout, e, tokens) if experts_defer(layout) else []
    wo, qkv = _linear(e, tokens, q / tp, h, h * q / tp), _linear(e, tokens, h, (q + 2 * gd) / tp, (q + 2 * gd) / tp * h)
    norm = [_norm(model, layout, tokens)] if norms_defer(layout) else []
    # --qk-layernorm: the k and q per-head norms (this rank's heads, the whole sequence), between wo and QKV
    qk = [Deferred(4 * tokens * heads / tp * model.head_dim, model.head_dim) for heads in (model.kv_heads, q // model.head_dim)]
    return mlp + norm + [wo] + (qk if model.qk_layernorm and norms_defer(layout) else []) + [qkv] + norm


def _chunk_queue(model: ModelConfig, layout: Layout, layer_ids: range, head: bool) -> list[Deferred]:
    """What a chunk's B queues, in order: the head and the final norm first (the backward starts there), then the
    layers downwards."""
    queue = []
    if head:
        h, vocab = model.hidden_size, model.padded_vocab_size(layout.tp)
        e, tokens = activation_element_bytes(layout.precision), _tokens(model, layout)
        queue.append(_linear(e, tokens, h, vocab / layout.tp, vocab / layout.tp * h))
        queue += [_norm(model, layout, tokens)] if norms_defer(layout) else []
    kinds: dict[bool, list[Deferred]] = {}  # a dense layer's, an MoE layer's
    for layer_id in reversed(layer_ids):
        moe = model.is_moe_layer(layer_id)
        if moe not in kinds:
            kinds[moe] = layer_deferred(model, layout, layer_id)
        queue += kinds[moe]
    return queue


def _tokens(model: ModelConfig, layout: Layout) -> int:
    return model.seq_length // layout.cp * layout.micro_batch


def weight_grad_store_bytes(model: ModelConfig, layout: Layout, layer_ids: range, head: bool = False) -> tuple[float, float]:
    """(store, excess) of a chunk of ``layer_ids`` (and the head): the bytes it keeps from a microbatch's B to
    its W (module docstring), and at its highest what its W holds beyond that store - the weight gradient in
    hand less the pairs already consumed (the W runs the queue in order and drops each pair once its gradient
    is handed over)."""
    e = activation_element_bytes(layout.precision)
    freed, excess = 0.0, 0.0
    for d in _chunk_queue(model, layout, layer_ids, head):
        excess = max(excess, e * d.weight_elements - freed)
        freed += d.held
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
    model: ModelConfig,
    layout: Layout,
    stage: int,
    layers: int,
    profile: ActivationProfile,
    first_layer: int = 0,
    backward_transient: float = 0.0,
) -> ZeroBubblePeak:
    """The highest activation bytes of pipeline rank ``stage`` (``layers`` transformer layers from global layer
    ``first_layer`` on the loop placement; on the v placement two chunks of ``layers / 2`` placed by their
    virtual stage), walking the rank's action list (module docstring). ``backward_transient``: what a layer's
    backward holds beyond its saved tensors (an MoE layer's workspace, CP's buffers), counted at each B beside
    the stores held then."""
    from tricorn.parallel.pipeline.actions import V, is_first_stage, is_last_stage, virtual_stage
    from tricorn.parallel.pipeline.schedules import placement_of

    placement = placement_of(layout.schedule)
    chunks = 2 if placement == V else 1
    m = min(layout.num_microbatches, STEADY_MICROBATCHES * layout.pp)  # the same peak for any larger m
    per_chunk = layers // chunks
    ids = _ids_bytes(layout) * _tokens(model, layout)
    held, rebuilt, store, excess, loss = [], [], [], [], []
    for c in range(chunks):
        # One microbatch's layers from F to B (under full recompute the stored inputs; with offload what stays on
        # the device, where the chunk's received input stays); a B rebuilds a group, and brings offloaded units back.
        received = 0 if is_first_stage(stage, c) else 1
        rebuild = stage_activation_bytes(model, layout, stage, per_chunk, profile, 0, chunks=1, received=received)
        chunk_held = stage_activation_bytes(model, layout, stage, per_chunk, profile, 1, chunks=1, received=received) - rebuild
        head = is_last_stage(stage, c, layout.pp, chunks, placement)
        start = virtual_stage(stage, c, layout.pp, placement) * per_chunk if placement == V else first_layer
        ids_c = range(start, start + per_chunk)  # which layers: MoE layers have fewer deferred linears
        held.append(chunk_held + (ids if is_first_stage(stage, c) else 0.0))
        # Under full recompute one group is rebuilt during the B (with a layer's transient); on the first stage
        # the B ends in the embedding's.
        embedding = embedding_backward_bytes(model, layout) if is_first_stage(stage, c) else 0.0
        rebuilt.append(max(rebuild + backward_transient, embedding))
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
