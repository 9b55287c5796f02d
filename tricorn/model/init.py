"""Layout-independent initialisation.

Every parameter's full (unsharded) value is drawn from a generator seeded by
the run seed and the parameter's global name, then this rank keeps its slice.
So with one seed the full weights are identical at TP=1 and TP=8, at any PP
split (names carry the global layer index) and any DP. Tensor-parallel layers
describe their slice with a ShardInfo attached to the parameter; the model
itself never knows how it is split.

Cost: each rank draws the full tensor of each of its parameters once, one at a
time (transient memory: the largest single weight); a mixture of experts' stacked
weights are drawn expert by expert under each expert's global name, so a rank
draws only its own experts. No collectives.

Building without memory: the trainer builds the model under the meta device,
turns the parameters into *hollow* ones (right shape, dtype and device, 0-byte
storage; `hollow_parameters`), and lets the owner of their storage materialise
them with `InitSpec.value`: the DP buckets write each value into the flat
buffer, and under ZeRO-3 only the rank's owned shard is ever kept. The values
are the same as `init_weights` gives, at any layout.
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
BUILD_NAME_ATTR = "tricorn_build_name"  # a hollow parameter's name in its model (wrappers may rename it later)
# A routed expert's stacked weights [E, ...]: split over the ep group (a ShardInfo on dim 0), reduced over
# expert-DP. Each expert e has a global name of its own (`expert_name`) for init and checkpoints. Replicated over
# TP, or with expert tensor parallelism each expert's matrix is TP-sliced like a dense weight: EXPERT_TP_ATTR holds
# that ShardInfo, its `dim` counted in one expert's matrix (w1's rows, w2's columns).
EXPERT_ATTR = "tricorn_expert"
EXPERT_TP_ATTR = "tricorn_expert_tp"


def is_expert(p: torch.Tensor) -> bool:
    return getattr(p, EXPERT_ATTR, False)


def expert_tp_info(p: torch.Tensor) -> Optional[ShardInfo]:
    """How one expert's matrix of the stacked expert weight p is split over TP (None: replicated)."""
    return getattr(p, EXPERT_TP_ATTR, None)


def expert_matrix_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The global shape of one expert's matrix of the stacked expert weight p (undoing an expert-TP split)."""
    tp, shape = expert_tp_info(p), tuple(p.shape[1:])
    return shape if tp is None else tuple(tp.full_size if d == tp.dim else n for d, n in enumerate(shape))


def is_tp_split(p: torch.Tensor) -> bool:
    """Whether each TP rank holds a different slice of p (a TP shard), not a replica."""
    info = expert_tp_info(p) if is_expert(p) else shard_info(p)
    return info is not None and info.world > 1


def expert_name(name: str, expert: int) -> str:
    """The global name of expert `expert` of the stacked weight `name`: layers.0.mlp.experts.w1 -> ...experts.3.w1."""
    prefix, leaf = name.rsplit(".", 1)
    return f"{prefix}.{expert}.{leaf}"


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
    if leaf.endswith("bias") or "norm" in name:  # also the MoE router's expert_bias
        return None
    # GPT-2 / Megatron: residual output projections are scaled by 1/sqrt(2L).
    if name.endswith(("attention.wo.weight", "mlp.w2.weight", "mlp.experts.w2", "shared_expert.w2.weight")):
        return std / math.sqrt(2.0 * num_layers)
    return std


def full_value(name: str, shape: tuple[int, ...], std: float, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape, device=device, dtype=torch.float32).normal_(0.0, std, generator=gen)


@dataclass(frozen=True)
class InitSpec:
    """What decides every initial value besides a parameter's global name and shape."""

    seed: int
    std: float
    num_layers: int

    def key(self, name: str, p: torch.Tensor) -> str:
        """The global name p's value is drawn from (a tied head copy draws the embedding's)."""
        return getattr(p, INIT_KEY_ATTR, getattr(p, BUILD_NAME_ATTR, name))

    @torch.no_grad()
    def value(self, name: str, p: torch.Tensor, device: torch.device) -> torch.Tensor:
        """This rank's fp32 piece of p (padding rows zero): the full tensor is drawn, then sliced."""
        key = self.key(name, p)
        p_std = _std_for(key, self.std, self.num_layers)
        if p_std is None:
            return torch.full(tuple(p.shape), 0.0 if key.endswith("bias") else 1.0, device=device)
        info = shard_info(p)
        if is_expert(p):  # each local expert from its own global name: no rank draws the other ranks' experts
            local = torch.empty(tuple(p.shape), device=device)
            for j in range(p.shape[0]):
                full = full_value(expert_name(key, info.real_range()[0] + j), expert_matrix_shape(p), p_std, self.seed, device)
                local[j] = _slice(full, expert_tp_info(p), tuple(p.shape[1:]))
            return local
        return _slice(full_value(key, global_shape(p), p_std, self.seed, device), info, tuple(p.shape))


def _slice(full: torch.Tensor, info: Optional[ShardInfo], shape: tuple[int, ...]) -> torch.Tensor:
    """This rank's piece (`shape`, padding rows zero) of the global value `full` cut as `info` says."""
    if info is None:
        return full
    start, count = info.real_range()
    local = torch.zeros(shape, device=full.device)
    local.narrow(info.dim, 0, count).copy_(full.narrow(info.dim, start, count))
    return local


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std: float, num_layers: int) -> None:
    spec = InitSpec(seed, std, num_layers)
    for name, p in model.named_parameters():
        p.copy_(spec.value(name, p, p.device))


# ---------------------------------------------------------------- building without memory (meta device)


def is_hollow(t: torch.Tensor) -> bool:
    """A parameter built by `hollow_parameters` and not materialised yet."""
    return t.numel() > 0 and t.untyped_storage().nbytes() == 0


def hollow_parameters(model: nn.Module, device: torch.device) -> None:
    """Turn the meta parameters of a model built under ``torch.device("meta")`` into hollow ones on `device`.

    The Parameter objects are replaced (meta tensors cannot change device in place), keeping their attributes,
    and each records its global name, so it can be materialised later by whoever owns its storage (the DP
    buckets: only this rank's shard under ZeRO-3) - call this before anything else holds the parameters.
    Meta buffers are rebuilt on `device` by their module's ``reset_buffers(device)``.
    """
    done: dict[int, nn.Parameter] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for module in model.modules():
        for attr, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in done:
                new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
                new.untyped_storage().resize_(0)  # after wrapping: a FakeTensor Parameter re-sizes its storage
                # Our attributes (shard info, SP marks); not the tensor's own (a FakeTensor keeps its device there).
                new.__dict__.update({k: v for k, v in p.__dict__.items() if k not in new.__dict__})
                setattr(new, BUILD_NAME_ATTR, names[id(p)])
                done[id(p)] = new
            module._parameters[attr] = done[id(p)]
        if any(b is not None and b.is_meta for b in module._buffers.values()):
            module.reset_buffers(device)


def cast_parameter(p: nn.Parameter, dtype: torch.dtype) -> None:
    """p in `dtype`; a hollow parameter changes dtype without being materialised."""
    if not is_hollow(p):
        p.data = p.data.to(dtype)
        return
    p.data = torch.empty(p.shape, dtype=dtype, device=p.device)
    p.untyped_storage().resize_(0)


@torch.no_grad()
def materialize(model: nn.Module, spec: InitSpec, frozen_only: bool = False) -> None:
    """Fill every hollow parameter (only those without gradients: `frozen_only`) with its initial value, one
    parameter at a time."""
    for name, p in model.named_parameters():
        if is_hollow(p) and not (frozen_only and p.requires_grad):
            p.data = spec.value(name, p, p.device).to(p.dtype)
