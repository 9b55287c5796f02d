"""Forward and backward of one global batch on one rank, without pipelining.

The loss of microbatch m is sum(per-token loss * mask) / ctx.denominator(m), so gradient accumulation, DP, CP
and PP never rescale anything: the DP (and CP) replicas' gradients are simply summed. The denominator is
Megatron's (`StepContext.denominators`): by default each microbatch's own valid tokens times the microbatches
of the global batch (M per rank x DP), so the objective is the mean over microbatches of each one's token mean;
with --calculate-per-token-loss the valid tokens of the WHOLE global batch. The two agree when every
microbatch has as many valid tokens (no padding). The loss returned (and logged) is the global batch's token
mean either way, as Megatron logs it. The pipeline executor (tricorn.parallel.pipeline) provides the same
function for PP > 1.
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
    num_tokens: torch.Tensor  # valid tokens in the global batch (all DP ranks): the logged loss's denominator
    # Per microbatch of this rank, the denominator of its token-loss sum in the objective (on the device);
    # None: num_tokens (--calculate-per-token-loss, and evaluation).
    denominators: Optional[torch.Tensor] = None
    forward_only: bool = False
    # Applied to each microbatch before the model sees it (context parallel takes its sequence chunk).
    prepare: Callable[[Batch], Batch] = lambda b: b
    # Phase timers of the trainer (e.g. the pipeline's P2P wait); nothing is timed by default.
    timers: Timers = NULL_TIMERS

    def denominator(self, m: int) -> torch.Tensor:
        return self.num_tokens if self.denominators is None else self.denominators[m]


def microbatch_denominators(counts: torch.Tensor, dp_size: int) -> torch.Tensor:
    """Megatron's default loss normalisation (no --calculate-per-token-loss): microbatch m's token-loss sum is
    divided by its valid tokens (at least 1, as Megatron clamps) times the microbatches per rank times DP; DP's sum
    of gradients then averages over every microbatch of the global batch. `counts`: each microbatch's valid tokens."""
    return counts.clamp(min=1) * (counts.numel() * dp_size)


def set_moe_aux_weight(ctx: StepContext, m: int, mb: Batch) -> None:
    """Before microbatch m's backward: its MoE aux losses weigh as its tokens do in the objective (times the loss
    scale): their share of the batch's tokens, or 1 / (microbatches x DP) with Megatron's default normalisation."""
    set_aux_loss_scale(ctx.optimizer.scale_loss(mb.loss_mask.sum() / ctx.denominator(m)))


def microbatch_loss(model: nn.Module, mb: Batch, ctx: StepContext, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the objective's term of microbatch m, its share of the logged loss: token-loss sum / global tokens)."""
    per_token = model(mb.tokens, mb.labels, mb.sample_ids)
    total = (per_token * mb.loss_mask).sum()
    return total / ctx.denominator(m), total.detach().float() / ctx.num_tokens


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
    """Returns this rank's part of the global batch's token-mean loss (detached): its token-loss sums / global tokens."""
    (model,) = chunks
    new_global_batch(chunks)
    total = torch.zeros((), dtype=torch.float32, device=microbatches[0].tokens.device)
    for i, mb in enumerate(microbatches):
        mb = ctx.prepare(mb)
        if ctx.forward_only:  # evaluation: no gradients, so no gradient reductions either
            with torch.no_grad():
                _, logged = microbatch_loss(model, mb, ctx, i)
        else:
            with ctx.optimizer.microbatch(is_last=i == len(microbatches) - 1):
                with span("forward mb%d", i):
                    loss, logged = microbatch_loss(model, mb, ctx, i)
                set_moe_aux_weight(ctx, i, mb)
                with span("backward mb%d", i):
                    ctx.optimizer.scale_loss(loss).backward()
        total += logged
    return total
