"""ZeRO-3: parameters sharded over DP x CP, gathered one layer at a time.

A *unit* is a transformer block or another top-level submodule with parameters
(embedding, final norm, head). Each unit's parameters form one bucket
(data_parallel.py) whose flat storage is the full parameter tensor only while
it is needed; otherwise the storage is resized to zero bytes, and each rank
keeps only its persistent owned shard (1/DP of the unit), which the optimizer
updates. The parameters keep their shapes throughout (only storage is freed),
so autograd's saved references to them stay valid.

Around each unit:
  forward pre-hook   all-gather the unit (wait for the prefetch), prefetch the next unit
  forward hook       free the unit; hook its outputs so backward re-gathers it
  pre-backward       (gradient of the unit's output arrives) all-gather it again, prefetch
                     the unit before it
  gradients ready    (all of the unit's gradients accumulated) free it; the gradients are
                     reduce-scattered into the owned shard by data_parallel.py

Build: with a model built hollow (on meta, model/init.py) DataParallel fills only
each unit's owned shard from the initial values, one parameter at a time, so a
rank never holds more than its shard plus the parameter being drawn (and the
unit's flat buffer, allocated once and released as soon as the parameters are
views of it: torch makes no view of a storage smaller than the view).

A recomputed forward inside backward (activation checkpointing) neither frees
nor prefetches. With tied embeddings on one stage the embedding's weight is
also read by the head, so that unit stays gathered from its forward until its
gradients are ready. Anything reading parameters outside forward/backward
(checkpoints) must use `gathered()`.

Collectives: per unit and microbatch one all-gather before forward and one
before backward, one reduce-scatter of its gradients. Memory: parameters 1/DP
plus the gathered units in flight (the current one and one prefetched).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from tricorn.parallel.data_parallel import Bucket, DataParallel


@dataclass(eq=False)
class Unit:
    module: nn.Module
    buckets: list[Bucket]  # one; two with FP8 primary weights (fp8_params.py): the FP8 weights' and the rest's
    index: int
    kept: bool = False  # stays gathered from its forward until its gradients are ready
    gathered: bool = False
    in_backward: bool = False

    @property
    def ready(self) -> bool:
        """Every gradient of this backward has reached the unit's buckets."""
        return all(b.ready for b in self.buckets)


def zero3_units(chunk: nn.Module) -> list[nn.Module]:
    """Modules in forward order whose parameters are gathered together (ModuleDict/ModuleList are expanded)."""
    units: list[nn.Module] = []
    if any(p.requires_grad for p in chunk.parameters(recurse=False)):
        units.append(chunk)
    for child in chunk.children():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            units += [c for c in child.children() if _trainable(c)]
        elif _trainable(child):
            units.append(child)
    return units


def unit_params(module: nn.Module, is_chunk: bool) -> list[nn.Parameter]:
    params = module.parameters(recurse=not is_chunk)
    return [p for p in params if p.requires_grad]


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


class ParamSharder:
    def __init__(self, chunk: nn.Module, modules: list[nn.Module], dp: DataParallel):
        # DataParallel built one bucket per unit (two with FP8 primary weights), in backward (reverse) order.
        bucket_of = {id(sl.param): b for b in dp.buckets for sl in b.slots}
        tied_on_stage = (
            getattr(chunk, "tied", False) and getattr(chunk, "pre_process", False) and getattr(chunk, "post_process", False)
        )
        kept_module = getattr(chunk, "tok_embeddings", None) if tied_on_stage else None
        self.units = []
        for i, m in enumerate(modules):
            mine = list({id(bucket_of[id(p)]): bucket_of[id(p)] for p in unit_params(m, m is chunk)}.values())
            self.units.append(Unit(m, mine, i, kept=m is kept_module))
        self._unit_of_bucket = {id(b): u for u in self.units for b in u.buckets}
        for u in self.units:
            for b in u.buckets:
                if b.param_shard is None:  # built from full parameters: keep the owned part, free the rest
                    b.param_shard = b.param_flat[b.lo : b.hi].clone()
                    _free_storage(b.param_flat)
            u.module.register_forward_pre_hook(self._pre_forward_hook(u))
            u.module.register_forward_hook(self._post_forward_hook(u))
        dp.on_bucket_ready = self._on_grads_ready

    # ------------------------------------------------------------ gather / free

    def _gather(self, u: Unit, wait: bool = True) -> None:
        if not u.gathered:
            for b in u.buckets:
                b.param_flat.untyped_storage().resize_(b.param_flat.numel() * b.param_flat.element_size())
                b.start_param_gather()
            u.gathered = True
        if wait:
            for b in u.buckets:
                b.finish_param_gather()

    def _free(self, u: Unit) -> None:
        if u.gathered:
            for b in u.buckets:
                b.finish_param_gather()  # never free storage a collective is writing
                _free_storage(b.param_flat)
            u.gathered = False
        u.in_backward = False

    def _neighbour(self, u: Unit, step: int) -> Unit | None:
        i = u.index + step
        return self.units[i] if 0 <= i < len(self.units) else None

    # ------------------------------------------------------------ hooks

    def _pre_forward_hook(self, u: Unit):
        def hook(_module: nn.Module, _args: tuple) -> None:
            self._gather(u)
            nxt = self._neighbour(u, +1)
            if nxt is not None and not u.in_backward:
                self._gather(nxt, wait=False)

        return hook

    def _post_forward_hook(self, u: Unit):
        def hook(_module: nn.Module, _args: tuple, output) -> None:
            if u.in_backward:  # recomputation inside backward: the backward that follows needs the unit
                return
            if torch.is_grad_enabled():
                for t in tree_leaves(output):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._pre_backward_hook(u))
            if not u.kept:
                self._free(u)

        return hook

    def _pre_backward_hook(self, u: Unit):
        def hook(_grad: torch.Tensor) -> None:
            if u.ready:  # gradients already done (an output used twice): nothing left to compute
                return
            u.in_backward = True
            self._gather(u)
            prev = self._neighbour(u, -1)
            if prev is not None and not prev.ready:
                self._gather(prev, wait=False)

        return hook

    def _on_grads_ready(self, bucket: Bucket) -> None:
        u = self._unit_of_bucket[id(bucket)]
        if u.ready:
            self._free(u)

    # ------------------------------------------------------------ for the optimizer and checkpoints

    def release_all(self) -> None:
        """Free every gathered unit (after a microbatch, and after the step made gathered copies stale)."""
        for u in self.units:
            self._free(u)

    @contextlib.contextmanager
    def gathered(self, write_back: bool = False) -> Iterator[None]:
        """Full parameters for code outside forward/backward (checkpoint save/load); freed afterwards.

        With `write_back`, values written into the parameters meanwhile (a checkpoint load) go to the owned shards.
        """
        for u in self.units:
            self._gather(u)
        try:
            yield
            if write_back:
                for u in self.units:
                    for b in u.buckets:
                        b.param_shard.copy_(b.param_flat[b.lo : b.hi])
        finally:
            self.release_all()


def _free_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)
