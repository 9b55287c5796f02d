"""Autograd functions that keep for backward only what Megatron keeps, in the compute dtype.

torch's generic autograd saves more than the math needs: a norm computed in fp32 keeps an fp32 copy of its
input, RoPE's output beside the fused QKV output, SwiGLU's silu(gate) beside gate and up, and a cross entropy
in fp32 a full fp32 copy of the logits. These functions do the same math and save less:

    norm            input (compute dtype) + fp32 statistics per token (rstd; LayerNorm's mean too)
    split_qkv_rope  q, k, v as three tensors (RoPE applied to q and k), saving only the cos/sin rows
    rope            RoPE alone (after --qk-layernorm's per-head norms), saving only the cos/sin rows
    swiglu          the gate|up input (2f); the output is saved by the next linear
    cross_entropy   the logits in their own dtype + fp32 log-sum-exp per token; the fp32 softmax is computed
                    in chunks of CE_CHUNK_ELEMENTS logits in forward and again in backward, never whole

The statistics and all reductions are in fp32, as before. On CUDA in eager mode `norm` runs torch's fused
F.rms_norm / F.layer_norm instead, which keep the same tensors (see `norm`). Optional `reduce_max` / `reduce_sum` callables
let tricorn.parallel make the cross entropy vocab-parallel without this package calling a collective, and a
`WeightGrad` hook (the layer spec's `weight_grad`) lets it defer a norm's weight gradient to a zero-bubble W
(tricorn/parallel/wgrad.py); without one (the default, and under torch.compile, whose traced backward must not
call back into Python state) the backward computes it.
No collectives here; memory effect: see the table above (planning/activations.py counts it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Optional

import torch
import torch.nn.functional as F

CE_CHUNK_ELEMENTS = 1 << 24  # fp32 logits per chunk of the cross entropy (64 MiB transient)

Reduce = Optional[Callable[[torch.Tensor], torch.Tensor]]
# (the weight tensor the forward received, a thunk computing its gradient) -> the gradient now, or None when the
# hook has queued the thunk to run later (a zero-bubble W: tricorn/parallel/wgrad.py's `defer`).
WeightGrad = Callable[[torch.Tensor, Callable[[], torch.Tensor]], Optional[torch.Tensor]]


def eager_hook(hook: Optional[WeightGrad]) -> Optional[WeightGrad]:
    """`hook` in eager mode; None while torch.compile traces (its backward graph would bake the hook's decision)."""
    return None if torch.compiler.is_compiling() else hook


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """t upcast to fp32 for numerically sensitive math; float64 stays float64 (layer-level tests compare in float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


# ---------------------------------------------------------------- norms


def _norm_weight_grad(product: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return product.flatten(0, -2).sum(0).to(dtype)  # the reduction over tokens, deferred or not


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, center: bool, weight_grad: Optional[WeightGrad]):
        xf = at_least_fp32(x)
        mean = xf.mean(-1, keepdim=True) if center else None
        xc = xf - mean if center else xf
        rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
        y = xc * rstd * at_least_fp32(weight)
        if bias is not None:
            y = y + at_least_fp32(bias)
        ctx.save_for_backward(x, weight, rstd, mean)
        ctx.has_bias = bias is not None
        ctx.weight_grad = weight_grad
        if weight_grad is not None:
            ctx.param = weight  # the tensor received (not its saved copy), for the hook
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd, mean = ctx.saved_tensors
        xhat = ((at_least_fp32(x) - mean) if mean is not None else at_least_fp32(x)) * rstd
        gy = at_least_fp32(grad)
        if ctx.weight_grad is None:
            gw = _norm_weight_grad(gy * xhat, weight.dtype)
        else:  # a deferred gradient keeps only the fp32 product, not x and the output gradient
            gw = ctx.weight_grad(ctx.param, functools.partial(_norm_weight_grad, gy * xhat, weight.dtype))
        gb = gy.flatten(0, -2).sum(0).to(weight.dtype) if ctx.has_bias else None
        gxhat = gy * at_least_fp32(weight)
        gx = gxhat - xhat * (gxhat * xhat).mean(-1, keepdim=True)
        if mean is not None:
            gx = gx - gxhat.mean(-1, keepdim=True)
        return (gx * rstd).to(x.dtype), gw, gb, None, None, None


def norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    eps: float,
    center: bool,
    weight_grad: Optional[WeightGrad] = None,
) -> torch.Tensor:
    """RMSNorm (center=False) or LayerNorm (center=True, with bias) in fp32, saving x in its own dtype; `weight_grad`
    hands the weight's gradient over in _Norm's backward (the fused CUDA kernels compute it in theirs).

    Eager on CUDA: torch's fused kernels (one kernel forward, one backward). They keep exactly what _Norm keeps:
    F.layer_norm (native_layer_norm) the input and fp32 mean and rstd, F.rms_norm (_fused_rms_norm) the input and
    fp32 rstd, both accumulating in fp32 and upcasting a 16-bit input, so planning/activations.py is the same.
    Elsewhere _Norm: on the CPU F.rms_norm is a composite of ~8 aten ops that also keeps its fp32 intermediates
    (the upcast input and the normalised one: > 2 e*sbh more per norm) and the CPU's native_layer_norm keeps a
    16-bit input's mean and rstd in 16 bits (CUDA's in fp32), so the CPU keeps one hand-written
    implementation for both norms, the one the CPU tests measure; under torch.compile inductor fuses _Norm's
    math (forward and backward, one kernel each) and the compiled layer keeps _Norm's saved tensors.
    """
    if x.is_cuda and not torch.compiler.is_compiling():
        shape = (x.shape[-1],)
        return F.layer_norm(x, shape, weight, bias, eps) if center else F.rms_norm(x, shape, weight, eps)
    return _Norm.apply(x, weight, bias, eps, center, eager_hook(weight_grad))


# ---------------------------------------------------------------- QKV split and RoPE


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """x rotated by +angle (sign 1) or -angle (sign -1, the transpose): rotate-half convention, [s, b, heads, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * (sin if sign > 0 else -sin)


class _SplitQKVRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, q_per_group: int):
        # qkv: [s, b, groups, q_per_group + 2, d]; cos, sin: [s, 1, 1, d] or None.
        q = qkv[:, :, :, :q_per_group].flatten(2, 3)
        k, v = qkv[:, :, :, q_per_group], qkv[:, :, :, q_per_group + 1]
        if cos is not None:
            q, k = _rotate(q, cos, sin, 1), _rotate(k, cos, sin, 1)
        ctx.save_for_backward(cos, sin)
        ctx.shape, ctx.q_per_group = qkv.shape, q_per_group
        return q.contiguous(), k.contiguous(), v.contiguous()

    @staticmethod
    def backward(ctx, gq, gk, gv):
        cos, sin = ctx.saved_tensors
        if cos is not None:
            gq, gk = _rotate(gq, cos, sin, -1), _rotate(gk, cos, sin, -1)
        s, b, groups, _, d = ctx.shape
        n = ctx.q_per_group
        grad = gq.new_empty(ctx.shape)
        grad[:, :, :, :n] = gq.reshape(s, b, groups, n, d)
        grad[:, :, :, n] = gk
        grad[:, :, :, n + 1] = gv
        return grad, None, None, None


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, -1), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [s, b, heads, d] rotated by its positions' angles, saving only the cos/sin rows (not x: its producer, a norm
    under --qk-layernorm, keeps its own input)."""
    return _Rope.apply(x, cos, sin)


def split_qkv_rope(
    qkv: torch.Tensor, q_per_group: int, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[s, b, groups, q_per_group + 2, d] -> q [s, b, heads, d], k and v [s, b, groups, d], RoPE'd when cos is given.

    Three fresh tensors, so attention keeps exactly q, k and v and the fused QKV output is freed."""
    return _SplitQKVRope.apply(qkv, cos, sin, q_per_group)


# ---------------------------------------------------------------- SwiGLU


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        return F.silu(h[..., 0::2]) * h[..., 1::2]

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        gate, up = h[..., 0::2], h[..., 1::2]
        sig = torch.sigmoid(gate)
        if torch.compiler.is_compiling():
            # Traced (--torch-compile): dynamo cannot trace out= into strided views, and inductor fuses this
            # out-of-place form into one kernel that writes the interleaved gradient directly.
            d_gate = grad * up * sig * (1 + gate * (1 - sig))
            return torch.stack([d_gate, grad * gate * sig], dim=-1).flatten(-2)
        out = torch.empty_like(h)
        d_gate, d_up = out[..., 0::2], out[..., 1::2]
        # grad * up * sig * (1 + gate * (1 - sig)) and grad * gate * sig, in that order, computed in place in the
        # output (d_up holds the second factor first): no temporary beyond sig.
        torch.mul(grad, up, out=d_gate).mul_(sig)
        torch.neg(sig, out=d_up).add_(1).mul_(gate).add_(1)
        d_gate.mul_(d_up)
        torch.mul(grad, gate, out=d_up).mul_(sig)
        return out


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for interleaved (gate_i, up_i) features, saving only h."""
    return _SwiGLU.apply(h)


# ---------------------------------------------------------------- cross entropy


def _row_chunks(rows: int, width: int) -> Iterator[slice]:
    step = max(1, CE_CHUNK_ELEMENTS // max(width, 1))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def _fp32_rows(flat: torch.Tensor, rows: slice, real: int) -> torch.Tensor:
    chunk = flat[rows].to(at_least_fp32(flat[:0]).dtype, copy=True)  # a copy: the math below is in place
    if real < chunk.shape[-1]:
        chunk[:, real:] = float("-inf")  # padded vocabulary columns never count
    return chunk


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, start: int, real: int, reduce_max: Reduce, reduce_sum: Reduce):
        flat = logits.reshape(-1, logits.shape[-1])
        local = (labels - start).reshape(-1)
        mine = (local >= 0) & (local < real)  # the target column lives in this vocabulary slice
        local = local.masked_fill(~mine, 0)
        lse = torch.empty(flat.shape[0], dtype=at_least_fp32(flat[:0]).dtype, device=logits.device)
        target = torch.empty_like(lse)
        for rows in _row_chunks(flat.shape[0], flat.shape[1]):
            chunk = _fp32_rows(flat, rows, real)
            target[rows] = chunk.gather(-1, local[rows].unsqueeze(-1)).squeeze(-1)
            peak = chunk.amax(-1)
            lse[rows] = peak + chunk.sub_(peak.unsqueeze(-1)).exp_().sum(-1).log()
        target.masked_fill_(~mine, 0.0)
        if reduce_max is not None:  # combine the slices' log-sum-exps: lse = m + log sum_r exp(lse_r - m)
            top = reduce_max(lse.clone())  # a clone: the all-reduce is in place and this slice's lse is used below
            lse = top + reduce_sum((lse - top).exp()).log()
            target = reduce_sum(target)
        ctx.save_for_backward(logits, lse, local, mine)
        ctx.real = real
        return (lse - target).view(labels.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, lse, local, mine = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        grad = torch.empty_like(flat)
        scale = at_least_fp32(grad_loss.reshape(-1))
        for rows in _row_chunks(flat.shape[0], flat.shape[1]):
            softmax = _fp32_rows(flat, rows, ctx.real).sub_(lse[rows].unsqueeze(-1)).exp_()
            softmax.scatter_add_(-1, local[rows].unsqueeze(-1), -mine[rows].unsqueeze(-1).to(softmax.dtype))
            grad[rows] = softmax.mul_(scale[rows].unsqueeze(-1))
        return grad.view_as(logits), None, None, None, None, None


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    start: int = 0,
    real: Optional[int] = None,
    reduce_max: Reduce = None,
    reduce_sum: Reduce = None,
) -> torch.Tensor:
    """Per-token fp32 loss of `logits` [..., V] (columns start .. start + V of the vocabulary, the first `real` of
    them real); with reduce_max / reduce_sum (in-place all-reduces over the vocabulary slices) vocab-parallel."""
    real = logits.shape[-1] if real is None else real
    return _CrossEntropy.apply(logits, labels, start, real, reduce_max, reduce_sum)
