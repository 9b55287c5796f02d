"""The float64 reference of an FP8 GEMM (tests/test_fp8.py, tests/workers/fp8_layer.py)."""

from __future__ import annotations

import torch

BF16_U = 2.0**-8  # bf16 unit roundoff: one rounding of a result to bf16 moves it by at most this, relative
FP32_U = 2.0**-24


def dequantized(t: torch.Tensor, dim, dtype: torch.dtype) -> torch.Tensor:
    """The spec of the quantiser, in float64: scale by the largest power of two that keeps max |t| (over all
    of t, or along `dim`) within the format, round to FP8, unscale. Exact in float64 (a power of two)."""
    t = t.double()
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    s = torch.exp2(torch.floor(torch.log2(torch.finfo(dtype).max / amax.clamp(min=1e-30))))
    return (t * s).to(dtype).double() / s


def assert_gemm(actual: torch.Tensor, a: torch.Tensor, b: torch.Tensor, what: str, bf16_roundings: int = 1) -> None:
    """actual (bf16) == a @ b of dequantised FP8 values (float64), within the kernel's roundings.

    The float64 product is exact: FP8 values carry at most 4 significant bits, so each product has 8, and
    the products of these operands span under 2^45 of range, so every partial sum fits float64's 53 bits.
    The kernel accumulates in fp32, (K - 1) * 2^-24 of the sum of |terms| at worst, and rounds the result
    to bf16 once, 2^-8 of it (`bf16_roundings`: more where partial results are summed in bf16, each at
    most 2^-8 of the sum of |terms|); the power-of-two scales add no rounding. Where the reference is an
    exact zero (an operand quantised to zeros) the bound is zero too."""
    exact = a @ b
    absolute = a.abs() @ b.abs()
    bound = bf16_roundings * BF16_U * absolute + a.shape[1] * FP32_U * absolute * (1 + BF16_U)
    err = (actual.double().reshape(exact.shape) - exact).abs()
    assert bool((err <= bound).all()), f"{what}: worst excess over the bound {float((err - bound).max()):.3g}"
