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
a second copy on the last stage when PP > 1.

Activations of one layer for one microbatch (b samples of s tokens on this rank, s already divided by CP),
in bytes, with e the activation element size (2 in bf16/fp16, 4 in fp32), n the bytes of a saved norm input,
t = TP, a heads, g key/value groups, d = h/a, f ffn width. "rep" terms are replicated over TP unless sequence
parallel shards them; the rest is divided by t:

    norm inputs           rep   2 * n * sbh
    linear inputs         rep   2 * e * sbh            (the norms' outputs, input of QKV and of w1)
    residual dropout      rep   2 * sbh                (1-byte masks, only with --hidden-dropout > 0)
    Q, K, V               /t    e * sb(h + 2gd)        (+ e * sb(h + gd): RoPE'd q, k beside the fused QKV output)
    attention output      /t    e * sbh * copies       (SDPA output and the out-projection's input)
    attention core        /t    flash: 4 * a*s*b (fp32 log-sum-exp); no s x s tensor is stored
                                math:  e*as^2b (softmax) + (as^2b mask + e*as^2b) with --attention-dropout > 0
    MLP                   /t    SwiGLU: e * 4 * sbf (gate|up output, silu output, product); GeLU: e * 2 * sbf

``KORTHIKANTI`` (n = e, one attention output copy, no RoPE copies, sharded SP inputs, math attention) gives
exactly Korthikanti et al.'s sbh(34 + 5as/h) for a GPT-3 block in fp16, sbh(10 + 24/t + 5as/(ht)) with TP,
sbh/t(34 + 5as/h) with TP+SP and 34sbh/t with selective recompute. ``TRICORN`` is what tricorn's block keeps:
fp32 norm inputs (n = 4), the fused QKV output alive beside the RoPE'd q and k, the transposed attention output
copied for the out projection, flash attention, and under SP the all-gathered inputs of the column-parallel
linears (the sequence is gathered before the matmul and autograd keeps it).

Recompute: selective drops the attention-core terms and the spare output copy ("core_attn"), the MLP
intermediates ("mlp"), the norms' outputs ("norm"). Full keeps only each layer's input (e*sbh, /t under SP)
plus, during backward, one recompute group's full activations.

Microbatches in flight on pipeline stage r of p with M microbatches: 1F1B min(p - r, M); interleaved with v
chunks min(2(p - r - 1) + (v - 1)p + 1, Mv) chunk-forwards of L/(pv) layers - on the first stage
L(1 + (p - 1)/(pv)) layers' worth, Korthikanti's factor; GPipe M; no pipeline 1.

Embedding and logits: token ids on the first stage; on the last stage the final norm's input, the head's input
and the logits at their peak: e bytes per logit (the head output) + 8 (two fp32 copies inside the
vocab-parallel cross entropy, one of which, the softmax, is kept for backward), over V/t columns.
Buffers: pipeline send/recv tensors, one DP gradient bucket, ZeRO-3's gathered layer (and its prefetch).
Overhead: CUDA context, cuBLAS/NCCL workspaces (a fixed ``CUDA_OVERHEAD_BYTES`` on GPU, 0 on CPU).

No collectives, no device work.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from tricorn.config import Config, ModelConfig

GiB = 1024**3
CUDA_OVERHEAD_BYTES = 1 * GiB
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq in fp32


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


def bytes_per_param(precision: str, grads_16bit: bool = False) -> tuple[int, int, int, int]:
    """(params, grads, master, optimizer) bytes per parameter for ``precision`` in bf16 | fp16 | fp32."""
    if precision == "fp32":
        return 4, 4, 0, ADAM_STATE_BYTES
    if precision in ("bf16", "fp16"):
        return 2, 2 if grads_16bit else 4, 4, ADAM_STATE_BYTES
    raise ValueError(f"unknown precision '{precision}': use bf16, fp16 or fp32")


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


# ---------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """Everything besides the model shape that decides per-rank memory (a plain record the planner enumerates)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    vpp: int = 1
    micro_batch: int = 1
    num_microbatches: int = 1
    sequence_parallel: bool = False
    recompute: Optional[str] = None  # None | "selective" | "full"
    recompute_method: Optional[str] = None  # "uniform" | "block"
    recompute_num_layers: Optional[int] = None
    recompute_modules: tuple[str, ...] = ("core_attn",)
    zero_stage: int = 0  # 0: no distributed optimizer
    precision: str = "bf16"
    grads_16bit: bool = False
    schedule: str = "1f1b"
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    ddp_bucket_elements: int = 40_000_000
    device: str = "cuda"

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @classmethod
    def from_config(cls, cfg: Config) -> Layout:
        m, p, t = cfg.model, cfg.parallel, cfg.training
        return cls(
            tp=p.tensor_model_parallel_size,
            pp=p.pipeline_model_parallel_size,
            cp=p.context_parallel_size,
            dp=cfg.data_parallel_size,
            vpp=cfg.virtual_stages,
            micro_batch=t.micro_batch_size,
            num_microbatches=cfg.num_microbatches,
            sequence_parallel=p.sequence_parallel and p.tensor_model_parallel_size > 1,
            recompute=m.recompute_granularity,
            recompute_method=m.recompute_method,
            recompute_num_layers=m.recompute_num_layers,
            recompute_modules=tuple(m.recompute_modules or ()),
            zero_stage=p.zero_stage if p.use_distributed_optimizer else 0,
            precision=cfg.param_dtype_name,
            grads_16bit=p.grad_reduce_in_bf16 and cfg.param_dtype_name != "fp32",
            schedule=p.pipeline_schedule,
            first_stage_layers=p.decoder_first_pipeline_num_layers,
            last_stage_layers=p.decoder_last_pipeline_num_layers,
            ddp_bucket_elements=p.ddp_bucket_size or 40_000_000,
            device=cfg.device or "cuda",
        )


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


def layer_params_per_rank(model: ModelConfig, tp: int = 1) -> int:
    h, f, gd = model.hidden_size, model.ffn_size, model.kv_heads * model.head_dim
    q = model.num_attention_heads * model.head_dim
    bias = not model.disable_bias_linear
    norm = h * (2 if model.normalization == "LayerNorm" else 1)
    up = f * (2 if model.swiglu else 1)
    n = 2 * norm
    n += h * (q + 2 * gd) // tp + (q + 2 * gd) // tp * bias  # fused QKV, column parallel
    n += q // tp * h + h * bias  # out projection, row parallel (bias replicated)
    n += h * up // tp + up // tp * bias  # w1 (gate|up), column parallel
    n += f // tp * h + h * bias  # w2, row parallel
    return n


def stage_params_per_rank(model: ModelConfig, layout: Layout, stage: int, layers: int) -> int:
    """Parameters one TP rank of pipeline ``stage`` holds."""
    h, tp = model.hidden_size, layout.tp
    vocab = model.padded_vocab_size(tp)
    n = layers * layer_params_per_rank(model, tp)
    first, last = stage == 0, stage == layout.pp - 1
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


# ---------------------------------------------------------------- activations


@dataclass(frozen=True)
class ActivationProfile:
    """Which tensors an implementation keeps for backward (see the module docstring)."""

    norm_input_bytes: Optional[float]  # bytes per saved norm-input element; None: the activation size e
    cpu_rmsnorm_copies: int  # CPU's unfused rms_norm also keeps the normalised input (another copy)
    norm_stats_bytes: float  # per token and norm (fp32 rstd / mean)
    norm_weight_fp32_copy: bool  # a 16-bit norm weight is cast to fp32 for each forward, and the copy is saved
    cpu_dropout_mask_is_activation: bool  # CPU's dropout keeps a noise tensor of the activation dtype, not 1-byte masks
    flash: bool
    rope_copies: bool  # RoPE'd q and k kept beside the fused QKV output, plus the cos/sin rows per layer
    attention_output_copies: int
    sp_gathered_inputs: bool  # under SP, column-parallel linears keep their all-gathered input

    def norm_bytes(self, e: float, normalization: str, device: str) -> float:
        base = e if self.norm_input_bytes is None else self.norm_input_bytes
        return base * (self.cpu_rmsnorm_copies if device == "cpu" and normalization == "RMSNorm" else 1)

    def mask_bytes(self, e: float, device: str) -> float:
        return e if device == "cpu" and self.cpu_dropout_mask_is_activation else 1


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
    norms = 2 * (profile.norm_bytes(e, model.normalization, device) * sbh + profile.norm_stats_bytes * s * b) / sp_div
    if profile.norm_weight_fp32_copy and e != 4:
        norms += 2 * 4 * h * (2 if model.normalization == "LayerNorm" else 1)
    linear_inputs = 0.0 if "norm" in selective else 2 * e * sbh
    linear_inputs /= 1 if profile.sp_gathered_inputs else sp_div
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
    elif profile.flash:
        core = 4.0 * a * s * b
    else:
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


def stage_activation_bytes(model: ModelConfig, layout: Layout, stage: int, layers: int, profile: ActivationProfile) -> float:
    """Transformer-layer activations alive on ``stage`` at its peak (full recompute: stored inputs + one group)."""
    seq = model.seq_length // layout.cp
    common = dict(
        seq=seq, micro_batch=layout.micro_batch, tp=layout.tp, sequence_parallel=layout.sequence_parallel, device=layout.device
    )
    full_layer = layer_activation_bytes(model, **common, precision=layout.precision, profile=profile)
    in_flight = microbatches_in_flight(layout, stage)
    if layout.recompute != "full":
        per_layer = layer_activation_bytes(
            model,
            **common,
            recompute=layout.recompute,
            recompute_modules=layout.recompute_modules,
            precision=layout.precision,
            profile=profile,
        )
        return per_layer * layers * in_flight
    stored = layer_activation_bytes(model, **common, recompute="full", precision=layout.precision, profile=profile)
    n = max(1, layout.recompute_num_layers or 1)
    if layout.recompute_method == "block":
        recomputed = min(n * layout.vpp, layers)  # per model chunk
        return (recomputed * stored + (layers - recomputed) * full_layer) * in_flight + full_layer
    groups = -(-layers // n)  # uniform: one stored input per group of n layers, one group rebuilt at a time
    return groups * stored * in_flight + min(n, layers) * full_layer


def embedding_logits_bytes(model: ModelConfig, layout: Layout, stage: int, profile: ActivationProfile) -> float:
    s, b, h, tp = model.seq_length // layout.cp, layout.micro_batch, model.hidden_size, layout.tp
    e = activation_element_bytes(layout.precision)
    total = 0.0
    if stage == 0:
        ids = 8 + (9 if tp > 1 else 0)  # int64 token ids; with TP also the local ids and the out-of-range mask
        total += ids * s * b * microbatches_in_flight(layout, 0)
    if stage == layout.pp - 1:
        sp_div = tp if layout.sequence_parallel else 1
        head_input = e * s * b * h / (1 if profile.sp_gathered_inputs else sp_div)
        norm_input = (profile.norm_bytes(e, model.normalization, layout.device) * h + profile.norm_stats_bytes) * s * b / sp_div
        logits = (e + 8) * s * b * model.padded_vocab_size(tp) / tp
        total += norm_input + head_input + logits
    return total


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
    per_stage_total_bytes: list[float] = field(default_factory=list)

    @property
    def model_state_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.master_params_bytes + self.optimizer_state_bytes

    @property
    def total_bytes(self) -> float:
        return (
            self.model_state_bytes + self.activation_bytes + self.embedding_logits_bytes + self.buffer_bytes + self.overhead_bytes
        )

    def to_dict(self) -> dict:
        out = asdict(self)
        out["model_state_bytes"] = self.model_state_bytes
        out["total_bytes"] = self.total_bytes
        return out


def _buffers(model: ModelConfig, layout: Layout, stage_params: int) -> float:
    e = activation_element_bytes(layout.precision)
    total = 0.0
    if layout.pp > 1:  # a received activation and a gradient to send, per direction
        tokens = model.seq_length // layout.cp * layout.micro_batch
        total += 2 * e * tokens * model.hidden_size / (layout.tp if layout.sequence_parallel else 1)
    p_bytes, g_bytes, _, _ = bytes_per_param(layout.precision, layout.grads_16bit)
    if layout.dp * layout.cp > 1:
        total += min(layout.ddp_bucket_elements, stage_params) * g_bytes
    if layout.zero_stage >= 3:  # the layer being computed and the prefetched next one, unsharded
        total += 2 * layer_params_per_rank(model, layout.tp) * p_bytes
    return total


def estimate(
    model: ModelConfig, layout: Layout, profile: ActivationProfile = TRICORN, stages: Optional[tuple[int, ...]] = None
) -> MemoryEstimate:
    """Per-rank memory of every pipeline stage (or only ``stages``); returns the worst one (ties: the first)."""
    if model.vocab_size is None:
        raise ValueError("the vocabulary size is unknown: pass --vocab-size N (or --tokenizer-model FILE)")
    p_b, g_b, m_b, o_b = bytes_per_param(layout.precision, layout.grads_16bit)
    shard = layout.dp * layout.cp  # the distributed optimizer shards over the DP x CP group
    layers = stage_layer_counts(model.num_layers, layout.pp, layout.first_stage_layers, layout.last_stage_layers)
    best: Optional[MemoryEstimate] = None
    totals = []
    for stage, n_layers in enumerate(layers):
        if stages is not None and stage not in stages:
            continue
        n_params = stage_params_per_rank(model, layout, stage, n_layers)
        state = model_state_bytes(
            n_params,
            param_bytes=p_b,
            grad_bytes=g_b,
            master_bytes=m_b,
            optimizer_bytes=o_b,
            dp=shard,
            zero_stage=layout.zero_stage,
        )
        est = MemoryEstimate(
            stage=stage,
            layers_on_stage=n_layers,
            params_on_rank=n_params,
            params_bytes=state.params,
            grads_bytes=state.grads,
            master_params_bytes=state.master_params,
            optimizer_state_bytes=state.optimizer_state,
            activation_bytes=stage_activation_bytes(model, layout, stage, n_layers, profile),
            embedding_logits_bytes=embedding_logits_bytes(model, layout, stage, profile),
            buffer_bytes=_buffers(model, layout, n_params),
            overhead_bytes=CUDA_OVERHEAD_BYTES if layout.device == "cuda" else 0.0,
            microbatches_in_flight=microbatches_in_flight(layout, stage),
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
