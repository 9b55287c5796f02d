"""Activation memory: the per-layer formula of our transformer block, per stage at its peak, and the embedding / head / loss part.

This is tricorn's one activation formula: the memory estimator (memory.py) sizes layouts with it, and the
saved-tensor probe (tricorn/training/activation_probe.py) measures the real block against it.

Our block: pre-norm RMSNorm (or LayerNorm), fused QKV with GQA and RoPE, SDPA, out projection, SwiGLU (or GeLU)
MLP, optional residual and attention dropout. One layer, one microbatch of b samples of s tokens on this rank
(s after CP), hidden h, a query heads, g key/value groups of d = h/a, r = g/a, MLP width f, TP t, element size
e (4 fp32, 2 bf16/fp16). Counted the way Korthikanti et al. 2022 count sbh(34 + 5as/h) for GPT-3 (every tensor
a backward needs, in bytes); ``layer_activation_terms`` returns one field per row. Every tensor is saved once,
in the compute dtype, and sharded over the sequence (SP) or the tensor dimension (tricorn/model/lean.py):

With --kv-channels d != h/a the attention terms (qkv, attention_output and their CP and dropout forms) count the
attention width a*d where the table says h. --qk-layernorm adds ``qk_norm``: the per-head norms' inputs (q and k,
e(a + g)d / t per token) and their fp32 statistics (4(a + g)/t; LayerNorm 8), RoPE after them keeping its rows only.

    field             bytes / sbh                     what autograd keeps (module that saves it)
    norm_inputs       2e                    [/t SP]   the two norms' inputs (the norms, lean.norm)
    norm_stats        2 * 4k / h            [/t SP]   fp32 rstd (k = 1) - LayerNorm: mean too (k = 2)
    linear_inputs     2e                    [/t SP]   the norm outputs, input of QKV and of w1 (the linears; under
                                                      SP their sequence shard, all-gathered again in backward)
    dropout_masks     2                     [/t SP]   residual dropout masks (bool), if --hidden-dropout > 0
    qkv               e(1 + 2r) / t                   q, k (RoPE'd) and v as three tensors (SDPA; lean.split_qkv_rope)
    attention_output  e / t                           SDPA's output is the out projection's input
    attention_core    4a / (h t)                      flash / memory-efficient SDPA: fp32 log-sum-exp per head and
                                                      token; no s x s tensor is stored
    (CP over c ranks)                                 per --cp-comm-type (``cp_attention_bytes``): p2p as above; allgather
                                                      the whole sequence's k, v (2e c r / t) instead of the local ones;
                                                      a2a k, v times the K/V replication, plus its head-sharded output
    mlp               3e f/(h t) SwiGLU               gate|up (2f, lean.swiglu) and its output (f, w2's input)
                      2e f/(h t) GeLU                 w1 output, gelu output
    rope_tables       2esd in all: the cos and sin rows (compute dtype), not per sample, not split by TP;
                      2esdb with --reset-position-ids (each sample's positions: rows per sample)

Summed, with RMSNorm, RoPE and flash attention, no dropout, SP (and CPU, whose only difference is dropout):

    sb(12h + 4h_kv + 6f)/t * (e / 2) + 4sb(2 + a)/t + 2esd          (SwiGLU; h_kv = g d)

which is Megatron's count - the input and the normalised input of both norms, q, k, v and the attention
output, both SwiGLU halves and its output - plus the softmax and norm statistics and the RoPE rows. e.g.
Llama-2-7B, TP2 SP, s 4096, b 1, bf16: 269.5 MB + 0.3 MB statistics + 2.1 MB RoPE rows = 271.8 MB per layer.
Without SP the norm terms and linear inputs are not divided by t.

    attention dropout (--attention-dropout > 0): attention runs as explicit math so that its masks are
    layout-independent (tricorn/model/dropout.py). Instead of the QKV output, the RoPE'd q, k and the
    log-sum-exp it keeps copies of q, and of k and v expanded to a heads, 3e / t, the s x s tensors,
    (4 [fp32 softmax] + 1 [bool mask] + e [dropped probs]) * a s / (h t), and the [s, s_k] causal mask
    (s * s_k bytes in all). KORTHIKANTI's math attention keeps (e + 1 + e) a s / (h t): 5as/h in fp16.
    The attention core always gets the causal flag, never a mask, so SDPA's flash path applies; context
    parallelism never builds a mask either (its p2p and allgather dropout keep no s x s tensor).

Variants. TP divides everything inside the TP region (QKV ... MLP); SP also divides the norm terms, the
linear inputs and the dropout masks (they act on the sequence shard). Selective recompute
(tricorn.parallel.recompute): core_attn removes the SDPA state (flash: 4a/(ht); math: 3e/t and the s x s
terms, while q, k, v held by the checkpoint are the qkv term again); mlp removes the MLP term (its checkpoint
holds the norm output, a linear input already counted); norm removes the two norm outputs (linear_inputs);
mlp_act removes w2's input (e f/(ht)). With norm and mlp_act a Llama layer keeps sb(8h + 4h_kv + 4f)/t * e/2
plus statistics. Full recompute keeps only the layer input (layer_input), e*sbh (/t under SP) per group of N
layers - plus, transiently during backward, one group's full activations (stage_activations.py adds the
groups and that one group, and takes the offloaded layers out).

Profiles. ``TRICORN`` is the table above (tricorn's block). ``KORTHIKANTI`` (no statistics, no RoPE rows,
1-byte masks, math attention) gives exactly Korthikanti et al.'s sbh(34 + 5as/h) for a GPT-3 block in fp16,
sbh(10 + 24/t + 5as/(ht)) with TP, sbh/t(34 + 5as/h) with TP+SP and 34sbh/t with selective recompute
(``korthikanti_layer_bytes``, Table 2).

Checked (tests/test_activation_probe.py): the probe equals ``TRICORN`` to the byte on CPU in fp32 and bf16,
RMSNorm and LayerNorm, with residual and attention dropout, without recompute and with every selective
variant, and on 2 ranks with TP and SP (fp32 and bf16); with full recompute it measures the layer input plus
the int64 position ids (8s bytes) the chunk's first checkpoint keeps. Attention dropout is matched in bf16 too
(the explicit attention is ours, not a torch kernel). The GPU rows assume flash / memory-efficient SDPA; they
were not measured on a GPU.

With --torch-compile (``compiled``) the layer is what inductor's partitioner keeps, measured by the same probe
(tests/test_compile.py): every row above except rope_tables - the compiled backward gathers the cos / sin rows
again from the fp32 tables (a buffer) by the int64 position ids, which the chunk's first compiled layer keeps
(8s bytes per chunk, as under full recompute). Everything else is saved as in eager mode: the partitioner
keeps the autograd Functions' own saved tensors (lean.py) and the GEMMs' inputs, and recomputes nothing else -
except under SP: traced, the column-parallel linear's all-gather in backward is the same functional collective
as its forward's, so the graph keeps the all-gathered input (e*sbh per linear, not its /t shard) instead of
gathering again (``sp_gathered_inputs``; one all-gather less per linear in backward). With selective ``mlp``
recompute the checkpointed MLP's input (the norm output) is rebuilt from the norm's saved input and statistics
instead of kept; and with selective ``core_attn`` recompute the graph keeps the default generator's state for
the replayed SDPA (``rng_state``: SDPA is tagged nondeterministic for its dropout_p, so the partitioner saves
the state it restores) - 5,056 uint8 bytes on CPU (torch.get_rng_state()), 16 on CUDA (seed and offset).
The probe equals the compile-mode estimate to the byte at every dense layout tests/test_compile.py runs (MoE:
against the eager run's bytes, which depend on the routing).

Native FP8, tensorwise (``fp8_inputs``; tricorn/parallel/fp8.py): each FP8 linear keeps a 1-byte FP8 copy of
its input and two fp32 scales instead of its bf16 input. linear_inputs: 1 byte per element for QKV's and w1's
inputs (e for w1's when a checkpointed MLP holds the norm output instead); attention_output: SDPA's own output
(unless core_attn is recomputed) plus the out projection's FP8 copy, (e + 1) / t; mlp: w2's input in FP8,
SwiGLU e(2f) + f (GeLU ef + f); fp8_scales: 8 bytes per linear that keeps its input. The norm and mlp_act
recompute modules then save nothing (the linears no longer hold the norm outputs or w2's bf16 input).
Rowwise keeps the bf16 inputs (views of tensors counted above), so its terms are bf16's.
Checked: tests/test_fp8.py (the trainer's probe against this formula).

Microbatches in flight on pipeline stage r of p with M microbatches: 1F1B min(p - r, M); interleaved with v
chunks min(2(p - r - 1) + (v - 1)p + 1, Mv) chunk-forwards of L/(pv) layers - on the first stage
L(1 + (p - 1)/(pv)) layers' worth, Korthikanti's factor; GPipe M; no pipeline 1.

Outside the layers, per microbatch (``other_saved_bytes``, the probe's activation_bytes_other): the token ids
on the first stage (int64; with TP the local ids and a 1-byte out-of-range mask instead); on the last stage
the final norm's input and statistics, the head's input (its sequence shard under SP), and the cross entropy's
logits in the compute dtype over V/t columns with its fp32 log-sum-exp, local labels and mask (13 bytes per
token). At the peak (``embedding_logits_bytes``) the ids of every microbatch in flight, and on the last stage
also the transient logit gradient (e per logit) and one fp32 chunk of CE_CHUNK_ELEMENTS logits.

No collectives, no device work.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Optional

from tricorn.config import ModelConfig
from tricorn.model.lean import CE_CHUNK_ELEMENTS

if TYPE_CHECKING:
    from tricorn.planning.layout import Layout


@dataclass(frozen=True)
class ActivationProfile:
    """Which tensors an implementation keeps for backward (see the module docstring)."""

    norm_input_bytes: Optional[float]  # bytes per saved norm-input element; None: the activation size e
    cpu_rmsnorm_copies: int  # CPU's unfused rms_norm also keeps the normalised input (another copy)
    norm_stats_bytes: float  # per token, norm and statistic (fp32 rstd; LayerNorm's mean too)
    norm_weight_fp32_copy: bool  # a 16-bit norm weight is cast to fp32 for each forward, and the copy is saved
    flash: bool  # fused SDPA (our block runs explicit attention math instead only with attention dropout)
    rope_rows: int  # [s, d] tables of the compute dtype each layer keeps for RoPE's backward (cos, sin)
    attention_output_copies: int
    sp_gathered_inputs: bool  # under SP, column-parallel linears keep their all-gathered input

    def norm_bytes(self, e: float, normalization: str, device: str) -> float:
        base = e if self.norm_input_bytes is None else self.norm_input_bytes
        return base * (self.cpu_rmsnorm_copies if device == "cpu" and normalization == "RMSNorm" else 1)

    def stats_bytes(self, normalization: str) -> float:
        return self.norm_stats_bytes * (2 if normalization == "LayerNorm" else 1)

    def uses_flash(self, attention_dropout: float) -> bool:
        return self.flash and attention_dropout == 0.0


TRICORN = ActivationProfile(
    norm_input_bytes=None,
    cpu_rmsnorm_copies=1,
    norm_stats_bytes=4,
    norm_weight_fp32_copy=False,
    flash=True,
    rope_rows=2,
    attention_output_copies=1,
    sp_gathered_inputs=False,
)
KORTHIKANTI = ActivationProfile(
    norm_input_bytes=None,
    cpu_rmsnorm_copies=1,
    norm_stats_bytes=0,
    norm_weight_fp32_copy=False,
    flash=False,
    rope_rows=0,
    attention_output_copies=1,
    sp_gathered_inputs=False,
)


@dataclass(frozen=True)
class LayerActivationTerms:
    """Bytes one transformer layer keeps for backward, for one microbatch on one rank, by term (module docstring)."""

    norm_inputs: float = 0.0
    norm_stats: float = 0.0
    norm_weights: float = 0.0
    linear_inputs: float = 0.0
    dropout_masks: float = 0.0
    rope_tables: float = 0.0
    qkv: float = 0.0
    attention_output: float = 0.0
    attention_core: float = 0.0
    qk_norm: float = 0.0  # --qk-layernorm: the per-head norms' inputs (q and k before them) and statistics
    mlp: float = 0.0
    fp8_scales: float = 0.0  # native FP8 tensorwise: the fp32 scales each FP8 linear keeps
    layer_input: float = 0.0  # full recompute: the checkpoint's input (one per group of N layers)
    rng_state: float = 0.0  # compiled selective core_attn: the generator state its replay restores
    document_bounds: float = 0.0  # compiled --reset-attention-mask on CPU: the bounds the masked op's backward keeps

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


CPU_RNG_STATE_BYTES = 5056  # torch.get_rng_state().numel(): the CPU generator's mt19937 state


def activation_element_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def _mlp_widths(swiglu: bool, act_recomputed: bool) -> int:
    """MLP tensors saved, in units of f: SwiGLU's gate|up (2) and its output (1); GeLU's input and output."""
    return (3 if swiglu else 2) - (1 if act_recomputed else 0)


def _linear_inputs(esbh: float, sp_div: int, selective: set[str], profile: ActivationProfile) -> float:
    """The inputs of QKV and w1 (the norms' outputs), as the linears or a checkpointed MLP keep them."""
    norm = "norm" in selective
    if sp_div == 1 or not profile.sp_gathered_inputs:
        return 0.0 if norm else 2 * esbh / sp_div
    # SP: QKV keeps its all-gathered input; a checkpointed MLP holds the norm output's shard instead of w1's
    mlp_input = (0.0 if norm else esbh / sp_div) if "mlp" in selective else esbh
    return esbh + mlp_input


def layer_activation_terms(
    model: ModelConfig,
    *,
    seq: int,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: Optional[str] = None,
    recompute_modules: Sequence[str] = ("core_attn",),
    precision: str = "bf16",
    profile: ActivationProfile = TRICORN,
    device: str = "cuda",
    cp: int = 1,
    cp_comm_type: str = "p2p",
    etp: int = 1,
    compiled: bool = False,
    fp8_inputs: bool = False,
    per_sample_positions: bool = False,
    document_bounds: bool = False,
) -> LayerActivationTerms:
    """Bytes one layer keeps for backward for one microbatch of ``micro_batch`` x ``seq`` tokens on one rank, by
    term (the module docstring's table); ``seq`` is the rank's sequence length, after CP over ``cp`` ranks."""
    s, b, h, e = seq, micro_batch, model.hidden_size, activation_element_bytes(precision)
    a, d, gd = model.num_attention_heads, model.head_dim, model.kv_heads * model.head_dim
    q = a * d  # the attention width (h unless --kv-channels sets d)
    if compiled:  # the traced SP linear's backward all-gather is its forward's, merged: the gathered input is kept
        profile = replace(profile, sp_gathered_inputs=True)
    sbh = s * b * h
    sp_div = tp if sequence_parallel else 1
    if recompute == "full":
        return LayerActivationTerms(layer_input=e * sbh / sp_div)
    selective = set(recompute_modules) if recompute == "selective" else set()
    norm = model.normalization
    qkv = e * s * b * (q + 2 * gd)
    rope_tables = profile.rope_rows * e * s * d if model.position_embedding_type == "rope" else 0.0
    if per_sample_positions:  # --reset-position-ids: each sample's own cos / sin rows
        rope_tables *= b
    if compiled:  # inductor's partitioner gathers the rows again in backward from the int64 position ids
        rope_tables = 0.0  # (8s bytes per chunk, kept by its first layer: see the module docstring)
    # Compiled, the masked op's backward takes the int32 document bounds [b, s + 1] as a saved input: host memory,
    # which only a CPU run counts (tricorn/model/masking.py).
    bounds = 4.0 * (cp * s + 1) * b if compiled and document_bounds and device == "cpu" else 0.0
    copies = profile.attention_output_copies - (1 if "core_attn" in selective else 0)
    if "core_attn" in selective:
        core = 0.0
    elif cp > 1 and profile.flash:
        qkv, core = cp_attention_bytes(model, cp_comm_type, s, b, e, cp, tp)
    elif profile.uses_flash(model.attention_dropout):
        core = 4.0 * a * s * b
    elif profile.flash:  # our explicit attention with layout-independent dropout (tricorn/model/dropout.py)
        qkv = (1 + 2 * cp) * e * s * b * q  # q, and the (all-gathered under CP) k, v expanded to a heads: fresh copies
        # fp32 softmax output, bool keep mask, dropped probabilities over the cp*s keys; the causal mask
        core = (4 + 1 + e) * a * s * cp * s * b + s * cp * s
    else:  # q, k, v as the math path's matmuls keep them (k, v expanded to a heads) and the s x s tensors
        qkv = 3 * e * s * b * q
        core = e * a * s * s * b
        if model.attention_dropout > 0:
            core += (1 + e) * a * s * s * b
    linear_inputs = _linear_inputs(e * sbh, sp_div, selective, profile)
    # SDPA is tagged nondeterministic (its dropout_p), so inductor's partitioner saves the default generator's
    # state for the recomputed attention to replay with: torch.get_rng_state() on CPU, (seed, offset) on CUDA.
    rng_state = (CPU_RNG_STATE_BYTES if device == "cpu" else 16) if compiled and "core_attn" in selective else 0.0
    if compiled and "mlp" in selective:  # the partitioner rebuilds the checkpointed MLP's input from the norm's
        linear_inputs -= e * sbh / sp_div
    terms = LayerActivationTerms(
        norm_inputs=2 * profile.norm_bytes(e, norm, device) * sbh / sp_div,
        norm_stats=2 * profile.stats_bytes(norm) * s * b / sp_div,
        norm_weights=2 * 4 * h * (2 if norm == "LayerNorm" else 1) if profile.norm_weight_fp32_copy and e != 4 else 0.0,
        linear_inputs=linear_inputs,
        dropout_masks=2 * sbh / sp_div if model.hidden_dropout > 0 else 0.0,  # bool masks
        rope_tables=rope_tables,
        qkv=qkv / tp,
        attention_output=e * s * b * q * max(copies, 1) / tp,
        qk_norm=qk_norm_bytes(model, e, s * b, norm, device, profile) / tp,
        attention_core=core / tp,
        mlp=0.0 if "mlp" in selective else mlp_activation_bytes(model, e, s * b, tp, "mlp_act" in selective, sp_div, etp),
        rng_state=rng_state,
        document_bounds=bounds,
    )
    return _with_fp8_inputs(terms, model, e, s * b, sp_div, tp, selective, copies) if fp8_inputs else terms


def _with_fp8_inputs(
    terms: LayerActivationTerms, model: ModelConfig, e: float, tokens: int, sp_div: int, tp: int, selective: set, copies: int
) -> LayerActivationTerms:
    """Native FP8 tensorwise (the module docstring): the linears keep FP8 copies of their inputs and two scales."""
    h, f, q = model.hidden_size, model.ffn_size, model.num_attention_heads * model.head_dim
    mlp_kept = "mlp" not in selective
    if mlp_kept:
        w1_input = tokens * h / sp_div  # w1's FP8 copy
    else:  # the checkpointed MLP holds the norm output (freed by norm recompute, as in bf16)
        w1_input = 0.0 if "norm" in selective else e * tokens * h / sp_div
    return replace(
        terms,
        linear_inputs=tokens * h / sp_div + w1_input,  # QKV's FP8 copy (norm recompute cannot drop it)
        attention_output=(e * copies + 1) * tokens * q / tp,  # SDPA's output unless recomputed, and wo's FP8 copy
        mlp=tokens * f * (e * (_mlp_widths(model.swiglu, False) - 1) + 1) / tp if mlp_kept else 0.0,
        fp8_scales=8.0 * (4 if mlp_kept else 2),
    )


def qk_norm_bytes(model: ModelConfig, e: float, tokens: int, norm: str, device: str, profile: ActivationProfile) -> float:
    """--qk-layernorm's saved tensors for `tokens` tokens, all heads (before the /t of TP): each per-head norm keeps
    its input (q, k as split from the QKV output) and its fp32 statistics per head and token; its output goes
    through RoPE, which keeps only the cos/sin rows (lean.rope), into the q and k the attention keeps (``qkv``)."""
    if not model.qk_layernorm:
        return 0.0
    heads = model.num_attention_heads + model.kv_heads
    return heads * tokens * (profile.norm_bytes(e, norm, device) * model.head_dim + profile.stats_bytes(norm))


def cp_attention_bytes(model: ModelConfig, comm_type: str, s: int, b: int, e: float, cp: int, tp: int) -> tuple[float, float]:
    """(qkv, attention_core) bytes of one layer's attention under CP over ``cp`` ranks, before the /t of TP
    (s: the rank's tokens; tricorn/parallel/context/). The fp32 lse is 4 bytes per query head and token in all.

    p2p        the local q, k, v, the output and lse - what one flash call keeps; with attention dropout the
               same (its blocks recompute their probabilities from the lse in backward)
    allgather  q, and the whole sequence's k and v (at the key/value head count) in sequence order; the int64
               order they were put in (8 cp s bytes, on every TP rank); dropout as p2p
    a2a        q, k, v over the whole sequence for a/cp heads (the same bytes as q; k and v times the replication
               of key/value heads CP does not divide) and the head-sharded output besides the wo input; with
               attention dropout the explicit full-sequence form of dropout.py on a/cp heads (q and k, v
               expanded, the [cp s]^2 softmax, mask and dropped probabilities, the causal mask)
    """
    a, gd = model.num_attention_heads, model.kv_heads * model.head_dim
    h = a * model.head_dim  # the query width
    lse = 4.0 * a * s * b
    if comm_type == "allgather":
        return e * s * b * h + 2 * e * cp * s * b * gd, lse + 8 * cp * s * tp
    if comm_type == "a2a":
        if model.attention_dropout > 0:
            seq = cp * s
            return 3 * e * s * b * h, (4 + 1 + e) * a * s * seq * b + seq * seq
        reps = cp // math.gcd(max(model.kv_heads // tp, 1), cp)
        return e * s * b * (h + 2 * gd * reps), lse + e * s * b * h
    return e * s * b * (h + 2 * gd), lse


def mlp_activation_bytes(
    model: ModelConfig, e: float, tokens: int, tp: int, act_recomputed: bool = False, sequence_shards: int = 1, etp: int = 1
) -> float:
    """The MLP's saved tensors, the mean over the layers (MoE layers and dense ones): dense e*T*f*widths/tp
    (``_mlp_widths``), MoE ``moe_layer_bytes`` (under SP over ``sequence_shards`` = TP ranks)."""
    dense = e * tokens * model.ffn_size * _mlp_widths(model.swiglu, act_recomputed) / tp
    if model.num_experts is None:
        return dense
    moe = moe_layer_bytes(model, e, tokens, tp, act_recomputed, sequence_shards, etp)
    n_moe = sum(model.is_moe_layer(i) for i in range(model.num_layers))
    return (n_moe * moe + (model.num_layers - n_moe) * dense) / model.num_layers


def moe_copies(model: ModelConfig, tokens: int) -> int:
    """Token copies the experts of one MoE layer run for a microbatch of `tokens`: T*k dropless; with a capacity
    factor, balanced routing's min(T*k/E, capacity) per expert (what tricorn simulate routes)."""
    k, n = model.moe_router_topk, model.num_experts
    if model.moe_expert_capacity_factor is None:
        return tokens * k
    return n * min(tokens * k // n, math.ceil(tokens * k / n * model.moe_expert_capacity_factor))


def moe_layer_bytes(
    model: ModelConfig, e: float, tokens: int, tp: int, act_recomputed: bool = False, sequence_shards: int = 1, etp: int = 1
) -> float:
    """What one MoE MLP (model/moe.py) keeps for backward, T tokens, C copies (``moe_copies``), as the probe
    counts it (tests/test_activation_probe.py):

        per copy    its gathered input and its expert output (e*h each), the expert's intermediates (SwiGLU's
                    gate|up and output, GeLU's input and output: e*f*widths), its weight (e) and two int64 indices
        per token   the fp32 router scores (4E), the top-k indices (8k) and the kept mask (k); the normalised
                    weights and their sum (4k + 4) unless sigmoid with k = 1; with the aux loss the sigmoid
                    scores' sum (4); in 16-bit runs the fp32 copy of the router input (4h), which without a
                    shared expert replaces the norm output the linear_inputs term counts (e*h)
        per layer   the aux loss's counts and value (4E + 4), a 16-bit run's fp32 router weight (4Eh)

    plus the shared expert as a dense MLP of its width (TP-split). The experts are TP-split with expert tensor
    parallelism (``etp`` = TP: intermediates f / ETP), else not. Expert parallelism adds two int64 indices per row
    it sends (not counted). Under sequence parallelism the router sees only this rank's T / ``sequence_shards``
    tokens (the shared expert gathers the sequence), and so do the experts at ETP 1; at ETP = TP they run the
    copies of all the shards (gathered over TP), each shard's dropped by its own capacity."""
    h, n, k = model.hidden_size, model.num_experts, model.moe_router_topk
    full, tokens = tokens, tokens // sequence_shards
    copies = moe_copies(model, tokens) * (sequence_shards if etp > 1 else 1)
    out = copies * (e * (2 * h + model.moe_ffn_size // etp * _mlp_widths(model.swiglu, False)) + e + 16)
    per_token = 4 * n + 9 * k
    if model.moe_router_score_function == "softmax" or k > 1:
        per_token += 4 * k + 4
    if model.moe_aux_loss_coeff:
        per_token += 4 if model.moe_router_score_function == "sigmoid" else 0
        out += 4 * n + 4
    shared = model.moe_shared_expert_intermediate_size or 0
    if e != 4:  # the router's fp32 input replaces the norm output (counted in linear_inputs) unless w1 keeps that
        per_token += 4 * h - (0 if shared else e * h)
        out += 4 * n * h
    return out + tokens * per_token + e * full * shared * _mlp_widths(model.swiglu, act_recomputed) / tp


def layer_activation_bytes(model: ModelConfig, **kwargs: Any) -> float:
    """Total of ``layer_activation_terms`` (same keyword arguments): bytes one layer keeps for one microbatch."""
    return layer_activation_terms(model, **kwargs).total


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
    """Forward passes of the whole stage whose activations are alive at the stage's peak.

    The zero-bubble schedules hold a microbatch until its W (tricorn.parallel.pipeline.zero_bubble; the
    simulator's peaks, tests/test_pipeline_zero_bubble.py): zb-h1 min(pp, m) on every stage, zbv 2 pp
    half-stage chunks (pp microbatches), dualpipev 2 pp + 1 chunks. That count is what the estimate reports;
    their bytes come from zero_bubble_memory.py, which tells activations (F to B) from weight-gradient
    stores (B to W) along each rank's own order."""
    p, v, m = layout.pp, layout.vpp, layout.num_microbatches
    if p == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "zb-h1":
        return float(min(p, m))
    if layout.schedule in ("zbv", "dualpipev"):
        return min(2 * p + (layout.schedule == "dualpipev"), 2 * m) / 2
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
        cp=layout.cp,
        cp_comm_type=layout.cp_comm_type,
        etp=layout.etp,
        compiled=layout.compiled,
        fp8_inputs=layout.fp8_inputs,
        per_sample_positions=layout.per_sample_positions,
        document_bounds=layout.document_bounds,
    )
    return layer_activation_bytes(model, **(kw | override), profile=profile)


def _ids_bytes(layout: Layout) -> int:
    return 8 if layout.tp == 1 else 9  # int64 ids; with TP the local ids and the out-of-range mask


def other_saved_bytes(model: ModelConfig, layout: Layout, stage: int, profile: ActivationProfile = TRICORN) -> float:
    """Per microbatch: what the embedding, final norm, head and loss of ``stage`` keep for backward."""
    s, b, h, tp = model.seq_length // layout.cp, layout.micro_batch, model.hidden_size, layout.tp
    e = activation_element_bytes(layout.precision)
    total = 0.0
    if stage == 0:
        total += _ids_bytes(layout) * s * b
    if stage == layout.head_stage:
        sp_div = tp if layout.sequence_parallel else 1
        norm = model.normalization
        total += (profile.norm_bytes(e, norm, layout.device) * h + profile.stats_bytes(norm)) * s * b / sp_div
        if profile.norm_weight_fp32_copy and e != 4:
            total += 4 * h * (2 if norm == "LayerNorm" else 1)
        total += e * s * b * h / (1 if profile.sp_gathered_inputs else sp_div)  # the head's input
        total += (e * model.padded_vocab_size(tp) / tp + 13) * s * b  # logits; fp32 lse, local labels and mask
    return total


def moe_backward_workspace(model: ModelConfig, layout: Layout, deferred: bool = False) -> float:
    """What an MoE layer's backward holds beyond its saved tensors, at its largest, for the C copies of one
    microbatch (``moe_copies``): in the experts' activation backward its incoming gradient, input gradient and
    SwiGLU's sigmoid less the saved output already released (lean.swiglu: e*C*3f; GeLU e*C*2f), or in the up
    projection's backward the stacked weight gradient of the rank's E/EP experts (until the DP hook takes it)
    and the input gradient (e*C*h). 0 for a dense model (its MLP's is T/C x TP times smaller, within the
    estimate's bound). Under SP the copies are those of the rank's sequence shard (at ETP = TP of all the shards,
    through f / ETP of each expert). ``deferred``: a zero-bubble B whose loop of expert GEMMs leaves the weight
    gradients to the W (planning/zero_bubble_memory.py): the saved output stays (the W's input, e*C*f more) and no
    stacked weight gradient is built."""
    if model.num_experts is None:
        return 0.0
    shards = layout.tp if layout.sequence_parallel else 1
    tokens = model.seq_length // layout.cp * layout.micro_batch // shards
    e, f, h = activation_element_bytes(layout.precision), model.moe_ffn_size // layout.etp, model.hidden_size
    copies = moe_copies(model, tokens) * (shards if layout.etp > 1 else 1)
    up = f * (2 if model.swiglu else 1)
    activation = e * copies * f * ((3 if model.swiglu else 2) + (1 if deferred else 0))
    weight_grad = e * model.num_experts // layout.ep * up * h + e * copies * h  # 16-bit runs: 16-bit parameters
    if deferred:
        return activation
    return max(activation, weight_grad)


def embedding_backward_bytes(model: ModelConfig, layout: Layout) -> float:
    """The first stage's last backward, the embedding's: autograd builds its dense gradient (vocabulary / TP x
    hidden, in the parameter dtype, which is the activations' e) from the gradient of its output (e per
    element of the whole sequence), beside whatever else the rank holds then."""
    e, tokens = activation_element_bytes(layout.precision), model.seq_length // layout.cp * layout.micro_batch
    return e * (model.padded_vocab_size(layout.tp) // layout.tp * model.hidden_size + tokens * model.hidden_size)


def loss_part_bytes(model: ModelConfig, layout: Layout, stage: int, profile: ActivationProfile = TRICORN) -> float:
    """Of ``embedding_logits_bytes``: the last stage's own part (saved final norm, head input and logits, the
    transient logit gradient and fp32 loss chunk), all released before the layers' backward starts."""
    if stage != layout.head_stage:
        return 0.0
    s, b = model.seq_length // layout.cp, layout.micro_batch
    saved = other_saved_bytes(model, layout, stage, profile) - (_ids_bytes(layout) * s * b if stage == 0 else 0)
    logits = s * b * model.padded_vocab_size(layout.tp) / layout.tp
    return saved + activation_element_bytes(layout.precision) * logits + 4 * min(logits, CE_CHUNK_ELEMENTS)


def embedding_logits_bytes(model: ModelConfig, layout: Layout, stage: int, profile: ActivationProfile = TRICORN) -> float:
    """At the stage's peak: the ids of every microbatch in flight; on the last stage one microbatch's saved
    norm, head input and logits, plus the transient logit gradient and one fp32 chunk of the loss."""
    s, b = model.seq_length // layout.cp, layout.micro_batch
    total = 0.0
    if stage == 0:
        total += _ids_bytes(layout) * s * b * microbatches_in_flight(layout, 0)
    if stage == layout.head_stage:
        total += loss_part_bytes(model, layout, stage, profile)
    return total
