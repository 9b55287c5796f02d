"""FP8 memory terms of one rank: what an FP8 run holds beyond the bf16 estimate (memory.py adds them).

Transformer Engine (`--transformer-impl transformer_engine --fp8-format ...`, tricorn/parallel/te.py), per
rank of a pipeline stage, for the GEMM weights of the dense linears (QKV, out projection, w1, w2; not the
embedding, head, norms, biases or routed experts, which TE does not run):

    weight cache      2 bytes per weight element: the FP8 copy and its transpose (the backward's dgrad GEMM
                      reads the weight column-wise), cast at a global batch's first microbatch and kept;
                      MXFP8 adds one E8M0 scale per 32 elements to each (2/32). Under ZeRO-3 nothing is
                      cached (te.py) but each layer's FP8 copy is saved from its forward to its backward:
                      the same bytes per layer x microbatches in flight (``saved_weights``).
    scales            delayed scaling: each Linear's 3 forward (input, weight, output) and 2 backward (output
                      gradient, input gradient) quantizers keep an fp32 amax history of AMAX_HISTORY_LEN
                      and an fp32 scale and inverse scale; current (tensorwise) scaling only the scales;
                      MXFP8's scales live in the data (counted above).
    saved activations TE quantizes each linear's input and saves the FP8 copy instead of the bf16 tensor:
                      QKV's and w1's inputs (the norm outputs, the sequence shard under SP) and w2's input
                      (the MLP activation's output) at 1 byte per element (+1/32 for MXFP8) instead of e; the
                      out projection's input is also SDPA's output, which attention keeps in bf16, so TE's
                      FP8 copy of it is an extra 1 byte per element (``activation_delta``, per layer and
                      microbatch; it can be negative).

FP8 with recompute is refused for TE (validation), so no recompute variant is modelled here. The native FP8
path (--transformer-impl local) keeps no cache and no history (dynamic scaling): its terms are its own.
No collectives, no device work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tricorn.config import ModelConfig
from tricorn.parallel.te import AMAX_HISTORY_LEN

if TYPE_CHECKING:
    from tricorn.planning.layout import Layout

MX_BLOCK = 32  # MXFP8: one 1-byte scale per 32 elements
FWD_QUANTIZERS, BWD_QUANTIZERS = 3, 2  # per TE Linear (TE's fp8_meta: num_gemms x 3 forward, x 2 backward)


@dataclass(frozen=True)
class Fp8Terms:
    """Bytes on one rank of a stage (module docstring); ``activation_delta`` is per layer and microbatch."""

    weight_cache: float = 0.0
    saved_weights: float = 0.0
    scales: float = 0.0
    activation_delta: float = 0.0

    @property
    def held(self) -> float:
        """What the estimate's FP8 category counts: caches, saved FP8 weights, scales."""
        return self.weight_cache + self.saved_weights + self.scales


def dense_fraction(model: ModelConfig) -> float:
    """The fraction of layers with a dense MLP (whose w1 and w2 are TE Linears; routed experts are not)."""
    if model.num_experts is None:
        return 1.0
    return sum(not model.is_moe_layer(i) for i in range(model.num_layers)) / model.num_layers


def dense_linear_weights(model: ModelConfig, tp: int) -> tuple[float, float]:
    """(weight elements of the TE linears of one layer on a TP rank, TE Linear modules), means over the layers."""
    h, gd, q = model.hidden_size, model.kv_heads * model.head_dim, model.num_attention_heads * model.head_dim
    attention = (h * (q + 2 * gd) + q * h) / tp
    f, dense = model.ffn_size, dense_fraction(model)
    mlp = (h * f * (2 if model.swiglu else 1) + f * h) / tp
    return attention + dense * mlp, 2 + 2 * dense


def fp8_element_bytes(recipe: str) -> float:
    return 1.0 + (1.0 / MX_BLOCK if recipe == "mxfp8" else 0.0)


def te_fp8_terms(model: ModelConfig, layout: Layout, layers: int, in_flight: float) -> Fp8Terms:
    """Transformer Engine's FP8 terms for ``layers`` layers with ``in_flight`` microbatches (module docstring)."""
    recipe = layout.fp8_recipe
    if recipe is None:
        return Fp8Terms()
    weights, modules = dense_linear_weights(model, layout.tp)
    f8 = fp8_element_bytes(recipe)
    copies = 2 * f8 * weights * layers  # the FP8 copy and its transpose
    per_quantizer = {"delayed": (AMAX_HISTORY_LEN + 2) * 4, "tensorwise": 2 * 4}.get(recipe, 0)
    scales = layers * modules * (FWD_QUANTIZERS + BWD_QUANTIZERS) * per_quantizer
    e = 4 if layout.precision == "fp32" else 2
    s, b, h = model.seq_length // layout.cp, layout.micro_batch, model.hidden_size
    sp_div = layout.tp if layout.sequence_parallel else 1
    dense = dense_fraction(model)
    q = model.num_attention_heads * model.head_dim
    delta = (
        s
        * b
        * (
            (1 + dense) * h * (f8 - e) / sp_div  # QKV's (and w1's) inputs in FP8
            + q * f8 / layout.tp  # the out projection's FP8 input, beside SDPA's bf16 output
            + dense * model.ffn_size * (f8 - e) / layout.tp  # w2's input in FP8
        )
    )
    if layout.zero_stage >= 3:
        return Fp8Terms(saved_weights=copies * in_flight, scales=scales, activation_delta=delta)
    return Fp8Terms(weight_cache=copies, scales=scales, activation_delta=delta)


def fp8_terms(model: ModelConfig, layout: Layout, layers: int, in_flight: float) -> Fp8Terms:
    """The FP8 terms of the layout's engine (none without FP8)."""
    if layout.fp8_recipe is None or layout.transformer_impl != "transformer_engine":
        return Fp8Terms()
    return te_fp8_terms(model, layout, layers, in_flight)
