"""Activation memory of a layout: per layer, per stage at its peak, and the embedding / head / loss part.

One layer, one microbatch (b samples of s tokens on this rank, s already divided by CP), in bytes, with e the
activation element size (2 in bf16/fp16, 4 in fp32), n the bytes of a saved norm input, t = TP, a heads, g
key/value groups, d = h/a, f ffn width. "rep" terms are replicated over TP unless sequence parallel shards
them; the rest is divided by t:

    norm inputs           rep   2 * n * sbh
    norm statistics       rep   2 * 4k * sb            (fp32 rstd: k = 1; LayerNorm's mean too: k = 2)
    linear inputs         rep   2 * e * sbh            (the norms' outputs, input of QKV and of w1)
    residual dropout      rep   2 * sbh                (1-byte masks, only with --hidden-dropout > 0)
    Q, K, V               /t    e * sb(h + 2gd)        (+ e * sb(h + gd): RoPE'd q, k beside the fused QKV output)
    attention output      /t    e * sbh * copies       (SDPA output and the out-projection's input)
    attention core        /t    flash: 4 * a*s*b (fp32 log-sum-exp); no s x s tensor is stored
                                math:  3e * sbh (q, and k, v expanded to a heads, replace the Q, K, V row)
                                       + e*as^2b (softmax) + (as^2b mask + e*as^2b) with --attention-dropout > 0
    MLP                   /t    SwiGLU: e * 4 * sbf (gate|up output, silu output, product); GeLU: e * 2 * sbf

``KORTHIKANTI`` (n = e, no statistics, one attention output copy, no RoPE copies, sharded SP inputs, math
attention) gives exactly Korthikanti et al.'s sbh(34 + 5as/h) for a GPT-3 block in fp16, sbh(10 + 24/t +
5as/(ht)) with TP, sbh/t(34 + 5as/h) with TP+SP and 34sbh/t with selective recompute. ``TRICORN`` is what
tricorn's block keeps (tricorn/training/activation_probe.py measures it to the byte): fp32 norm inputs (n = 4;
CPU's unfused rms_norm keeps the normalised input too), the fused QKV output alive beside the RoPE'd q and k,
flash attention (torch's fused SDPA; on CPU only without attention dropout, which falls back to the math path),
and under SP the all-gathered inputs of the column-parallel linears (the sequence is gathered before the
matmul and autograd keeps it).

Recompute: selective drops the attention-core terms ("core_attn"), the MLP intermediates ("mlp"), the norms'
outputs ("norm"). Under SP with gathered inputs, QKV keeps its all-gathered input whatever the modules; w1's
is replaced by the norm output's shard a checkpointed MLP holds (e*sbh/t, gone with "norm" too). Full keeps
only each layer's input (e*sbh, /t under SP) plus, during backward, one recompute group's full activations.

Microbatches in flight on pipeline stage r of p with M microbatches: 1F1B min(p - r, M); interleaved with v
chunks min(2(p - r - 1) + (v - 1)p + 1, Mv) chunk-forwards of L/(pv) layers - on the first stage
L(1 + (p - 1)/(pv)) layers' worth, Korthikanti's factor; GPipe M; no pipeline 1.

Outside the layers, per microbatch (``other_saved_bytes``, the probe's activation_bytes_other): the token ids
on the first stage (int64; with TP the local ids and a 1-byte out-of-range mask instead); on the last stage
the final norm's input and statistics, the head's input, and the vocab-parallel cross entropy's fp32 softmax
over V/t columns with its local labels and mask (9 bytes per token). At the peak (``embedding_logits_bytes``)
the ids of every microbatch in flight, and on the last stage also the transient logits: the head output (e per
logit) and a second fp32 copy inside the cross entropy.

No collectives, no device work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from tricorn.config import ModelConfig

if TYPE_CHECKING:
    from tricorn.planning.memory import Layout


@dataclass(frozen=True)
class ActivationProfile:
    """Which tensors an implementation keeps for backward (see the module docstring)."""

    norm_input_bytes: Optional[float]  # bytes per saved norm-input element; None: the activation size e
    cpu_rmsnorm_copies: int  # CPU's unfused rms_norm also keeps the normalised input (another copy)
    norm_stats_bytes: float  # per token, norm and statistic (fp32 rstd; LayerNorm's mean too)
    norm_weight_fp32_copy: bool  # a 16-bit norm weight is cast to fp32 for each forward, and the copy is saved
    cpu_dropout_mask_is_activation: bool  # CPU's dropout keeps a noise tensor of the activation dtype, not 1-byte masks
    flash: bool  # fused SDPA where torch has one (not on CPU with attention dropout)
    rope_copies: bool  # RoPE'd q and k kept beside the fused QKV output, plus the cos/sin rows per layer
    attention_output_copies: int
    sp_gathered_inputs: bool  # under SP, column-parallel linears keep their all-gathered input

    def norm_bytes(self, e: float, normalization: str, device: str) -> float:
        base = e if self.norm_input_bytes is None else self.norm_input_bytes
        return base * (self.cpu_rmsnorm_copies if device == "cpu" and normalization == "RMSNorm" else 1)

    def stats_bytes(self, normalization: str) -> float:
        return self.norm_stats_bytes * (2 if normalization == "LayerNorm" else 1)

    def mask_bytes(self, e: float, device: str) -> float:
        return e if device == "cpu" and self.cpu_dropout_mask_is_activation else 1

    def uses_flash(self, device: str, attention_dropout: float) -> bool:
        return self.flash and (device != "cpu" or attention_dropout == 0.0)


TRICORN = ActivationProfile(
    norm_input_bytes=4,
    cpu_rmsnorm_copies=2,
    norm_stats_bytes=4,
    norm_weight_fp32_copy=True,
    cpu_dropout_mask_is_activation=True,
    flash=True,
    rope_copies=True,
    attention_output_copies=1,
    sp_gathered_inputs=True,
)
KORTHIKANTI = ActivationProfile(
    norm_input_bytes=None,
    cpu_rmsnorm_copies=1,
    norm_stats_bytes=0,
    norm_weight_fp32_copy=False,
    cpu_dropout_mask_is_activation=False,
    flash=False,
    rope_copies=False,
    attention_output_copies=1,
    sp_gathered_inputs=False,
)


def activation_element_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def _linear_inputs(esbh: float, sp_div: int, selective: set[str], profile: ActivationProfile) -> float:
    """The inputs of QKV and w1 (the norms' outputs), as the linears or a checkpointed MLP keep them."""
    norm = "norm" in selective
    if sp_div == 1 or not profile.sp_gathered_inputs:
        return 0.0 if norm else 2 * esbh / sp_div
    # SP: QKV keeps its all-gathered input; a checkpointed MLP holds the norm output's shard instead of w1's
    mlp_input = (0.0 if norm else esbh / sp_div) if "mlp" in selective else esbh
    return esbh + mlp_input


def layer_activation_bytes(
    model: ModelConfig,
    *,
    seq: int,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: Optional[str] = None,
    recompute_modules: tuple[str, ...] = ("core_attn",),
    precision: str = "bf16",
    profile: ActivationProfile = TRICORN,
    device: str = "cuda",
) -> float:
    """Bytes one layer keeps for backward for one microbatch of ``micro_batch`` x ``seq`` tokens on one rank."""
    s, b, h, e = seq, micro_batch, model.hidden_size, activation_element_bytes(precision)
    a, d, gd, f = model.num_attention_heads, model.head_dim, model.kv_heads * model.head_dim, model.ffn_size
    sbh = s * b * h
    sp_div = tp if sequence_parallel else 1
    if recompute == "full":
        return e * sbh / sp_div
    selective = set(recompute_modules) if recompute == "selective" else set()
    norm = model.normalization
    norms = 2 * (profile.norm_bytes(e, norm, device) * sbh + profile.stats_bytes(norm) * s * b) / sp_div
    if profile.norm_weight_fp32_copy and e != 4:
        norms += 2 * 4 * h * (2 if norm == "LayerNorm" else 1)
    linear_inputs = _linear_inputs(e * sbh, sp_div, selective, profile)
    dropout = 2 * profile.mask_bytes(e, device) * sbh / sp_div if model.hidden_dropout > 0 else 0.0
    qkv = e * s * b * (h + 2 * gd)
    rope_tables = 0.0
    if profile.rope_copies and model.position_embedding_type == "rope":
        qkv += e * s * b * (h + gd)
        rope_tables = 4 * e * s * d  # cos and sin rows for q and for k, not per sample, not split by TP
    copies = profile.attention_output_copies - (1 if "core_attn" in selective else 0)
    attn_out = e * sbh * max(copies, 1)
    if "core_attn" in selective:
        core = 0.0
    elif profile.uses_flash(device, model.attention_dropout):
        core = 4.0 * a * s * b
    else:  # q, k, v as the math path's matmuls keep them (k, v expanded to a heads) and the s x s tensors
        qkv = 3 * e * sbh
        core = e * a * s * s * b
        if model.attention_dropout > 0:
            core += (profile.mask_bytes(e, device) + e) * a * s * s * b
    mlp = 0.0 if "mlp" in selective else e * s * b * f * (4 if model.swiglu else 2)
    return norms + linear_inputs + dropout + rope_tables + (qkv + attn_out + core + mlp) / tp


def korthikanti_layer_bytes(
    s: int, b: int, h: int, a: int, tp: int = 1, sp: bool = False, recompute: Optional[str] = None
) -> float:
    """Korthikanti et al. 2022, Table 2: activation bytes per GPT-3 layer (fp16, dropout, no flash attention)."""
    if recompute == "full":
        return 2 * s * b * h / (tp if sp else 1)
    if recompute == "selective":
        return s * b * h * 34 / tp if sp else s * b * h * (10 + 24 / tp)
    if sp:
        return s * b * h / tp * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))


def microbatches_in_flight(layout: Layout, stage: int) -> float:
    """Forward passes of the whole stage whose activations are alive at the stage's peak."""
    p, v, m = layout.pp, layout.vpp, layout.num_microbatches
    if p == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if v == 1:
        return float(min(p - stage, m))
    chunk_forwards = min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)
    return chunk_forwards / v


def layout_layer_bytes(model: ModelConfig, layout: Layout, profile: ActivationProfile = TRICORN, **override) -> float:
    """``layer_activation_bytes`` for ``layout`` (its recompute setting unless overridden)."""
    kw = dict(
        seq=model.seq_length // layout.cp,
        micro_batch=layout.micro_batch,
        tp=layout.tp,
        sequence_parallel=layout.sequence_parallel,
        recompute=layout.recompute,
        recompute_modules=layout.recompute_modules,
        precision=layout.precision,
        device=layout.device,
    )
    return layer_activation_bytes(model, **(kw | override), profile=profile)


def stage_activation_bytes(model: ModelConfig, layout: Layout, stage: int, layers: int, profile: ActivationProfile) -> float:
    """Transformer-layer activations alive on ``stage`` at its peak (full recompute: stored inputs + one group)."""
    in_flight = microbatches_in_flight(layout, stage)
    if layout.recompute != "full":
        return layout_layer_bytes(model, layout, profile) * layers * in_flight
    full_layer = layout_layer_bytes(model, layout, profile, recompute=None)
    stored = layout_layer_bytes(model, layout, profile)
    n = max(1, layout.recompute_num_layers or 1)
    if layout.recompute_method == "block":
        recomputed = min(n * layout.vpp, layers)  # per model chunk
        return (recomputed * stored + (layers - recomputed) * full_layer) * in_flight + full_layer
    groups = -(-layers // n)  # uniform: one stored input per group of n layers, one group rebuilt at a time
    return groups * stored * in_flight + min(n, layers) * full_layer


def _ids_bytes(layout: Layout) -> int:
    return 8 if layout.tp == 1 else 9  # int64 ids; with TP the local ids and the out-of-range mask


def other_saved_bytes(model: ModelConfig, layout: Layout, stage: int, profile: ActivationProfile = TRICORN) -> float:
    """Per microbatch: what the embedding, final norm, head and loss of ``stage`` keep for backward."""
    s, b, h, tp = model.seq_length // layout.cp, layout.micro_batch, model.hidden_size, layout.tp
    e = activation_element_bytes(layout.precision)
    total = 0.0
    if stage == 0:
        total += _ids_bytes(layout) * s * b
    if stage == layout.pp - 1:
        sp_div = tp if layout.sequence_parallel else 1
        norm = model.normalization
        total += (profile.norm_bytes(e, norm, layout.device) * h + profile.stats_bytes(norm)) * s * b / sp_div
        if profile.norm_weight_fp32_copy and e != 4:
            total += 4 * h * (2 if norm == "LayerNorm" else 1)
        total += e * s * b * h / (1 if profile.sp_gathered_inputs else sp_div)  # the head's input
        total += (4 * model.padded_vocab_size(tp) / tp + 9) * s * b  # fp32 softmax, local labels and mask
    return total


def embedding_logits_bytes(model: ModelConfig, layout: Layout, stage: int, profile: ActivationProfile = TRICORN) -> float:
    """At the stage's peak: the ids of every microbatch in flight; on the last stage one microbatch's saved
    norm, head input and softmax, plus the transient logits (the head output and a second fp32 copy)."""
    s, b = model.seq_length // layout.cp, layout.micro_batch
    total = 0.0
    if stage == 0:
        total += _ids_bytes(layout) * s * b * microbatches_in_flight(layout, 0)
    if stage == layout.pp - 1:
        last_only = other_saved_bytes(model, layout, stage, profile) - (_ids_bytes(layout) * s * b if stage == 0 else 0)
        logits = (activation_element_bytes(layout.precision) + 4) * s * b * model.padded_vocab_size(layout.tp) / layout.tp
        total += last_only + logits
    return total
