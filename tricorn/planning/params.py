"""Parameter counts of a model and of each rank's share of it: per layer, per pipeline stage, per expert.

The TP split follows the layers: column-parallel weights and biases, row-parallel weights and the vocabulary are
divided by TP; norms and row-parallel biases are replicated on every TP rank; the embedding lives on the first
stage, the head on the last, and a tied head is a second copy on the last stage when PP > 1. Experts are divided
by EP (and by ETP inside an expert). No collectives, no device work.
"""

from __future__ import annotations

from typing import Optional

from tricorn.config import ModelConfig
from tricorn.planning.layout import Layout


def stage_layer_counts(num_layers: int, pp: int, first: Optional[int] = None, last: Optional[int] = None) -> list[int]:
    """Layers on each pipeline stage: ``first``/``last`` fixed where given, the rest split evenly."""
    counts: list[Optional[int]] = [None] * pp
    if pp > 1:
        counts[0], counts[-1] = first, last
    fixed = sum(c for c in counts if c is not None)
    free = [i for i, c in enumerate(counts) if c is None]
    if free:
        share, extra = divmod(num_layers - fixed, len(free))
        for j, i in enumerate(free):
            counts[i] = share + (1 if j < extra else 0)
    return [int(c or 0) for c in counts]


# ---------------------------------------------------------------- parameters


def _attention_sizes(model: ModelConfig, tp: int) -> list[int]:
    """A layer's norms and attention on a TP rank, in the model's order (model/transformer.py)."""
    h, gd, d = model.hidden_size, model.kv_heads * model.head_dim, model.head_dim
    q = model.num_attention_heads * model.head_dim
    bias = not model.disable_bias_linear
    layer_norm = model.normalization == "LayerNorm"
    norm = [h, h] if layer_norm else [h]
    qkv = [h * (q + 2 * gd) // tp, (q + 2 * gd) // tp][: 1 + model.qkv_bias]  # fused QKV, column parallel
    out = [q // tp * h, h][: 1 + bias]  # out projection, row parallel (bias replicated)
    qk_norms = ([d, d] if layer_norm else [d]) * 2 if model.qk_layernorm else []  # replicated over TP
    return [*norm, *qkv, *out, *qk_norms, *norm]


def _mlp_sizes(h: int, f: int, swiglu: bool, bias: bool, tp: int) -> list[int]:
    up = f * (2 if swiglu else 1)
    return [h * up // tp, up // tp][: 1 + bias] + [f // tp * h, h][: 1 + bias]  # w1 (gate|up) column, w2 row parallel


def _mlp_params(h: int, f: int, swiglu: bool, bias: bool, tp: int) -> int:
    return sum(_mlp_sizes(h, f, swiglu, bias, tp))


def expert_params(model: ModelConfig, etp: int = 1) -> int:
    """One routed expert's parameters on a rank (no biases: MoE needs --disable-bias-linear); / ETP."""
    return _mlp_params(model.hidden_size, model.moe_ffn_size, model.swiglu, False, etp)


def mlp_params_per_rank(model: ModelConfig, layer_id: int, tp: int = 1, active: bool = False, ep: int = 1, etp: int = 1) -> int:
    """The MLP of layer `layer_id`: dense, or router + experts (all, or the top-k a token uses) + shared expert.

    Routed experts are split over EP, and over TP with expert tensor parallelism (etp = TP; replicated at etp 1);
    the router is TP-replicated, the shared expert TP-split."""
    h, bias = model.hidden_size, not model.disable_bias_linear
    if not model.is_moe_layer(layer_id):
        return _mlp_params(h, model.ffn_size, model.swiglu, bias, tp)
    experts = model.moe_router_topk if active else model.num_experts // ep
    n = model.num_experts * h + experts * expert_params(model, etp)
    shared = model.moe_shared_expert_intermediate_size
    return n + (_mlp_params(h, shared, model.swiglu, bias, tp) if shared else 0)


def layer_params_per_rank(model: ModelConfig, tp: int = 1, active: bool = False, ep: int = 1, etp: int = 1) -> int:
    """Parameters of one layer on one TP rank; for a model mixing MoE and dense MLPs, the mean over its layers."""
    n = sum(_attention_sizes(model, tp))
    if model.num_experts is None:
        return n + mlp_params_per_rank(model, 0, tp)
    mlps = sum(mlp_params_per_rank(model, i, tp, active, ep, etp) for i in range(model.num_layers))
    return n + round(mlps / model.num_layers)


def fp8_weight_mask(model: ModelConfig) -> list[bool]:
    """Which of a dense layer's ``layer_param_sizes`` are FP8 primary weights under --fp8-param-gather: the
    weights of the four linears (QKV, out projection, w1, w2), not the norms or biases."""
    bias = not model.disable_bias_linear
    layer_norm = model.normalization == "LayerNorm"
    norm = [False] * (2 if layer_norm else 1)
    qk_norms = [False] * ((2 if layer_norm else 1) * 2 if model.qk_layernorm else 0)
    linear = [True, False][: 1 + bias]  # _attention_sizes' and _mlp_sizes' order: weight, then its bias
    qkv = [True, False][: 1 + model.qkv_bias]
    return norm + qkv + linear + qk_norms + norm + linear + linear


def fp8_primary_elements(model: ModelConfig, layout: Layout, layers: int) -> int:
    """Elements of the FP8 primary weights on a TP rank of a stage of ``layers`` layers (--fp8-param-gather; 0
    without it): each layer's four linear weights. They are stored in FP8 (1 byte each, ZeRO-3 shards
    them) and the distributed optimizer gathers them in FP8, half of bf16's bytes."""
    if not layout.fp8_param_gather:
        return 0
    sizes = [
        n
        for n, fp8 in zip(
            _attention_sizes(model, layout.tp)
            + _mlp_sizes(model.hidden_size, model.ffn_size, model.swiglu, not model.disable_bias_linear, layout.tp),
            fp8_weight_mask(model),
        )
        if fp8
    ]
    return layers * sum(sizes)


def layer_param_sizes(model: ModelConfig, layer_id: int, tp: int = 1, ep: int = 1, etp: int = 1) -> list[tuple[int, bool]]:
    """(elements, kept apart) of each parameter of layer ``layer_id`` on a TP rank, in the model's order. Kept
    apart: a routed expert's weights sit in buckets of their own (they reduce over expert-DP)."""
    h, bias = model.hidden_size, not model.disable_bias_linear
    sizes = [(n, False) for n in _attention_sizes(model, tp)]
    if not model.is_moe_layer(layer_id):
        return sizes + [(n, False) for n in _mlp_sizes(h, model.ffn_size, model.swiglu, bias, tp)]
    sizes.append((model.num_experts * h, False))  # the router
    expert = _mlp_sizes(h, model.moe_ffn_size, model.swiglu, False, etp)
    sizes += [(n, True) for _ in range(model.num_experts // ep) for n in expert]
    shared = model.moe_shared_expert_intermediate_size
    return sizes + [(n, False) for n in (_mlp_sizes(h, shared, model.swiglu, bias, tp) if shared else [])]


def stage_param_parts(
    model: ModelConfig, layout: Layout, stage: int, layers: int
) -> tuple[list[tuple[int, bool]], list[list[tuple[int, bool]]], list[tuple[int, bool]]]:
    """(embedding part, each layer's parameters, final norm and head part) on a TP rank of ``stage``, in the
    model's order, as ``layer_param_sizes``. Kept apart too: with PP and the distributed optimizer, the
    embedding and a tied head's copy (parallel/data_parallel.py)."""
    h, tp = model.hidden_size, layout.tp
    vocab = model.padded_vocab_size(tp)
    apart = layout.pp > 1 and layout.zero_stage >= 1
    first, last = stage == 0, stage == layout.head_stage
    tied = not model.untie_embeddings_and_output_weights
    head: list[tuple[int, bool]] = []
    if first:
        head.append((vocab // tp * h, apart))
        if model.position_embedding_type == "learned_absolute":
            head.append((model.max_positions * h, False))
    counts = stage_layer_counts(model.num_layers, layout.pp, layout.first_stage_layers, layout.last_stage_layers)
    offset = sum(counts[:stage]) if len(counts) == layout.pp and counts[stage] == layers else 0
    body = [layer_param_sizes(model, offset + i, tp, layout.ep, layout.etp) for i in range(layers)]
    tail: list[tuple[int, bool]] = []
    if last:
        tail += [(h, False)] * (2 if model.normalization == "LayerNorm" else 1)
        if not tied or not first:  # untied head, or the tied copy on a last stage without the embedding
            tail.append((vocab // tp * h, apart and tied))
    return head, body, tail


def stage_params_per_rank(model: ModelConfig, layout: Layout, stage: int, layers: int, active: bool = False) -> int:
    """Parameters one TP rank of pipeline ``stage`` holds (``active``: only the top-k experts a token uses)."""
    h, tp = model.hidden_size, layout.tp
    vocab = model.padded_vocab_size(tp)
    n = layers * layer_params_per_rank(model, tp, active, layout.ep, layout.etp)
    first, last = stage == 0, stage == layout.head_stage
    if first:
        n += vocab // tp * h
        if model.position_embedding_type == "learned_absolute":
            n += model.max_positions * h
    if last:
        n += h * (2 if model.normalization == "LayerNorm" else 1)
        tied = not model.untie_embeddings_and_output_weights
        if not tied or not first:  # untied head, or the tied copy on a last stage without the embedding
            n += vocab // tp * h
    return n


def total_params(model: ModelConfig) -> int:
    """Unique parameters of the model (tied head counted once), vocabulary padded as for TP = 1."""
    return stage_params_per_rank(model, Layout(), 0, model.num_layers)


def stage_expert_params_per_rank(model: ModelConfig, layout: Layout, layers: int) -> int:
    """Of ``stage_params_per_rank``: the routed experts' parameters (E/EP per MoE layer, the mean over the layers),
    which the distributed optimizer shards over expert-DP = DP x CP / EP instead of DP x CP."""
    if model.num_experts is None:
        return 0
    n_moe = sum(model.is_moe_layer(i) for i in range(model.num_layers))
    return round(layers * n_moe / model.num_layers * model.num_experts // layout.ep * expert_params(model, layout.etp))


def active_params(model: ModelConfig) -> int:
    """Parameters one token goes through: as total_params, with only the top-k routed experts of each MoE layer."""
    return stage_params_per_rank(model, Layout(), 0, model.num_layers, active=True)
