"""Gradient reductions that are not data parallel, and the global gradient norm.

After the last backward of an iteration (Megatron's finalize_model_grads):
- parameters replicated over TP that saw only a sequence shard (`sequence_parallel`
  attribute: norm weights, row biases, and the MoE routers and routed experts under SP) or only
  this rank's heads (--qk-layernorm's per-head norms, at any TP > 1)
  get their gradients all-reduced over the TP group (small ones through flat copies of
  at most COALESCE_BYTES, large ones in place: no transient beyond that);
- with tied embeddings and PP > 1, the first stage's embedding and the last
  stage's head copy all-reduce their gradients over the embedding group, so
  both copies take the same step and stay identical.

The global norm counts every parameter exactly once: TP shards on every TP rank,
TP-replicated parameters on TP rank 0 only, a tied head copy not at all (its
twin on the first stage counts), DP/CP replicas once (their gradients are equal
after the DP reduction; sharded optimizers pass their own DP-sharded squares).
MoE experts are split over EP and replicated over TP: counted on TP rank 0 (under SP
after their TP sum above, so every TP rank holds the same gradient); with expert tensor
parallelism they are TP shards, counted on every TP rank. Their
squares are summed over the ep group (under a sharded optimizer the DP x CP sum
already covers every expert once).
One all-reduce of a scalar over TP x PP (plus DP when grads are DP-sharded, or EP). The norm stays a
device tensor and clipping is branch-free, so neither reads a value on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from tricorn.model.init import INIT_KEY_ATTR, is_expert, is_tp_split
from tricorn.parallel.state import ParallelState
from tricorn.pinned import in_host_memory, pin


def grad_of(p: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient the optimizer uses: fp32 `main_grad` under mixed precision, else `.grad`."""
    return getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad


# Which tensor holds a parameter's gradient; the distributed optimizer passes its owned (DP-sharded) views.
GradFn = Callable[[torch.Tensor], Optional[torch.Tensor]]


def is_tied_copy(p: torch.Tensor) -> bool:
    return hasattr(p, INIT_KEY_ATTR)


def is_tied_embedding(name: str) -> bool:
    return name.endswith("tok_embeddings.weight")


def counts_for_norm(p: torch.Tensor, state: ParallelState) -> bool:
    if is_tied_copy(p):
        return False
    return is_tp_split(p) or state.tp_rank == 0  # experts: TP shards under expert tensor parallelism, else replicas


# Small gradients are reduced through one flat copy of at most this many bytes; a larger contiguous one in place.
# Bounds the transient: under SP the MoE experts' gradients are summed over TP too, and one copy of all of
# them would add a whole stage's expert gradients to the peak.
COALESCE_BYTES = 32 * 2**20


def _all_reduce_coalesced(grads: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    if not grads or dist.get_world_size(group) == 1:
        return
    batch: list[torch.Tensor] = []
    for g in grads:
        if g.is_contiguous() and g.numel() * g.element_size() > COALESCE_BYTES:
            dist.all_reduce(g, group=group)
            continue
        if batch and (sum(b.numel() for b in batch) + g.numel()) * g.element_size() > COALESCE_BYTES:
            _all_reduce_flat(batch, group)
            batch = []
        batch.append(g)
    if batch:
        _all_reduce_flat(batch, group)


def _all_reduce_flat(grads: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """One all-reduce of the gradients' concatenation (one dtype), copied back."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def reduce_sequence_parallel_grads(modules: Iterable[nn.Module], state: ParallelState, grad_fn: GradFn = grad_of) -> None:
    grads = [grad_fn(p) for m in modules for p in m.parameters() if getattr(p, "sequence_parallel", False)]
    _all_reduce_coalesced([g for g in grads if g is not None], state.tp_group)


def reduce_tied_embedding_grads(
    modules: Iterable[nn.Module], state: ParallelState, tied: bool, grad_fn: GradFn = grad_of
) -> None:
    if not tied or state.embedding_group is None:
        return
    grads = []
    for m in modules:
        for name, p in m.named_parameters():
            if (is_tied_embedding(name) and state.is_first_stage) or (is_tied_copy(p) and state.is_last_stage):
                g = grad_fn(p)
                if g is None:  # a stage that did not use it this step still takes part
                    g = p.grad = torch.zeros_like(p)
                grads.append(g)
    _all_reduce_coalesced(grads, state.embedding_group)


def global_grad_norm(
    params: Iterable[torch.Tensor], state: ParallelState, dp_sharded: bool = False, grad_fn: GradFn = grad_of
) -> torch.Tensor:
    """L2 norm over the whole model, every parameter counted once (see module docstring); a 0-dim device tensor."""
    counted = [(p, g) for p in params if (g := grad_fn(p)) is not None and g.numel() and counts_for_norm(p, state)]
    squares = _squares([g for p, g in counted if not is_expert(p)], state.device)
    experts = _squares([g for p, g in counted if is_expert(p)], state.device)
    if state.ep_group is not None and not dp_sharded:  # each ep rank holds other experts (sharded: the DP sum covers ep)
        dist.all_reduce(experts, group=state.ep_group)
    squares = squares + experts
    dist.all_reduce(squares, group=state.mp_group)
    if dp_sharded:
        dist.all_reduce(squares, group=state.dp_cp_group)
    return squares.sqrt()


def _squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of `grads` in fp32 on `device`; one fused kernel per dtype/device group, not a Python loop."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    squares = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)).pow(2).sum()
    if not in_host_memory(grads[0], device):
        return squares
    # With --optimizer-cpu-offload the gradients are host staging buffers; NCCL reduces device tensors only.
    # From pinned memory the copy does not make the host wait (a pageable one is a synchronous cudaMemcpy).
    return pin(squares).to(device, non_blocking=True)


def clip_grads(params: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor, grad_fn: GradFn = grad_of) -> None:
    """Scale the gradients by max_norm / (norm + 1e-6) when the norm is finite and above max_norm; no host read.

    The coefficient is formed in float64 and rounded to fp32, as the scalar path did when the norm was a
    Python float, so the clipped gradients are bitwise the same as before; otherwise the multiply is by 1.0.
    """
    grads = [g for g in (grad_fn(p) for p in params) if g is not None]
    if max_norm <= 0 or not grads:
        return
    if in_host_memory(grads[0], total_norm.device):
        # --optimizer-cpu-offload: the host clips its own gradients, so it reads the norm (reduced on the device):
        # the one device read of an offloaded step, besides the wait for the gradients' copies (optimizer.py).
        norm = total_norm.cpu().double()
    else:
        norm = total_norm.to(grads[0].device, torch.float64)
    clip = torch.isfinite(norm) & (norm > max_norm)
    coef = torch.where(clip, max_norm / (norm + 1e-6), 1.0).to(torch.float32)
    torch._foreach_mul_(grads, coef)
