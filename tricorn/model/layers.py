"""Small building blocks of the decoder: norms in fp32 and rotary position embedding.

The norms compute in fp32 but keep their input in its own dtype for backward (lean.py); RoPE tables are
indexed once per layer and applied by lean.split_qkv_rope, which keeps only those rows. A norm's `weight_grad` hook
(lean.WeightGrad, from the layer spec) may take its weight's gradient to a zero-bubble W (tricorn/parallel/wgrad.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from tricorn.model.lean import WeightGrad, norm


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 whatever the activation dtype (bf16 statistics drift)."""

    def __init__(self, dim: int, eps: float = 1e-5, weight_grad: Optional[WeightGrad] = None):
        super().__init__()
        self.eps, self.weight_grad = eps, weight_grad
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return norm(x, self.weight, None, self.eps, center=False, weight_grad=self.weight_grad)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, weight_grad: Optional[WeightGrad] = None):
        super().__init__()
        self.eps, self.weight_grad = eps, weight_grad
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return norm(x, self.weight, self.bias, self.eps, center=True, weight_grad=self.weight_grad)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's frequency scaling (Hugging Face rope_type "llama3"): wavelengths longer than
    original / low_freq_factor are stretched by `factor`, shorter than original / high_freq_factor kept,
    and those in between interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def rope_inv_freq(head_dim: int, base: float, dtype: torch.dtype, scaling: Optional[RopeScaling] = None) -> torch.Tensor:
    """Inverse frequencies in `dtype`, with the same operations (and so, in float32, the same bits) as transformers."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype) / head_dim))
    if scaling is None:
        return inv_freq
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_context = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """RoPE tables for every position up to max_positions ("rotate half" convention).

    The angles are computed in float64 by default (exact to fp32 rounding at any position); with
    angles_dtype float32 the tables are transformers' and Megatron's bit for bit, which differ by up
    to ~1e-4 at position 2048 (README, "Hugging Face import and export").
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        base: float,
        angles_dtype: torch.dtype = torch.float64,
        scaling: Optional[RopeScaling] = None,
    ):
        super().__init__()
        self.head_dim, self.max_positions, self.base = head_dim, max_positions, base
        self.angles_dtype, self.scaling = angles_dtype, scaling
        self.reset_buffers(None)

    def reset_buffers(self, device) -> None:
        """(Re)compute the tables on `device` (None: the default one; a model built on meta calls it again).
        Computed on the CPU and moved: the same bits on every device."""
        target = torch.empty(0).device if device is None else device  # None: the ambient default (meta in a hollow build)
        # On the CPU even under a `torch.device("meta")` build: meta has no kernels of its own for these ops, and
        # its Python decompositions import torch._dynamo, several seconds of every rank's start-up.
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(self.head_dim, self.base, self.angles_dtype, self.scaling)
            angles = torch.outer(torch.arange(self.max_positions, dtype=self.angles_dtype), inv_freq)
            angles = torch.cat([angles, angles], dim=-1)
        # Buffers, not parameters: never trained, never checkpointed.
        self.register_buffer("cos", angles.cos().float().to(target), persistent=False)
        self.register_buffer("sin", angles.sin().float().to(target), persistent=False)

    def rows(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows for sequence-first activations [s, b, heads, d] of `dtype`: [s, 1, 1, d] for positions
        [s] shared by the samples, [s, b, 1, d] for positions [s, b] of each sample (--reset-position-ids)."""
        if position_ids.dim() == 2:
            return self.cos[position_ids].to(dtype)[:, :, None], self.sin[position_ids].to(dtype)[:, :, None]
        return self.cos[position_ids].to(dtype)[:, None, None], self.sin[position_ids].to(dtype)[:, None, None]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """x: [b, heads, s, d]; position_ids: [s]. (The decoder uses ``rows`` with lean.split_qkv_rope.)"""
        cos = self.cos[position_ids].to(x.dtype)
        sin = self.sin[position_ids].to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
