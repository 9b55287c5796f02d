"""Per-rank memory of a training layout: model state, activations, logits, buffers; the worst pipeline stage.

Model state (bytes per parameter on a rank, before sharding):

    precision   params  grads (main_grad)        master  AdamW exp_avg + exp_avg_sq
    bf16/fp16   2       4 (fp32; 2 with --grad-reduce-in-bf16)  4       8
    fp32        4       4 (param.grad)           0       8     (the fp32 params are the master copy)

so bf16 is Megatron's 18 bytes/param, and 6 + 12/d with ``--use-distributed-optimizer`` over d data-parallel
ranks. ZeRO stage 1 (the distributed optimizer) shards master + optimizer state over DP x CP, stage 2 the
gradients too, stage 3 the parameters too. TP and PP split the parameters as the layers do: column-parallel
weights and biases, row-parallel weights and the vocabulary are divided by TP; norms and row-parallel biases are
replicated on every TP rank; the embedding lives on the first stage, the head on the last, and a tied head is
a second copy on the last stage when PP > 1 (planning/params.py counts them).

Activations (tricorn/planning/activations.py, whose docstring has the formulas): per layer x layers on the
stage x microbatches in flight, the embedding / head / loss part, and the transient logits. The zero-bubble
schedules instead walk the rank's action list (planning/zero_bubble_memory.py): saved activations from F to B,
the deferred linears' weight-gradient store from B to W.
Buffers: pipeline send/recv tensors, ZeRO-3's gathered layer (and its prefetch). Stages 0-1 reduce gradients in
place (no bucket beyond main_grad, whatever --ddp-bucket-size is). ZeRO-2/3 have a second candidate peak at the
first layer's backward, with two full-size gradient buckets alive (``zero_backward_peak``); the larger one counts.
FP8 (planning/fp8_terms.py): the FP8 weight caches, saved FP8 weights and scaling state in their own category,
and the change of the saved activations (FP8 linear inputs) added to the activations.
Overhead: CUDA context, cuBLAS/NCCL workspaces (a fixed ``CUDA_OVERHEAD_BYTES`` on GPU, 0 on CPU).

No collectives, no device work.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Optional

from tricorn.config import Config, ModelConfig
from tricorn.parallel.buckets import plan_buckets
from tricorn.parallel.pipeline.actions import ZERO_BUBBLE
from tricorn.planning.activations import (  # noqa: F401 - re-exported: the estimator's activation API lives here too
    KORTHIKANTI,
    TRICORN,
    ActivationProfile,
    activation_element_bytes,
    embedding_backward_bytes,
    embedding_logits_bytes,
    korthikanti_layer_bytes,
    layer_activation_bytes,
    layout_layer_bytes,
    loss_part_bytes,
    microbatches_in_flight,
    moe_backward_workspace,
    other_saved_bytes,
)
from tricorn.planning.context_comm import cp_transient_bytes, masked_transient_bytes
from tricorn.planning.fp8_terms import fp8_terms
from tricorn.planning.layout import Layout
from tricorn.planning.params import (  # noqa: F401 - active_params, expert_params, total_params re-exported
    active_params,
    expert_params,
    fp8_primary_elements,
    fp8_weight_mask,
    layer_params_per_rank,
    stage_expert_params_per_rank,
    stage_layer_counts,
    stage_param_parts,
    stage_params_per_rank,
    total_params,
)
from tricorn.planning.stage_activations import (  # noqa: F401 - stage_activation_bytes re-exported
    stage_activation_bytes,
    stage_units,
)
from tricorn.planning.zero_bubble_memory import experts_defer, zero_bubble_activation_peak

GiB = 1024**3
CUDA_OVERHEAD_BYTES = 1 * GiB
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq in fp32
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # the precision-aware optimizer's stored dtypes
# --optimizer-cpu-offload, per owned element in host memory besides the master (a copy in its dtype, even where
# the parameters would be their own master) and the moments (parallel/shard_state.py): the fp32 gradient the step
# reads; on CUDA also the pinned staging copy, in the parameters' dtype, the new values go back to the device from.
OFFLOADED_GRAD_BYTES = 4
FP8_PARAM_BYTES = 1  # --fp8-param-gather: an FP8 primary weight's element


# ---------------------------------------------------------------- model state


@dataclass(frozen=True)
class ModelState:
    params: float
    grads: float
    master_params: float
    optimizer_state: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.master_params + self.optimizer_state

    def __add__(self, other: ModelState) -> ModelState:
        return ModelState(
            self.params + other.params,
            self.grads + other.grads,
            self.master_params + other.master_params,
            self.optimizer_state + other.optimizer_state,
        )


def bytes_per_param(precision: str, grads_16bit: bool = False) -> tuple[int, int, int, int]:
    """(params, grads, master, optimizer) bytes per parameter for ``precision`` in bf16 | fp16 | fp32."""
    if precision == "fp32":
        return 4, 4, 0, ADAM_STATE_BYTES
    if precision in ("bf16", "fp16"):
        return 2, 2 if grads_16bit else 4, 4, ADAM_STATE_BYTES
    raise ValueError(f"unknown precision '{precision}': use bf16, fp16 or fp32")


def master_bytes_per_param(layout: Layout) -> int:
    """Bytes of the master copy per parameter (--main-params-dtype): none for fp32 parameters (they are their own
    master) or when the master's dtype is the 16-bit parameters' own (--bf16 with bf16 masters: the parameters are
    the master, stochastically rounded); else the master's dtype (4 for fp32, 2 for an fp16 copy beside bf16)."""
    if layout.precision == "fp32" or layout.main_params_dtype == layout.precision:
        return 0
    return DTYPE_BYTES[layout.main_params_dtype]


def optimizer_bytes_per_param(layout: Layout) -> int:
    """AdamW's moments per parameter in their stored dtypes (--exp-avg-dtype, --exp-avg-sq-dtype): 8 in fp32, 4 in
    bf16 or fp16 (fp16 adds one fp32 bound per parameter tensor, not per element: nothing here)."""
    return DTYPE_BYTES[layout.exp_avg_dtype] + DTYPE_BYTES[layout.exp_avg_sq_dtype]


def layout_bytes_per_param(layout: Layout) -> tuple[int, int, int, int]:
    """(params, grads, master, optimizer) bytes per parameter of ``layout``: ``bytes_per_param`` with the
    precision-aware optimizer's dtypes (an FP8 primary weight's parameter bytes are ``FP8_PARAM_BYTES``)."""
    p_b, g_b, _, _ = bytes_per_param(layout.precision, layout.grads_16bit)
    return p_b, g_b, master_bytes_per_param(layout), optimizer_bytes_per_param(layout)


def model_state_bytes(
    num_params: float,
    *,
    param_bytes: float,
    grad_bytes: float,
    master_bytes: float,
    optimizer_bytes: float = ADAM_STATE_BYTES,
    dp: int = 1,
    zero_stage: int = 0,
) -> ModelState:
    """Bytes of ``num_params`` parameters' state on one rank; ZeRO ``zero_stage`` 0-3 shards over ``dp`` ranks."""
    return ModelState(
        params=num_params * param_bytes / (dp if zero_stage >= 3 else 1),
        grads=num_params * grad_bytes / (dp if zero_stage >= 2 else 1),
        master_params=num_params * master_bytes / (dp if zero_stage >= 1 else 1),
        optimizer_state=num_params * optimizer_bytes / (dp if zero_stage >= 1 else 1),
    )


def layer_param_bytes(model: ModelConfig, layout: Layout) -> float:
    """Bytes of one layer's parameters on a TP rank as stored (ZeRO-3 gathers these): 16-bit (or fp32), the FP8
    primary weights at FP8_PARAM_BYTES under --fp8-param-gather."""
    p_b = bytes_per_param(layout.precision)[0]
    fp8 = fp8_primary_elements(model, layout, 1)
    return (layer_params_per_rank(model, layout.tp) - fp8) * p_b + fp8 * FP8_PARAM_BYTES


# ---------------------------------------------------------------- the estimate


@dataclass
class MemoryEstimate:
    """Bytes on the worst rank (the pipeline stage with the largest total), by category."""

    stage: int
    layers_on_stage: int
    params_on_rank: int
    params_bytes: float
    grads_bytes: float
    master_params_bytes: float
    optimizer_state_bytes: float
    activation_bytes: float
    embedding_logits_bytes: float
    buffer_bytes: float
    overhead_bytes: float
    microbatches_in_flight: float
    # Per microbatch, what memory_report.json's probe measures: one layer (before full recompute's rebuild),
    # and the embedding / final norm / head / loss outside the layers (without the transient logits).
    activation_bytes_per_layer: float = 0.0
    activation_bytes_other: float = 0.0
    per_stage_total_bytes: list[float] = field(default_factory=list)
    fp8_bytes: float = 0.0  # FP8 weight caches (or saved FP8 weights under ZeRO-3) and scaling state
    grad_buffer_bytes: float = 0.0  # of buffer_bytes: transient gradient buckets (``zero_backward_peak``)
    param_buffer_bytes: float = 0.0  # of buffer_bytes: ZeRO-3's gathered layers
    host_bytes: float = 0.0  # host memory, not in the total: the offloaded optimizer state and activations

    def peak_by_kind(self) -> dict[str, float]:
        """The peak split as `tricorn simulate` measures it: buffers go to what they hold (Buffers)."""
        kinds = {
            "params_bytes": self.params_bytes + self.param_buffer_bytes,
            "grads_bytes": self.grads_bytes + self.grad_buffer_bytes,
            "master_params_bytes": self.master_params_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
        }
        return {"peak_bytes": self.total_bytes, **kinds, "activations_bytes": self.total_bytes - sum(kinds.values())}

    @property
    def model_state_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.master_params_bytes + self.optimizer_state_bytes

    @property
    def total_bytes(self) -> float:
        return (
            self.model_state_bytes
            + self.activation_bytes
            + self.embedding_logits_bytes
            + self.buffer_bytes
            + self.overhead_bytes
            + self.fp8_bytes
        )

    def to_dict(self) -> dict:
        out = asdict(self)
        out["model_state_bytes"] = self.model_state_bytes
        out["total_bytes"] = self.total_bytes
        return out


@dataclass(frozen=True)
class Buffers:
    """Transient buffers at the peak, by what they hold."""

    pipeline: float = 0.0  # p2p send/recv activations (counted with the activations)
    gradients: float = 0.0  # DP gradient buckets beyond the persistent gradients (counted with the gradients)
    parameters: float = 0.0  # ZeRO-3's gathered layers (counted with the parameters)

    @property
    def total(self) -> float:
        return self.pipeline + self.gradients + self.parameters


def _pipeline_buffer_bytes(model: ModelConfig, layout: Layout) -> float:
    """PP only, messages of [s / CP (/ TP under SP), b, h]: a received activation and a gradient to send, and
    the receive the next compute needs, posted one compute early (pipeline/p2p.py). A sent stage output keeps
    no data once its send is done (p2p.free_data), so the outputs of the microbatches in flight count nothing."""
    if layout.pp == 1:
        return 0.0
    tokens = model.seq_length // layout.cp * layout.micro_batch
    return (
        3
        * activation_element_bytes(layout.precision)
        * tokens
        * model.hidden_size
        / (layout.tp if layout.sequence_parallel else 1)
    )


_BUCKETS: dict[tuple, list[int]] = {}  # zero2_buckets of recent layouts (the planner asks again for each feature set)


def zero2_buckets(model: ModelConfig, layout: Layout, stage: int, layers: int) -> list[int]:
    """ZeRO-2's gradient buckets on a rank of ``stage``, in backward order: the code's own plan
    (parallel/buckets.py) over the stage's parameters, each virtual-pipeline chunk its own buffers."""
    # The buckets are elements of parameters: what the activations and the optimizer's dtypes do leaves them alone.
    same = dataclasses.replace(layout, offload_layers=0, optimizer_offload=False, exp_avg_dtype="fp32", exp_avg_sq_dtype="fp32")
    key = (repr(model), same, stage, layers)
    if key not in _BUCKETS:
        if len(_BUCKETS) > 1024:
            _BUCKETS.clear()
        _BUCKETS[key] = _plan_zero2_buckets(model, layout, stage, layers)
    return _BUCKETS[key]


def _plan_zero2_buckets(model: ModelConfig, layout: Layout, stage: int, layers: int) -> list[int]:
    vpp = layout.vpp if layout.pp > 1 else 1
    head, body, tail = stage_param_parts(model, layout, stage, layers)
    # (elements, kept apart, FP8 primary weight): FP8 weights are planned in buckets of their own (data_parallel.py)
    mask = fp8_weight_mask(model) if layout.fp8_param_gather else []
    body3 = [[(n, apart, i < len(mask) and mask[i]) for i, (n, apart) in enumerate(layer)] for layer in body]
    head3, tail3 = [(n, a, False) for n, a in head], [(n, a, False) for n, a in tail]
    buckets: list[int] = []
    for c in reversed(range(vpp)):  # layers split evenly over the chunks; backward runs the last chunk first
        chunk = [p for layer in body3[layers * c // vpp : layers * (c + 1) // vpp] for p in layer]
        chunk = (head3 if c == 0 else []) + chunk + (tail3 if c == vpp - 1 else [])
        size = layout.bucket_elements(sum(n for n, _, _ in chunk))  # what DataParallel picks for the chunk
        plan = plan_buckets(chunk, lambda s: s[0], size, lambda a, b: a[1] or b[1], group=lambda s: s[2])
        buckets += [sum(n for n, _, _ in b) for b in plan]
    return buckets


def zero_transient_grad_bytes(
    model: ModelConfig, layout: Layout, stage: int, layers: int, at_backward_start: bool = False
) -> float:
    """ZeRO-2/3's full-size gradient buckets alive at once (parallel/data_parallel.py): each bucket is
    reduce-scattered as soon as its last gradient arrives and released when that completes, one reduction in
    flight - so two buckets, the one filling and the one reducing. ZeRO-3 has one bucket per layer; ZeRO-2 the
    code's plan of --ddp-bucket-size buckets, where a parameter never spans two, so the vocabulary-sized
    embedding and head are buckets of their own size. At the backward's start the first two buckets are alive;
    later, the worst neighbouring pair (an upper bound). Stages 0-1 reduce in place: nothing."""
    if layout.zero_stage < 2 or layout.dp * layout.cp == 1:
        return 0.0
    g_bytes = bytes_per_param(layout.precision, layout.grads_16bit)[1]
    if layout.zero_stage >= 3:
        layer = layer_params_per_rank(model, layout.tp)
        if layout.fp8_param_gather:
            # Two buckets per unit, its FP8 weights' and the rest's (norms, biases): a layer's FP8 bucket completes
            # and starts reducing before its rest does, so the one reduction in flight is the previous unit's
            # small rest bucket while the next layer's two fill: one layer and two rests.
            rest = layer - fp8_primary_elements(model, layout, 1)
            return (layer + 2 * rest) * g_bytes
        return 2 * layer * g_bytes
    buckets = zero2_buckets(model, layout, stage, layers)
    pairs = [a + b for a, b in zip(buckets, buckets[1:])] or buckets
    return (pairs[0] if at_backward_start else max(pairs)) * g_bytes


def _forward_peak_buffers(model: ModelConfig, layout: Layout, stage: int, layers: int) -> Buffers:
    """At the end of the forwards in flight, as the backward starts: p2p buffers; ZeRO-2/3's first gradient
    buckets; ZeRO-3's gathered units - none on the last stage, whose peak is the loss over the logits after the
    head has been freed, elsewhere a layer and the prefetched next one."""
    gathered = 0.0
    if layout.zero_stage >= 3 and stage != layout.head_stage:
        gathered = 2 * layer_param_bytes(model, layout)
    grads = zero_transient_grad_bytes(model, layout, stage, layers, at_backward_start=True)
    return Buffers(pipeline=_pipeline_buffer_bytes(model, layout), gradients=grads, parameters=gathered)


def zero_backward_peak(
    model: ModelConfig, layout: Layout, stage: int, n_layers: int, stage_params: int, profile: ActivationProfile
) -> Optional[tuple[float, Buffers]]:
    """ZeRO-2/3's other candidate peak, at the backward of the stage's first layer: (activations, buffers); None
    when gradients are reduced in place (stages 0-1, or a DP x CP group of one).

    What the code does (parallel/data_parallel.py): each bucket is reduce-scattered as soon as its last gradient
    arrives and its full-size buffer is released when that completes, with one reduction in flight, so at most
    two buckets are alive: the one filling and the one reducing - ZeRO-2's buckets of --ddp-bucket-size
    elements, ZeRO-3's one bucket per layer. Alive beside them at the first layer's backward: that layer's
    activations (rebuilt under full recompute), the other microbatches in flight, and ZeRO-3's gathered layer
    with the prefetched unit before it (another layer, or the embedding on the first stage); on the first stage,
    just after, the embedding's dense autograd gradient.
    """
    if layout.zero_stage < 2 or layout.dp * layout.cp == 1:
        return None
    p_bytes = bytes_per_param(layout.precision)[0]
    layer = layer_param_bytes(model, layout)
    embedding = model.padded_vocab_size(layout.tp) // layout.tp * model.hidden_size * p_bytes if stage == 0 else 0
    # ZeRO-3 gathers the layer in backward and prefetches the unit before it: a second layer, or on the first
    # layer of the first stage the embedding - whichever is larger counts (both moments occur).
    before = max(layer if n_layers >= 2 else 0, embedding) or layer
    gathered = layer + before if layout.zero_stage >= 3 else 0.0
    grads = zero_transient_grad_bytes(model, layout, stage, n_layers)
    buffers = Buffers(_pipeline_buffer_bytes(model, layout), grads, gathered)
    in_flight = microbatches_in_flight(layout, stage)
    others = (in_flight - 1) * stage_activation_bytes(model, layout, stage, n_layers, profile) / in_flight
    # The largest backward temporary of the layer: the gradient of the MLP's up projection output.
    tokens = model.seq_length // layout.cp * layout.micro_batch
    workspace = activation_element_bytes(layout.precision) * tokens * model.ffn_size * (2 if model.swiglu else 1) / layout.tp
    layer_moment = layout_layer_bytes(model, layout, profile, recompute=None) + workspace
    # The first stage's last backward is the embedding's (with the layer's tensors freed).
    embedding_moment = embedding_backward_bytes(model, layout) if embedding else 0.0
    return others + max(layer_moment, embedding_moment), buffers


def estimate(
    model: ModelConfig, layout: Layout, profile: ActivationProfile = TRICORN, stages: Optional[tuple[int, ...]] = None
) -> MemoryEstimate:
    """Per-rank memory of every pipeline stage (or only ``stages``); returns the worst one (ties: the first)."""
    if model.vocab_size is None:
        raise ValueError("the vocabulary size is unknown: pass --vocab-size N (or --tokenizer-model FILE)")
    p_b, g_b, m_b, o_b = layout_bytes_per_param(layout)
    shard = layout.dp * layout.cp  # the distributed optimizer shards over the DP x CP group

    def state_of(n: int, dp: int, param_bytes: float = p_b) -> ModelState:
        return model_state_bytes(
            n, param_bytes=param_bytes, grad_bytes=g_b, master_bytes=m_b, optimizer_bytes=o_b, dp=dp, zero_stage=layout.zero_stage
        )

    layers = stage_layer_counts(model.num_layers, layout.pp, layout.first_stage_layers, layout.last_stage_layers)
    best: Optional[MemoryEstimate] = None
    totals = []
    for stage, n_layers in enumerate(layers):
        if stages is not None and stage not in stages:
            continue
        n_params = stage_params_per_rank(model, layout, stage, n_layers)
        n_experts = stage_expert_params_per_rank(model, layout, n_layers)
        n_fp8 = fp8_primary_elements(model, layout, n_layers)  # --fp8-param-gather: stored in FP8
        # The distributed optimizer shards the routed experts over expert-DP (DP x CP / EP), the rest over DP x CP.
        state = (
            state_of(n_params - n_experts - n_fp8, shard)
            + state_of(n_fp8, shard, FP8_PARAM_BYTES)
            + state_of(n_experts, shard // layout.ep)
        )
        held = stage_units(model, layout, stage, n_layers, profile)
        host = held.host * microbatches_in_flight(layout, stage)  # the offloaded activations of every microbatch in flight
        if layout.optimizer_offload:  # master weights and moments (and the step's staging copies) in host memory
            owned = state.optimizer_state / o_b
            master = DTYPE_BYTES[layout.main_params_dtype]
            host += owned * (master + o_b + OFFLOADED_GRAD_BYTES + (p_b if layout.device == "cuda" else 0))
            state = dataclasses.replace(state, master_params=0.0, optimizer_state=0.0)
        # The stage's first MoE layer backward: its workspace, where the last stage's loss part is released.
        # Likewise a layer's CP attention buffers in flight (context_comm.py: K/V pairs, fp32 accumulators).
        zero_bubble = layout.pp > 1 and layout.schedule in ZERO_BUBBLE
        moe = moe_backward_workspace(model, layout, deferred=zero_bubble and experts_defer(layout))
        workspace = max(moe, cp_transient_bytes(model, layout) + masked_transient_bytes(model, layout))
        if zero_bubble:  # the rank's own order of F, B and W decides
            # The workspace rides on a B, beside the stores the walk holds then (the loss part went at F's end).
            zb = zero_bubble_activation_peak(model, layout, stage, n_layers, profile, sum(layers[:stage]), workspace)
            activations, logits = zb.activations - zb.loss_part, zb.loss_part
        else:
            activations = held.kept * microbatches_in_flight(layout, stage) + held.rebuilt
            logits = embedding_logits_bytes(model, layout, stage, profile)
            # A layer's backward workspace, and offloaded layers brought back, come after the loss part is freed.
            activations += max(0.0, workspace + held.returned - loss_part_bytes(model, layout, stage, profile))
        fp8 = fp8_terms(model, layout, n_layers, microbatches_in_flight(layout, stage))
        activations += fp8.activation_delta * n_layers * microbatches_in_flight(layout, stage)
        buffers = _forward_peak_buffers(model, layout, stage, n_layers)
        backward = zero_backward_peak(model, layout, stage, n_layers, n_params, profile)
        if backward is not None and backward[0] + backward[1].total > activations + logits + buffers.total:
            (activations, buffers), logits = backward, 0.0
        est = MemoryEstimate(
            stage=stage,
            layers_on_stage=n_layers,
            params_on_rank=n_params,
            params_bytes=state.params,
            grads_bytes=state.grads,
            master_params_bytes=state.master_params,
            optimizer_state_bytes=state.optimizer_state,
            activation_bytes=activations,
            embedding_logits_bytes=logits,
            buffer_bytes=buffers.total,
            grad_buffer_bytes=buffers.gradients,
            param_buffer_bytes=buffers.parameters,
            overhead_bytes=CUDA_OVERHEAD_BYTES if layout.device == "cuda" else 0.0,
            fp8_bytes=fp8.held,
            host_bytes=host,
            microbatches_in_flight=microbatches_in_flight(layout, stage),
            activation_bytes_per_layer=layout_layer_bytes(model, layout, profile) if n_layers else 0.0,
            activation_bytes_other=other_saved_bytes(model, layout, stage, profile),
        )
        totals.append(est.total_bytes)
        if best is None or est.total_bytes > best.total_bytes:
            best = est
    assert best is not None
    best.per_stage_total_bytes = totals
    return best


def estimate_config(cfg: Config, profile: ActivationProfile = TRICORN, stage: Optional[int] = None) -> MemoryEstimate:
    """The worst rank of ``cfg``, or pipeline ``stage``'s ranks (to compare with what a given rank measures)."""
    return estimate(cfg.model, Layout.from_config(cfg), profile, stages=None if stage is None else (stage,))
