"""FLOPs per iteration for tricorn's decoder, hardware FLOPs with recomputation, TFLOP/s and MFU.

Only matrix multiplications are counted (2 FLOPs per multiply-add); norms, RoPE, softmax, activations and the
loss are a few percent of the work and are left out, as in every published MFU.

Forward FLOPs per token and layer, with h hidden, a query heads, g key/value groups, d = h/a (or --kv-channels),
f ffn width, s sequence length, V the padded vocabulary (the formulas below at d = h/a; the code uses a*d):

    q and out projections   2*h*h + 2*h*h           = 4h^2
    k and v projections     2 * 2*h*(g*d)           = 4h^2 * g/a          (GQA: g < a; MHA: g = a)
    attention core          2*s*h (Q K^T) + 2*s*h (P V) = 4sh             (see "causal" below)
    MLP                     SwiGLU: 3 * 2*h*f = 6hf (w1 gate, w3 up, w2 down); GeLU: 2 * 2*h*f = 4hf
    MoE MLP                 router 2*h*E + the k routed experts and the shared expert (active FLOPs)
    head (once, not per layer)  2*h*V                                       (tied or untied: the same matmul)

The embedding lookup does no matmul. Backward costs twice the forward (grad input + grad weight), so

    model FLOPs per iteration = 3 * B * s * (num_layers * layer + head),      B = global batch in samples.

Causal attention: by default the s^2 term is NOT halved - the causal mask's skipped half is still counted, which
is the convention of Megatron-LM, PaLM and torchtitan, so our MFU compares with theirs (and it is what torch's
FlopCounterMode counts). ``causal_halving=True`` halves it, which is closer to the work flash attention does.

Hardware FLOPs add what is computed again: full recompute re-runs the forward of each recomputed layer;
selective recompute re-runs the attention core (and the MLP when ``--recompute-modules`` names it); torch's
non-reentrant checkpoint skips the layer's last matmul when recomputing (``recompute_early_stop``); flash
attention's backward recomputes Q K^T (torch counts its backward as 5 s^2 matmuls, 2.5x the forward).
With MHA, GeLU (f = 4h), no halving and full recompute this is exactly Narayanan et al.'s
96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) (``narayanan_flops``); without recompute it is Megatron-LM's
``num_floating_point_operations`` (``megatron_flops``).

No collectives, no device work (``count_matmul_flops`` runs the function it is given).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from tricorn.config import Config, ModelConfig


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs per token of one transformer layer, by part."""

    qkv: float
    proj: float
    core: float
    mlp: float

    @property
    def total(self) -> float:
        return self.qkv + self.proj + self.core + self.mlp


def layer_forward_flops_per_token(
    model: ModelConfig, seq_length: Optional[int] = None, causal_halving: bool = False
) -> LayerFlops:
    h, s = model.hidden_size, seq_length or model.seq_length
    d, a, g = model.head_dim, model.num_attention_heads, model.kv_heads
    q_width, kv_width = a * d, g * d
    core = 2 * s * q_width * 2  # Q K^T and P V, each 2*s*(a*d) per query token
    if causal_halving:
        core /= 2
    return LayerFlops(
        qkv=2 * h * (q_width + 2 * kv_width),
        proj=2 * q_width * h,
        core=core,
        mlp=mean_mlp_flops(model)[0],
    )


def mean_mlp_flops(model: ModelConfig) -> tuple[float, float]:
    """(MLP forward FLOPs per token, of which the down projections), averaged over the layers.

    An MoE layer does the router (2*h*E), the k experts a token is routed to and the shared expert: the
    active FLOPs, whatever the number of experts (dropped copies are not subtracted)."""
    h, gated = model.hidden_size, 3 if model.swiglu else 2
    total = down = 0.0
    for layer in range(model.num_layers):
        if not model.is_moe_layer(layer):
            total, down = total + 2 * h * model.ffn_size * gated, down + 2 * h * model.ffn_size
            continue
        f = model.moe_router_topk * model.moe_ffn_size + (model.moe_shared_expert_intermediate_size or 0)
        total, down = total + 2 * h * model.num_experts + 2 * h * f * gated, down + 2 * h * f
    return total / model.num_layers, down / model.num_layers


@dataclass(frozen=True)
class IterationFlops:
    """FLOPs of one training iteration over all ranks."""

    model: float  # forward + backward: the numerator of MFU and of TFLOP/s per device
    recompute: float  # activation recomputation (full or selective)
    attention_backward_recompute: float  # flash attention's backward recomputing Q K^T
    tokens: int

    @property
    def hardware(self) -> float:
        return self.model + self.recompute + self.attention_backward_recompute


def iteration_flops(
    model: ModelConfig,
    global_batch_size: int,
    *,
    seq_length: Optional[int] = None,
    vocab_size: Optional[int] = None,
    recompute_granularity: Optional[str] = None,
    recompute_modules: tuple[str, ...] = ("core_attn",),
    recomputed_layers: Optional[int] = None,
    flash_attention: bool = True,
    causal_halving: bool = False,
    recompute_early_stop: bool = True,
) -> IterationFlops:
    """FLOPs of one iteration. ``vocab_size`` is the padded vocabulary the head computes (default: padded for TP=1).

    ``recomputed_layers``: how many layers full recompute re-runs (default all of them).
    ``recompute_early_stop``: torch's non-reentrant checkpoint stops recomputing once every tensor backward needs
    is back, so the layer's last matmul (the MLP down projection, whose output nothing saves) is not re-run.
    Megatron's reentrant recompute re-runs the whole layer: pass False for its count.
    """
    s = seq_length or model.seq_length
    vocab = vocab_size if vocab_size is not None else model.padded_vocab_size(1)
    tokens = global_batch_size * s
    layer = layer_forward_flops_per_token(model, s, causal_halving)
    head = 2 * model.hidden_size * vocab
    model_flops = 3 * tokens * (model.num_layers * layer.total + head)
    # The MLP down projection's output is saved by nothing, so an early-stopping recompute never re-runs it.
    down_proj = mean_mlp_flops(model)[1] if recompute_early_stop else 0
    if recompute_granularity == "full":
        n = model.num_layers if recomputed_layers is None else recomputed_layers
        recompute = tokens * n * (layer.total - down_proj)
    elif recompute_granularity == "selective":
        mlp = layer.mlp - down_proj if "mlp" in recompute_modules else 0
        recompute = tokens * model.num_layers * ((layer.core if "core_attn" in recompute_modules else 0) + mlp)
    elif recompute_granularity is None:
        recompute = 0.0
    else:
        raise ValueError(f"unknown recompute granularity '{recompute_granularity}'")
    attn_bwd = tokens * model.num_layers * layer.core / 2 if flash_attention else 0.0
    return IterationFlops(model_flops, recompute, attn_bwd, tokens)


def recomputed_layer_count(cfg: Config) -> int:
    """Layers that full recompute re-runs: all (uniform), or ``--recompute-num-layers`` per model chunk (block)."""
    m, p = cfg.model, cfg.parallel
    if m.recompute_granularity != "full":
        return 0
    if m.recompute_method == "block" and m.recompute_num_layers is not None:
        chunks = p.pipeline_model_parallel_size * cfg.virtual_stages
        return min(m.recompute_num_layers * chunks, m.num_layers)
    return m.num_layers


def iteration_flops_for_config(
    cfg: Config, *, flash_attention: bool = True, causal_halving: bool = False, global_batch_size: Optional[int] = None
) -> IterationFlops:
    """The FLOPs of one iteration of ``cfg`` (global batch, padded vocabulary for its TP, recompute flags).

    ``global_batch_size`` overrides the configured one (the batch of an iteration during --rampup-batch-size).
    """
    m = cfg.model
    return iteration_flops(
        m,
        global_batch_size or cfg.training.global_batch_size,
        vocab_size=m.padded_vocab_size(cfg.parallel.tensor_model_parallel_size),
        recompute_granularity=m.recompute_granularity,
        recompute_modules=tuple(m.recompute_modules or ()),
        recomputed_layers=recomputed_layer_count(cfg),
        flash_attention=flash_attention,
        causal_halving=causal_halving,
    )


# ---------------------------------------------------------------- published formulas


def narayanan_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. (2021), eq. 3: GPT with MHA, 4h GeLU MLP, full recompute, tied head."""
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def megatron_flops(model: ModelConfig, batch: int, padded_vocab: int) -> float:
    """Megatron-LM's ``num_floating_point_operations`` (training.py, 2024): GQA and SwiGLU aware, no recompute."""
    h, s, l_, a = model.hidden_size, model.seq_length, model.num_layers, model.num_attention_heads
    query_proj_ratio = model.head_dim * a / h
    gated = 3 / 2 if model.swiglu else 1
    return (
        12
        * batch
        * s
        * l_
        * h
        * h
        * ((1 + model.kv_heads / a + s / h) * query_proj_ratio + model.ffn_size / h * gated + padded_vocab / (2 * l_ * h))
    )


# ---------------------------------------------------------------- throughput


def tflops_per_device(flops_per_iteration: float, iteration_time_s: float, world_size: int) -> float:
    return flops_per_iteration / (iteration_time_s * world_size * 1e12)


def mfu(model_flops_per_iteration: float, iteration_time_s: float, world_size: int, peak_tflops: float) -> float:
    """Model FLOPs utilisation: model FLOPs per second per device over the device's peak (0..1)."""
    return tflops_per_device(model_flops_per_iteration, iteration_time_s, world_size) / peak_tflops


# ---------------------------------------------------------------- exact count


def _cpu_flash_mapping() -> dict[Any, Any]:
    """FlopCounterMode knows the CUDA attention kernels but not the CPU flash kernel: count it like them."""
    import torch
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    mapping: dict[Any, Any] = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):

        def fwd(query, key, value, *args, out_shape=None, **kwargs) -> int:
            return fc.sdpa_flop_count(query, key, value)

        def bwd(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
            return fc.sdpa_backward_flop_count(grad_out, query, key, value)

        mapping[aten._scaled_dot_product_flash_attention_for_cpu] = fwd
        mapping[aten._scaled_dot_product_flash_attention_for_cpu_backward] = bwd
    return mapping


def count_matmul_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Run ``fn(*args, **kwargs)`` and return the matmul + attention FLOPs that torch actually dispatched."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False, custom_mapping=_cpu_flash_mapping()) as counter:
        fn(*args, **kwargs)
    return int(counter.get_total_flops())
