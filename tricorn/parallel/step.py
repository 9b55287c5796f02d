"""Forward and backward of one global batch on one rank, without pipelining.

The loss of a microbatch is sum(per-token loss * mask) / (valid tokens in the
WHOLE global batch), so gradient accumulation, DP, CP and PP never rescale
anything: the DP replicas' gradients are simply summed. The pipeline executor
(tricorn.parallel.pipeline) provides the same function for PP > 1.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
from torch import nn

from tricorn.data.base import Batch
from tricorn.model.moe import set_aux_loss_scale
from tricorn.profiling import span
from tricorn.timers import NULL_TIMERS, Timers


class Optim(Protocol):
    def microbatch(self, is_last: bool, chunk: int = 0, expected: Optional[Collection[torch.Tensor]] = None): ...

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor: ...


@dataclass
class StepContext:
    optimizer: Optim
    num_tokens: torch.Tensor  # valid tokens in the global batch (all DP ranks)
    forward_only: bool = False
    # Applied to each microbatch before the model sees it (context parallel takes its sequence chunk).
    prepare: Callable[[Batch], Batch] = lambda b: b
    # Phase timers of the trainer (e.g. the pipeline's P2P wait); nothing is timed by default.
    timers: Timers = NULL_TIMERS


def set_moe_aux_weight(ctx: StepContext, mb: Batch) -> None:
    """Before a microbatch's backward: its MoE aux losses weigh its share of the batch's tokens (times the loss scale)."""
    set_aux_loss_scale(ctx.optimizer.scale_loss(mb.loss_mask.sum() / ctx.num_tokens))


def microbatch_loss(model: nn.Module, mb: Batch, num_tokens: torch.Tensor) -> torch.Tensor:
    per_token = model(mb.tokens, mb.labels, mb.sample_ids)
    return (per_token * mb.loss_mask).sum() / num_tokens


def new_global_batch(chunks: list[nn.Module]) -> None:
    """Before a global batch's first microbatch: modules that cache per-batch work (Transformer Engine's FP8
    weight casts, tricorn/parallel/te.py) redo it once, since the weights changed at the last step."""
    for chunk in chunks:
        # Found once per chunk, not by walking every module each step (the modules of a chunk never change).
        cachers = chunk.__dict__.get("_batch_cachers")
        if cachers is None:
            cachers = chunk.__dict__["_batch_cachers"] = [m for m in chunk.modules() if hasattr(m, "new_global_batch")]
        for module in cachers:
            module.new_global_batch()


def forward_backward_no_pipelining(chunks: list[nn.Module], microbatches: list[Batch], ctx: StepContext) -> torch.Tensor:
    """Returns this rank's sum of normalised microbatch losses (detached)."""
    (model,) = chunks
    new_global_batch(chunks)
    total = torch.zeros((), dtype=torch.float32, device=microbatches[0].tokens.device)
    for i, mb in enumerate(microbatches):
        mb = ctx.prepare(mb)
        if ctx.forward_only:  # evaluation: no gradients, so no gradient reductions either
            with torch.no_grad():
                loss = microbatch_loss(model, mb, ctx.num_tokens)
        else:
            with ctx.optimizer.microbatch(is_last=i == len(microbatches) - 1):
                with span("forward mb%d", i):
                    loss = microbatch_loss(model, mb, ctx.num_tokens)
                set_moe_aux_weight(ctx, mb)
                with span("backward mb%d", i):
                    ctx.optimizer.scale_loss(loss).backward()
        total += loss.detach().float()
    return total
