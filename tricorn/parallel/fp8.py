"""Native FP8 (`--transformer-impl local --fp8-format e4m3|hybrid --fp8-recipe tensorwise|rowwise`).

The column- and row-parallel linears of tensor.py run their three GEMMs through `torch._scaled_mm`:

    forward  y  = x  W^T     x: [tokens, in]  W: [out, in]
    dgrad    dx = g  W       g: [tokens, out] (the output gradient)
    wgrad    dW = g^T x

with dynamic scaling: every operand is scaled by a power of two chosen from its current amax (max |value|),
cast to FP8 (e4m3; with `hybrid` the gradient g in e5m2, which has the range gradients need), multiplied in FP8
with fp32 accumulation, and written in bf16. A power-of-two scale makes scaling and unscaling exact, so the only
roundings are the cast to FP8, the fp32 accumulation and the bf16 output. Nothing is kept between steps (no amax
history), so a recomputed forward (--recompute-granularity) quantises exactly as the forward it replays.
The output head, the embedding, attention's core, norms and the MoE experts stay bf16.

Recipes:
- tensorwise: one scale per operand. The input is quantised once in forward and its FP8 copy serves both the
  forward and the weight-gradient GEMM.
- rowwise: one scale per row along the contraction of each GEMM (per token and per output feature in forward,
  per token and per input feature in dgrad, per output and per input feature in wgrad): each GEMM quantises its
  operands afresh from bf16, as torchao's rowwise recipe does.

Scales are layout-independent: an amax is the max over the whole logical tensor (one microbatch), whatever
splits it. Collectives (MAX all-reduces of fp32 amaxes, each a few bytes per tensor or one float per row):
- tensorwise: over TP x CP of this pipeline stage (the ranks that split a microbatch's tokens or features;
  replicated copies give the same max, so one group serves every operand): one all-reduce of [amax(x), amax(W)]
  per linear in forward, one of amax(g) in backward.
- rowwise: a row split over TP (features: the row-parallel input and weight in forward, the column-parallel
  output gradient and weight in dgrad) is reduced over TP; per-feature maxima over tokens (wgrad) over CP; a
  row held whole by the rank (tokens under sequence parallelism) needs nothing. One all-reduce per group per GEMM
  pair, the row maxima of both operands concatenated.
- DP and PP never reduce amaxes: one process scales each microbatch by itself, and so does every DP replica.
- FP8 primary weights (--fp8-param-gather, fp8_params.py): the weight is already FP8 with its scale, so forward
  and backward use it as stored and only the input's (gradient's) amax is reduced.
- Under SP the column-parallel linear all-gathers its input in FP8 (tensorwise: 1 byte an element instead of
  bf16's 2; rowwise: FP8 plus one fp32 scale per token) and, in backward, all-gathers its saved shard again.
Memory effect (saved for backward per linear): tensorwise keeps the FP8 input (its sequence shard under SP) and
two fp32 scales instead of the bf16 input, half the bytes; the weight is the parameter itself (no FP8 copy kept:
it is re-cast in backward with the forward's scale). rowwise keeps the bf16 input like the bf16 path. Transient:
FP8 copies (and one transpose each) of the operands of the GEMM running.

Why not torchao: its float8 training (Float8Linear, hp_tensor_to_float8_dynamic) reduces amaxes over a
DTensor mesh and expects TP through DTensor's parallel styles. tricorn's TP/SP are its own autograd collectives
on plain tensors over gloo/NCCL (tensor.py), which carry no float8 dtypes (FP8 is gathered as bytes here) and
need the amax group chosen per operand. What remains of torchao is a cast and a `_scaled_mm` call, so this is
the thin layer on `_scaled_mm` itself, with no dependency.

`torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=bf16)` computes (a * scale_a) @ (b * scale_b) with the
dequantising (reciprocal) scales. On CUDA it takes `a` row-major and `b` column-major, K and N multiples of 16,
fp32 scales (tensorwise: one element each; rowwise: a (M, 1) and b (1, N)), and for rowwise an e4m3 `b`;
the gradient (e5m2 under hybrid) is therefore always the first operand. `_check_layout` holds the CPU run to
that contract; validation.py refuses sizes the GEMM cannot take (fp8_size_errors).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from tricorn.parallel.tensor import ColumnParallelLinear, RowParallelLinear, all_gather_dim, reduce_scatter_single

DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
GEMM_MULTIPLE = 16  # _scaled_mm on CUDA: the contraction and the second operand's columns are multiples of 16
RECIPES = ("tensorwise", "rowwise")
TINY_AMAX = 1e-30  # an all-zero operand: any scale works; this keeps the power of two finite in fp32


@dataclass(frozen=True)
class FP8Recipe:
    """How this rank's linears run FP8, and the groups their amaxes are reduced over."""

    forward_dtype: torch.dtype
    grad_dtype: torch.dtype
    rowwise: bool
    tp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    amax_group: dist.ProcessGroup  # TP x CP: tensorwise amaxes

    @classmethod
    def from_config(cls, fmt: str, recipe: Optional[str], tp_group, cp_group, amax_group) -> FP8Recipe:
        grad = DTYPES["e5m2" if fmt == "hybrid" else "e4m3"]
        return cls(DTYPES["e4m3"], grad, (recipe or "tensorwise") == "rowwise", tp_group, cp_group, amax_group)

    def linear(self, x, weight, bias, gather: Optional[dist.ProcessGroup] = None, in_split: bool = False) -> torch.Tensor:
        """x W^T (+ bias) in FP8; `gather`, `in_split`: see _FP8Linear."""
        y = _FP8Linear.apply(x, weight, bias, self, gather, in_split)
        seq = x.shape[0] * (1 if gather is None else dist.get_world_size(gather))  # sequence-first, gathered under SP
        return y.view(seq, *x.shape[1:-1], weight.shape[0])


# ---------------------------------------------------------------- scaling


def _max_abs(t: torch.Tensor, dim: Optional[int]) -> torch.Tensor:
    """fp32 max |t| over all of t (dim None) or along `dim` (kept); exact: a max rounds nothing."""
    a = t.abs()
    return (a.amax() if dim is None else a.amax(dim=dim, keepdim=True)).float()


def _reduce_max(amaxes: list[torch.Tensor], group: Optional[dist.ProcessGroup]) -> list[torch.Tensor]:
    """The element-wise max of each amax over `group`, in one all-reduce (None or one rank: as they are)."""
    if group is None or dist.get_world_size(group) == 1:
        return amaxes
    flat = torch.cat([a.reshape(-1) for a in amaxes])
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    return [part.view(a.shape) for part, a in zip(flat.split([a.numel() for a in amaxes]), amaxes)]


def scale_for(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest power of two s with amax * s <= the format's max: scaling by it is exact."""
    top = torch.finfo(dtype).max
    return torch.exp2(torch.floor(torch.log2(top / amax.clamp(min=TINY_AMAX))))


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 of t * scale. The product is exact in t's dtype (a power of two within range), so the cast is the
    one rounding; |t * scale| <= max by construction, and the clamp only guards a scale reduced elsewhere."""
    top = torch.finfo(dtype).max
    return (t * scale.to(t.dtype)).clamp_(-top, top).to(dtype)


def _check_layout(a: torch.Tensor, b: torch.Tensor) -> None:
    """CUDA's _scaled_mm layout (see the module docstring), held on every device so the CPU run checks it."""
    if not (a.stride(1) == 1 and b.stride(0) == 1):
        raise AssertionError(f"_scaled_mm needs a row-major first and a column-major second operand: {a.stride()}, {b.stride()}")


def scaled_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor) -> torch.Tensor:
    """(a / a_scale) @ (b / b_scale) in bf16; a_inv, b_inv are the reciprocal (dequantising) scales. (Not the
    out= variant: it has no meta kernel, so `tricorn simulate`'s fake tensors would run it for real.)"""
    _check_layout(a, b)
    if a.device.type == "cpu" and not is_fake(a):
        return dequantised_mm(a, a_inv, b, b_inv)
    return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=torch.bfloat16)


def dequantised_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor) -> torch.Tensor:
    """The CPU's FP8 GEMM: both operands dequantised to fp32 (exact: an FP8 value times a power of two), one fp32
    GEMM, one rounding to bf16: the product torch 2.13's CPU `_scaled_mm` computes, within the same float64 bound
    (tests/test_fp8.py; on CI's CPU its fast e5m2 path gave the same bits, not asserted). With an e4m3 first operand
    some CPUs (Sapphire Rapids, AVX512-FP16) take its scalar reference loop instead, about 1000x slower (35 s for
    one 1024^3 GEMM), which made FP8 runs on those CPUs unusable.
    CUDA always calls `_scaled_mm`; fake tensors (`tricorn simulate`) too, so the measured peak holds no fp32
    copies that the GPU would not make."""
    return torch.mm(a.float() * a_inv, b.float() * b_inv).to(torch.bfloat16)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def _gather_fp8(q: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """All-gather FP8 rows as bytes (gloo and NCCL carry no float8 dtypes)."""
    if group is None:
        return q
    return all_gather_dim(q.view(torch.uint8), 0, group).view(q.dtype)


# ---------------------------------------------------------------- the three GEMMs


def _forward_operands(x2d, weight, recipe: FP8Recipe, in_split: bool):
    """(xq, x_inv, wq_t, w_inv, scales to save): the forward GEMM's operands, scaled as the recipe says."""
    dtype = recipe.forward_dtype
    stored = getattr(weight, "fp8_data", None)
    if stored is not None:  # an FP8 primary weight (fp8_params.py): cast once per step from its master
        sx = scale_for(_reduce_max([_max_abs(x2d, None)], recipe.amax_group)[0], dtype)
        sw = weight.fp8_scale.clone()  # this forward's scale, whatever the next step writes
        return quantize(x2d, sx, dtype), 1 / sx, stored.t(), 1 / sw, (sx, sw)
    if not recipe.rowwise:
        ax, aw = _reduce_max([torch.stack([_max_abs(x2d, None), _max_abs(weight, None)])], recipe.amax_group)[0]
        sx, sw = scale_for(ax, dtype), scale_for(aw, dtype)
        return quantize(x2d, sx, dtype), 1 / sx, quantize(weight, sw, dtype).t(), 1 / sw, (sx, sw)
    # rowwise: per token of x and per output feature of W, both maxima over the input features
    ax, aw = _reduce_max([_max_abs(x2d, 1), _max_abs(weight, 1)], recipe.tp_group if in_split else None)
    sx, sw = scale_for(ax, dtype), scale_for(aw, dtype)
    return quantize(x2d, sx, dtype), 1 / sx, quantize(weight, sw, dtype).t(), (1 / sw).reshape(1, -1), ()


class _FP8Linear(torch.autograd.Function):
    """x W^T (+ bias) with FP8 GEMMs. `gather`: the SP group whose sequence shards of x are all-gathered
    (column-parallel under SP; the backward reduce-scatters dx back to the shard); `in_split`: W's input
    features are split over TP (row-parallel), else its output features are (column-parallel) or nothing is."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: FP8Recipe, gather: Optional[dist.ProcessGroup], in_split: bool):
        x2d = x.reshape(-1, x.shape[-1])
        xq, x_inv, wq_t, w_inv, scales = _forward_operands(x2d, weight, recipe, in_split)
        if recipe.rowwise and gather is not None:  # each token's scale travels with its row
            x_inv = all_gather_dim(x_inv, 0, gather)
        # [tokens, out]; FP8Recipe.linear views it in x's shape outside this Function (autograd forbids in-place
        # ops, such as the TP reduction that follows a row-parallel linear, on a view a custom Function returns)
        y = scaled_mm(_gather_fp8(xq, gather), x_inv, wq_t, w_inv)
        if bias is not None:
            y = y + bias
        # tensorwise: the FP8 input (shard) and its scales; rowwise: the bf16 input (shard), requantised per GEMM
        # An FP8 primary weight (fp8_params.py) is not saved: backward uses its FP8 data (a saved tensor would come
        # back without its attributes), and its 16-bit parameter holds no storage.
        ctx.fp8_weight = getattr(weight, "fp8_data", None)
        keep = (weight,) if ctx.fp8_weight is None else ()
        ctx.save_for_backward(*((xq, *scales) if not recipe.rowwise else (x2d,)), *keep)
        ctx.recipe, ctx.gather, ctx.in_split, ctx.has_bias = recipe, gather, in_split, bias is not None
        ctx.x_shape, ctx.weight_shape = x.shape, weight.shape
        return y

    @staticmethod
    def backward(ctx, grad):
        recipe, gather = ctx.recipe, ctx.gather
        saved = list(ctx.saved_tensors)
        weight = saved.pop() if ctx.fp8_weight is None else None
        g2d = grad.reshape(-1, grad.shape[-1])
        # Under SP the input's shard is gathered again, overlapped with the input-gradient GEMM.
        overlap = gather is not None
        if overlap:
            shard = saved[0]
            held = shard.view(torch.uint8) if shard.dtype in DTYPES.values() else shard
            full = held.new_empty((dist.get_world_size(gather) * held.shape[0], held.shape[1]))
            gathering = dist.all_gather_single(full, held, group=gather, async_op=True)
        if recipe.rowwise:
            dx, finish_wgrad = _rowwise_backward(g2d, saved[0], weight, recipe, ctx.in_split)
        else:
            dx, finish_wgrad = _tensorwise_backward(g2d, saved, weight, recipe, ctx.fp8_weight)
        dx = dx.view(*grad.shape[:-1], ctx.weight_shape[1])
        if overlap:
            gathering.wait()
            x_full = full.view(saved[0].dtype)
            dx_shard = dx.new_empty((dx.shape[0] // dist.get_world_size(gather),) + dx.shape[1:])
            scatter = reduce_scatter_single(dx_shard, dx.contiguous(), gather, async_op=True)
        else:
            x_full, dx_shard = saved[0], dx
        grad_weight = finish_wgrad(x_full)  # overlaps the reduce-scatter
        grad_bias = g2d.sum(0) if ctx.has_bias else None
        if overlap:
            scatter.wait()
        return dx_shard.view(ctx.x_shape), grad_weight, grad_bias, None, None, None


def _tensorwise_backward(g2d, saved, weight, recipe: FP8Recipe, stored: Optional[torch.Tensor] = None):
    """dx now, and a function of the (gathered) FP8 input giving dW: one scale for g serves both GEMMs."""
    _xq, sx, sw = saved
    dtype = recipe.grad_dtype
    sg = scale_for(_reduce_max([_max_abs(g2d, None)], recipe.amax_group)[0], dtype)
    gq = quantize(g2d, sg, dtype)
    # The weight again, with the forward's scale: the same FP8 values as the forward used (an FP8 primary weight's own).
    wq = quantize(weight, sw, recipe.forward_dtype) if stored is None else stored
    dx = scaled_mm(gq, 1 / sg, _column_major(wq), 1 / sw)

    def wgrad(xq_full: torch.Tensor) -> torch.Tensor:
        return scaled_mm(gq.t().contiguous(), 1 / sg, _column_major(xq_full), 1 / sx)

    return dx, wgrad


def _rowwise_backward(g2d, x_saved, weight, recipe: FP8Recipe, in_split: bool):
    """dgrad scaled per token of g and per input feature of W (maxima over the output features, split over TP
    in a column-parallel linear); wgrad per output feature of g and per input feature of x (maxima over tokens,
    split over CP)."""
    fwd, gdt = recipe.forward_dtype, recipe.grad_dtype
    ag, aw = _reduce_max([_max_abs(g2d, 1), _max_abs(weight, 0)], None if in_split else recipe.tp_group)
    sg, sw = scale_for(ag, gdt), scale_for(aw, fwd)
    dx = scaled_mm(quantize(g2d, sg, gdt), 1 / sg, _column_major(quantize(weight, sw, fwd)), 1 / sw)

    def wgrad(x_full: torch.Tensor) -> torch.Tensor:
        agt, axt = _reduce_max([_max_abs(g2d, 0), _max_abs(x_full, 0)], recipe.cp_group)
        sgt, sxt = scale_for(agt, gdt), scale_for(axt, fwd)
        a = quantize(g2d, sgt, gdt).t().contiguous()  # [out, tokens], row-major
        return scaled_mm(a, (1 / sgt).reshape(-1, 1), _column_major(quantize(x_full, sxt, fwd)), 1 / sxt)

    return dx, wgrad


# ---------------------------------------------------------------- wiring


def fp8_spec(spec, recipe: FP8Recipe):
    """`spec` whose column/row linears run FP8 GEMMs (tensor.py calls `recipe` from their local GEMM)."""
    return dataclasses.replace(
        spec,
        column_linear=functools.partial(_with_recipe, spec.column_linear, recipe),
        row_linear=functools.partial(_with_recipe, spec.row_linear, recipe),
    )


def _with_recipe(build, recipe: FP8Recipe, *args, **kwargs) -> nn.Module:
    module = build(*args, **kwargs)
    if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        raise TypeError(f"native FP8 runs tricorn's own linears; got {type(module).__name__}")
    module.fp8 = recipe
    return module


def fp8_size_errors(cfg) -> list[str]:
    """Sizes the FP8 GEMM cannot take (not multiples of 16), named, one sentence."""
    m, p = cfg.model, cfg.parallel
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    ffn_rows = m.ffn_size * (2 if m.swiglu else 1)
    sizes = {
        "--hidden-size": m.hidden_size,
        "query/key/value projection width per TP rank": m.kv_heads * (m.num_attention_heads // m.kv_heads + 2) * m.head_dim // tp,
        "attention output width per TP rank (heads x head dim / TP)": m.num_attention_heads * m.head_dim // tp,
        "MLP input width per TP rank (--ffn-hidden-size" + (" x 2 for SwiGLU" if m.swiglu else "") + " / TP)": ffn_rows // tp,
        "tokens per microbatch per CP rank (--micro-batch-size x --seq-length / CP)": cfg.training.micro_batch_size
        * m.seq_length
        // cp,
    }
    bad = [f"{name} {size}" for name, size in sizes.items() if size % GEMM_MULTIPLE]
    if not bad:
        return []
    return [f"--fp8-format needs GEMM sizes that are multiples of {GEMM_MULTIPLE}; not: {', '.join(bad)}"]


def validate_fp8(cfg) -> list[str]:
    """Every problem with native FP8 (--transformer-impl local) in a Config, one sentence each (before launch)."""
    m, t = cfg.model, cfg.training
    if not t.fp8_format or m.transformer_impl != "local":
        return []
    errs = []
    if t.fp8_recipe and t.fp8_recipe not in RECIPES:
        errs.append(
            f"--fp8-recipe {t.fp8_recipe} needs --transformer-impl transformer_engine; "
            f"with --transformer-impl local use {' or '.join(RECIPES)}"
        )
    if t.fp16:
        errs.append("--fp8-format with --transformer-impl local needs --bf16, not --fp16 (its FP8 GEMMs write bf16)")
    if m.num_experts is not None:
        errs.append(
            "--fp8-format with --transformer-impl local does not run MoE experts (their token counts per expert vary, "
            "and the FP8 GEMM needs multiples of 16); drop --num-experts or --fp8-format"
        )
    if m.torch_compile:
        errs.append("--fp8-format with --transformer-impl local runs eagerly; drop --torch-compile")
    return errs + fp8_size_errors(cfg)
