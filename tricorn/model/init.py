"""Layout-independent initialisation.

Every parameter's full (unsharded) value is drawn from a generator seeded by
the run seed and the parameter's global name, then this rank keeps its slice.
So with one seed the full weights are identical at TP=1 and TP=8, at any PP
split (names carry the global layer index) and any DP. Tensor-parallel layers
describe their slice with a ShardInfo attached to the parameter; the model
itself never knows how it is split.

Cost: each rank draws the full tensor of each of its parameters once, one at a
time (transient memory: the largest single weight). No collectives.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn


@dataclass(frozen=True)
class ShardInfo:
    """How a parameter is cut: `dim` of the global tensor (extent `full_size`) is split
    like torch.chunk into `world` pieces of ceil(full_size / world), and this rank holds
    piece `rank`, zero-padded at its end up to the local size (vocabulary padding).

    Because the real rows follow torch.chunk, a rank's real rows are exactly a
    DTensor Shard(dim) piece of the global tensor - what checkpoints save.
    """

    dim: int
    rank: int
    world: int
    full_size: int

    def real_range(self) -> tuple[int, int]:
        """(global start, number of real rows) of this rank's piece."""
        chunk = -(-self.full_size // self.world)
        start = min(self.rank * chunk, self.full_size)
        return start, min(chunk, self.full_size - start)


SHARD_ATTR = "tricorn_shard"
INIT_KEY_ATTR = "tricorn_init_key"  # a parameter that must equal another one (tied head copy)


def shard_info(p: torch.Tensor) -> Optional[ShardInfo]:
    return getattr(p, SHARD_ATTR, None)


def global_shape(p: torch.Tensor) -> tuple[int, ...]:
    info = shard_info(p)
    shape = list(p.shape)
    if info is not None:
        shape[info.dim] = info.full_size
    return tuple(shape)


def _std_for(name: str, std: float, num_layers: int) -> Optional[float]:
    """None means 'constant' (norm weights 1, biases 0)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias" or "norm" in name:
        return None
    # GPT-2 / Megatron: residual output projections are scaled by 1/sqrt(2L).
    if name.endswith(("attention.wo.weight", "mlp.w2.weight")):
        return std / math.sqrt(2.0 * num_layers)
    return std


def full_value(name: str, shape: tuple[int, ...], std: float, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape, device=device, dtype=torch.float32).normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std: float, num_layers: int) -> None:
    for name, p in model.named_parameters():
        key = getattr(p, INIT_KEY_ATTR, name)
        p_std = _std_for(key, std, num_layers)
        if p_std is None:
            p.fill_(0.0 if key.endswith("bias") else 1.0)
            continue
        full = full_value(key, global_shape(p), p_std, seed, p.device)
        info = shard_info(p)
        if info is None:
            p.copy_(full)
            continue
        start, count = info.real_range()
        p.zero_()
        p.narrow(info.dim, 0, count).copy_(full.narrow(info.dim, start, count))
