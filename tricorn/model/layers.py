"""Small building blocks of the decoder: norms in fp32 and rotary position embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 whatever the activation dtype (bf16 statistics drift)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps).to(x.dtype)


class Rotary(nn.Module):
    """RoPE tables for every position up to max_positions ("rotate half" convention)."""

    def __init__(self, head_dim: int, max_positions: int, base: float):
        super().__init__()
        self.head_dim, self.max_positions, self.base = head_dim, max_positions, base
        self.reset_buffers(None)

    def reset_buffers(self, device) -> None:
        """(Re)compute the tables on `device` (None: the default one; a model built on meta calls it again)."""
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device) / self.head_dim))
        angles = torch.outer(torch.arange(self.max_positions, dtype=torch.float64, device=device), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        # Buffers, not parameters: never trained, never checkpointed.
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """x: [b, heads, s, d]; position_ids: [s]."""
        cos = self.cos[position_ids].to(x.dtype)
        sin = self.sin[position_ids].to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
