"""Activation recomputation: full (layer groups) and selective (core attention, MLP, norm outputs).

Flags (Megatron names):

    --recompute-granularity full --recompute-method uniform --recompute-num-layers N
        every model chunk's layers, in groups of N consecutive layers; each group keeps only its input
    --recompute-granularity full --recompute-method block --recompute-num-layers N
        the first N layers of each model chunk (pipeline stage, or virtual stage), each keeping only its input;
        the other layers keep everything
    --recompute-granularity selective [--recompute-modules core_attn mlp norm mlp_act]   (default core_attn)
        core_attn: the attention core (SDPA) is recomputed from q, k, v
        mlp:       the MLP is recomputed from its input
        norm:      the two norms' outputs (the QKV and MLP input) are dropped after use and rebuilt
                   from the norm input just before the backward needs them (Megatron's CheckpointWithoutOutput)
        mlp_act:   the MLP's activation output (SwiGLU's silu(gate) * up, or GeLU's output: w2's input) is
                   dropped the same way and rebuilt from w1's output (implied by mlp)

Mechanics. Full and core_attn/mlp use ``torch.utils.checkpoint`` (non-reentrant): the forward runs
once without keeping the region's intermediates, and the first backward access re-runs it. A group of N
layers is checkpointed as one region: the group's first layer runs the whole group (calling the others as
modules, so their hooks fire) and the others then pass their input through, so parameter names and the
layer ModuleDict stay as they were.

RNG: dropout masks are drawn by (seed, sample, layer, site, position) (tricorn/model/dropout.py), so a
recomputed region draws them again identically with no RNG bookkeeping. For any other randomness a region
may draw, checkpoint restores the default RNG stream (preserve_rng_state). Recomputation therefore gives bitwise the same loss and gradients as no recomputation.

Collectives: a recomputed region re-runs its collectives during backward (the TP all-reduce or the SP
all-gather / reduce-scatter of a recomputed layer or MLP); every TP rank recomputes the same regions in the
same order, so they stay matched. Nothing here adds a collective of its own.

Memory effect (per layer and microbatch; the formula is in tricorn/planning/activations.py): full keeps
e*s*b*h (the layer input, /TP under SP) per group of N layers, plus one group's full activations while its
backward runs; selective core_attn drops the attention core's saved state (flash: its fp32 log-sum-exp;
math attention: the s x s softmax, dropout mask and dropped probabilities); mlp drops the MLP intermediates;
norm drops the two norm outputs (the sequence shards QKV and w1 save, under SP); mlp_act drops w2's input
(f per token, /TP). Compute: full adds about one forward per step (~+33%), selective much less (norm and
mlp_act: two norms and one elementwise activation per layer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

RECOMPUTE_MODULES = ("core_attn", "mlp", "norm", "mlp_act")
_APPLIED = "_tricorn_recompute"


# ---------------------------------------------------------------- validation


def chunk_layer_counts(cfg: Any) -> list[int]:
    """Layers in each model chunk of the run (one count without PP); empty if the split itself is invalid."""
    from tricorn.parallel.pipeline.stages import StageSplitError, layout_from_config

    try:
        return list(layout_from_config(cfg).counts)
    except StageSplitError:
        return []  # validate_pipeline reports the split


def validate_recompute(cfg: Any) -> list[str]:
    """Every problem with the recompute flags of a Config, one sentence each (before launch)."""
    m = cfg.model
    gran, method, n = m.recompute_granularity, m.recompute_method, m.recompute_num_layers
    errs: list[str] = []
    if gran is None:
        if method is not None or n is not None:
            errs.append("--recompute-method / --recompute-num-layers need --recompute-granularity full")
        return errs
    if gran == "selective":
        if method is not None:
            errs.append("--recompute-method applies to full recompute only; selective recompute covers every layer")
        if n is not None:
            errs.append("selective recompute takes no --recompute-num-layers (it covers every layer); drop the flag")
        unknown = sorted(set(m.recompute_modules or ()) - set(RECOMPUTE_MODULES))
        if unknown:
            errs.append(f"--recompute-modules {' '.join(unknown)} unknown; choose from {' '.join(RECOMPUTE_MODULES)}")
        if not m.recompute_modules:
            errs.append("selective recompute needs at least one of --recompute-modules core_attn mlp norm mlp_act")
        return errs
    if method is None:
        errs.append("--recompute-granularity full needs --recompute-method uniform (groups of N layers) or block (first N)")
    if n is None:
        errs.append("--recompute-granularity full needs --recompute-num-layers N (layers per group, or per stage with block)")
    elif n < 1:
        errs.append(f"--recompute-num-layers must be at least 1, got {n}")
    else:
        counts = chunk_layer_counts(cfg)
        if counts and n > max(counts):
            errs.append(
                f"--recompute-num-layers {n} is more than the {max(counts)} layers of a model chunk on a pipeline stage; "
                f"use 1..{max(counts)}"
            )
    return errs


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class RecomputePlan:
    granularity: Optional[str] = None  # None | "full" | "selective"
    method: Optional[str] = None  # "uniform" | "block" (full only)
    num_layers: int = 1
    modules: tuple[str, ...] = ("core_attn",)

    @classmethod
    def from_model_config(cls, m: Any) -> RecomputePlan:
        return cls(m.recompute_granularity, m.recompute_method, m.recompute_num_layers or 1, tuple(m.recompute_modules or ()))

    def full_groups(self, layer_ids: Sequence[str]) -> list[list[str]]:
        """The checkpointed groups among one chunk's layers (in order) under full recompute."""
        ids = list(layer_ids)
        if self.granularity != "full":
            return []
        if self.method == "block":
            return [[i] for i in ids[: self.num_layers]]
        return [ids[k : k + self.num_layers] for k in range(0, len(ids), self.num_layers)]


def checkpointed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn under non-reentrant torch.utils.checkpoint when autograd records (plain fn otherwise)."""

    def run(*args: Any) -> Any:
        if not torch.is_grad_enabled():
            return fn(*args)
        # No default-generator state to preserve: tricorn's dropout draws from generators keyed by sample, layer and
        # site (model/dropout.py), which the replay rebuilds from the same keys, and nothing else in a layer draws.
        # Preserving it would keep the CPU generator's 5,056-byte state per region (compiled: a saved graph buffer).
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)

    return run


# ---------------------------------------------------------------- full recompute


class _LayerGroup:
    """N consecutive layers recomputed as one region.

    The decoder calls every layer in turn. The first layer's call runs the whole group under one checkpoint,
    calling the other layers as modules (so their hooks - ZeRO-3's gather, the activation probe - fire in
    forward and in the recomputation); when the decoder then calls those layers, they hand their input on.
    """

    def __init__(self, layers: list[nn.Module]):
        self.layers = layers
        self.forwards = [layer.forward for layer in layers]
        self.running = False
        layers[0].forward = checkpointed(self._run)
        for forward, layer in zip(self.forwards[1:], layers[1:]):
            layer.forward = self._member(forward)

    def _run(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        self.running = True
        try:
            x = self.forwards[0](x, *args)  # layer 0's own hooks are already around this call
            for layer in self.layers[1:]:
                x = layer(x, *args)
        finally:
            self.running = False
        return x

    def _member(self, forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(x: torch.Tensor, *args: Any) -> torch.Tensor:
            return forward(x, *args) if self.running else x

        return run


# ---------------------------------------------------------------- selective recompute


def _checkpoint_core_attention(block: nn.Module) -> None:
    attention = block.attention
    attention.spec = dataclasses.replace(attention.spec, core_attention=checkpointed(attention.spec.core_attention))


def _checkpoint_mlp(block: nn.Module) -> None:
    block.mlp.forward = checkpointed(block.mlp.forward)


class _Refill(torch.autograd.Function):
    """Identity on the consumer's output; its backward (before the consumer's) rebuilds the producer's output in
    its emptied storage from the producer's input. The input is saved the autograd way, so saved-tensor hooks
    (activation offload, the probe) see it as the one storage the producer also saved."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, x: torch.Tensor, produce: Callable, storage: Any, nbytes: int) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.produce, ctx.storage, ctx.nbytes = produce, storage, nbytes
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.storage.nbytes() != ctx.nbytes:  # not already rebuilt (a second backward through a retained graph)
            with torch.no_grad():
                again = ctx.produce(ctx.saved_tensors[0])
            ctx.storage.resize_(ctx.nbytes)
            ctx.storage.copy_(again.untyped_storage())
        return grad, None, None, None, None


def _recompute_output(producer: nn.Module, consumer: nn.Module) -> None:
    """Free `producer`'s output once `consumer` (which saved it) has run; rebuild it when consumer's backward starts.

    The storage is emptied in place, so the tensors autograd saved (views of it) stay valid objects and are
    refilled - not replaced - before use; the version counter is untouched, so autograd's checks still hold.
    """
    produce = producer.forward
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = produce(x)
        if torch.is_grad_enabled() and y.requires_grad and y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
            pending.append((x, y))
        return y

    def after_consumer(_module: nn.Module, _args: Any, out: torch.Tensor) -> Optional[torch.Tensor]:
        if not pending:
            return None
        x, y = pending.pop()
        if not (torch.is_grad_enabled() and out.requires_grad):
            return None
        storage = y.untyped_storage()
        nbytes = storage.nbytes()
        storage.resize_(0)
        return _Refill.apply(out, x, produce, storage, nbytes)

    producer.forward = forward
    consumer.register_forward_hook(after_consumer)


# ---------------------------------------------------------------- entry point


def _blocks(chunk: nn.Module) -> dict[str, nn.Module]:
    return dict(chunk.layers.items()) if hasattr(chunk, "layers") else {}


def apply_recompute(chunks: Sequence[nn.Module], model_cfg: Any) -> RecomputePlan:
    """Apply the config's recompute plan to every model chunk of this rank (in place); returns the plan."""
    plan = RecomputePlan.from_model_config(model_cfg)
    if plan.granularity is None:
        return plan
    for chunk in chunks:
        if getattr(chunk, _APPLIED, None) is not None:
            raise RuntimeError("apply_recompute was already applied to this model chunk")
        setattr(chunk, _APPLIED, plan)
        blocks = _blocks(chunk)
        for group in plan.full_groups(list(blocks)):
            _LayerGroup([blocks[i] for i in group])
        if plan.granularity != "selective":
            continue
        for block in blocks.values():
            if "core_attn" in plan.modules:
                _checkpoint_core_attention(block)
            if "mlp" in plan.modules:
                _checkpoint_mlp(block)
            if "norm" in plan.modules:
                _recompute_output(block.attention_norm, block.attention)
                _recompute_output(block.mlp_norm, block.mlp)
            if "mlp_act" in plan.modules and "mlp" not in plan.modules:  # a checkpointed MLP keeps nothing inside
                _recompute_output(block.mlp.act, block.mlp.w2)
    return plan


__all__ = ["RECOMPUTE_MODULES", "RecomputePlan", "apply_recompute", "checkpointed", "validate_recompute"]
