"""Data parallelism: parameters and gradients in contiguous bucketed buffers, reduced while backward runs.

Per model chunk, the trainable parameters are packed in reverse registration
order (roughly the order backward produces their gradients) into buckets of
about --ddp-bucket-size elements (default_bucket_elements), one dtype per
bucket. Each parameter becomes a view of its bucket's flat parameter storage. A
post-accumulate-grad hook puts each gradient into fp32 (or, with
--grad-reduce-in-bf16, bf16) gradient storage and marks the parameter ready;
once every parameter of a bucket is ready, the bucket's reduction may start
(asynchronously, in bucket order, so all ranks issue the same collectives in the
same order).

Gradients land in the buffers in place, with no zeroing pass (Bucket.accumulate):
a parameter's first gradient since its slot was emptied is written (copied) into
the slot, and only later ones are added; slots that got no gradient are zeroed
when their bucket is reduced. Where the parameter and the buffer have the same
dtype (fp32, or 16-bit with --grad-reduce-in-bf16) and the buffer is persistent
(stages 0-1), `param.grad` then IS the slot (torch DDP's gradient_as_bucket_view):
autograd adds every later microbatch's gradient into the buffer itself, and the
hook does nothing but bookkeeping. A 16-bit parameter with fp32 `main_grad` cannot
have a dtype-matching view (autograd keeps .grad in the parameter's dtype), so its
gradient is cast-copied, then added, into main_grad and freed: one pass over it
per microbatch. Megatron removes that pass by fusing the accumulation into the
weight-gradient GEMM (a CUDA kernel writing fp32 from bf16 inputs); torch has
such a GEMM on CUDA only (mm/addmm with out_dtype), so on this CPU-tested code
path the linears keep torch's autograd GEMM and the copy stays.

Stages (Megatron's DDP + distributed optimizer, and ZeRO-2/3):

  0  DDP. `p.main_grad` views one contiguous gradient buffer; gradients
     accumulate locally over microbatches (no communication), and on the last
     microbatch each bucket is all-reduced (sum) over DP x CP - during backward
     with --overlap-grad-reduce, otherwise after it. Memory: params + grads.
  1  Distributed optimizer (ZeRO-1). Buckets are padded to a multiple of the
     DP x CP size; rank r owns the r-th contiguous shard of every bucket. The
     gradient reduction is a reduce-scatter (the owned shard receives the sum);
     after the optimizer step each bucket's parameters are all-gathered from
     the owners - asynchronously with --overlap-param-gather, each module's
     forward pre-hook waiting only for the buckets that hold its parameters.
  2  ZeRO-2. No full-size gradient storage: a bucket's gradients are gathered in
     a transient bucket buffer, reduce-scattered on every microbatch into a
     persistent owned shard (1/DP of the gradients) as soon as the bucket's last
     gradient arrives (whatever --overlap-grad-reduce says), and the buffer is
     released when its reduce-scatter completes. At most MAX_REDUCING buckets
     are in flight: launching one more first waits for the oldest. Peak
     gradient memory per rank: full/DP (the shards) + the bucket filling + the
     MAX_REDUCING in flight (2 buckets; tests/test_data_parallel.py measures it).
  3  ZeRO-3. As 2, with one bucket per layer and the parameters sharded as well
     (zero3.py gathers a layer's parameters around its forward and backward).

MoE experts sit in buckets of their own, reduced (and sharded) over the expert-DP group under expert
parallelism (state.replica_group; expert.py), everything else over DP x CP.

Communication per iteration (N gradient elements on a rank, p = DP x CP size):
stage 0 one all-reduce of N; stages 1-2 a reduce-scatter of N (per microbatch
in stage 2) plus an all-gather of N parameters - the same bytes as the
all-reduce, which is itself a reduce-scatter plus an all-gather.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from tricorn.config import Config, default_bucket_elements
from tricorn.model.init import InitSpec, is_expert, is_hollow
from tricorn.parallel.buckets import plan_buckets
from tricorn.parallel.grads import is_tied_copy, is_tied_embedding
from tricorn.parallel.state import ParallelState
from tricorn.profiling import span

# ZeRO-2/3: transient bucket buffers whose reduce-scatter may be in flight at once. One keeps the peak at
# full/DP + 2 buckets (the one filling, the one reducing) and still overlaps each reduction with the next
# bucket's backward.
MAX_REDUCING = 1


@dataclass(frozen=True)
class DPOptions:
    stage: int  # 0: DDP, 1: distributed optimizer, 2 and 3: ZeRO-2/3
    bucket_size: Optional[int]  # elements; None: default_bucket_elements of each model chunk
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    grad_dtype: torch.dtype = torch.float32

    @property
    def distributed(self) -> bool:
        return self.stage >= 1

    @property
    def sharded_grads(self) -> bool:
        return self.stage >= 2


def dp_options(cfg: Config) -> DPOptions:
    """--zero-stage 2/3 implies the distributed optimizer; --zero-stage 1 alone is plain DDP, as in Megatron."""
    p = cfg.parallel
    return DPOptions(
        stage=p.zero_stage_in_effect,
        bucket_size=p.ddp_bucket_size,
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather and p.zero_stage_in_effect >= 1,
        grad_dtype=torch.bfloat16 if p.grad_reduce_in_bf16 or _main_grads_bf16(cfg) else torch.float32,
    )


def _main_grads_bf16(cfg: Config) -> bool:
    """--use-precision-aware-optimizer --main-grads-dtype bf16: the gradient buffers in bf16 (needs --bf16)."""
    return cfg.training.use_precision_aware_optimizer and cfg.training.main_grads_dtype == "bf16"


@dataclass
class Slot:
    """Where one parameter lives in its bucket (elements)."""

    param: nn.Parameter
    offset: int
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a starts where b does in the same storage. Compared by storage identity and offset, not by
    data_ptr(): a fake tensor (tricorn simulate) has no data pointer to read (torch warns, and will refuse)."""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata and a.storage_offset() == b.storage_offset()


class Bucket:
    """A contiguous run of parameters of one dtype whose gradients are reduced together."""

    written: set[int]  # ids of the parameters whose slot holds a gradient since the buffer was last emptied

    def __init__(self, index: int, params: list[nn.Parameter], opts: DPOptions, group: dist.ProcessGroup):
        self.index = index
        self.group = group
        self.world = dist.get_world_size(group)
        self.sharded_grads = opts.sharded_grads
        self.distributed = opts.distributed
        self.dtype = params[0].dtype
        self.grad_dtype = opts.grad_dtype
        self.slots: list[Slot] = []
        offset = 0
        for p in params:
            self.slots.append(Slot(p, offset, p.numel()))
            offset += p.numel()
        shards = self.world if opts.distributed else 1
        self.numel = math.ceil(offset / shards) * shards  # padding so that every shard has the same size
        self.shard_size = self.numel // shards
        self.lo = (dist.get_rank(group) if opts.distributed else 0) * self.shard_size
        self.hi = self.lo + self.shard_size
        self.param_flat: torch.Tensor = torch.empty(0)  # set by DataParallel; the params view it
        self.param_shard: Optional[torch.Tensor] = None  # ZeRO-3: the persistent owned parameters
        self.grad_flat: Optional[torch.Tensor] = None  # full-size gradients (transient under ZeRO-2/3)
        self.grad_shard: Optional[torch.Tensor] = None  # ZeRO-2/3: the persistent owned gradients
        self.pending: set[int] = set()  # ids of parameters whose gradient has not arrived in this backward
        self.ready = False  # every gradient of this backward has arrived
        self.reduce_work: Optional[dist.Work] = None
        self.gather_work: Optional[dist.Work] = None
        self.written = set()

    def arm(self, expected: Optional[set[int]] = None) -> None:
        """Expect one gradient per parameter from the next backward (or only from the ``expected`` ones)."""
        self.pending = {id(s.param) for s in self.slots}
        if expected is not None:
            self.pending &= expected
        self.ready = False

    def owned(self, slot: Slot) -> tuple[int, int]:
        """Bucket range [a, b) of `slot` inside this rank's shard (a == b when none of it is owned)."""
        a, b = max(slot.offset, self.lo), min(slot.end, self.hi)
        return (a, b) if a < b else (a, a)

    def shard_param(self) -> torch.Tensor:
        return self.param_shard if self.param_shard is not None else self.param_flat[self.lo : self.hi]

    def shard_grad(self) -> torch.Tensor:
        if self.sharded_grads:
            return self.grad_shard
        return self.grad_flat[self.lo : self.hi]

    def grad_accumulator(self) -> torch.Tensor:
        """ZeRO-2/3: the bucket-sized gradient buffer of this microbatch, allocated on first use. Only its
        padding is zeroed: every slot is written by its first gradient (or zeroed by zero_unwritten)."""
        if self.grad_flat is None:
            self.grad_flat = torch.empty(self.numel, dtype=self.grad_dtype, device=self.param_flat.device)
            self.grad_flat[self.slots[-1].end :].zero_()
            self.written = set()
        return self.grad_flat

    def accumulate(self, slot: Slot, grad: torch.Tensor) -> torch.Tensor:
        """Put `grad` into `slot`'s part of the gradient buffer and return that part (flat): written if it is
        the slot's first gradient since the buffer was emptied, added otherwise, left alone when `grad` is
        the slot itself (autograd already added into it: it accumulates into a set .grad in place whenever
        grad mode is off, as in every backward here; nothing runs backward with create_graph)."""
        buffer = self.grad_accumulator() if self.sharded_grads else self.grad_flat
        dst = buffer[slot.offset : slot.end]
        if id(slot.param) not in self.written:
            dst.copy_(grad.reshape(-1))
            self.written.add(id(slot.param))
        elif not _same_memory(grad, dst):
            dst.add_(grad.reshape(-1))
        return dst

    def zero_unwritten(self) -> None:
        """Zero the slots no gradient was written into (a parameter unused this iteration), before a reduction."""
        if self.grad_flat is None or len(self.written) == len(self.slots):
            return
        for s in self.slots:
            if id(s.param) not in self.written:
                self.grad_flat[s.offset : s.end].zero_()
                self.written.add(id(s.param))

    def start_reduce(self) -> None:
        grads = self.grad_accumulator() if self.sharded_grads else self.grad_flat
        self.zero_unwritten()
        if self.world == 1:
            return
        with span("dp reduce bucket %d", self.index):
            if self.distributed:  # in place: the owned shard of the input receives the sum
                self.reduce_work = dist.reduce_scatter_single(grads[self.lo : self.hi], grads, group=self.group, async_op=True)
            else:
                self.reduce_work = dist.all_reduce(grads, group=self.group, async_op=True)

    def finish_reduce(self) -> None:
        if self.reduce_work is not None:
            with span("dp reduce wait bucket %d", self.index):
                self.reduce_work.wait()
            self.reduce_work = None
        if self.sharded_grads and self.grad_flat is not None:
            self.grad_shard.add_(self.grad_flat[self.lo : self.hi])
            self.grad_flat = None  # the bucket memory goes back to the allocator for the next bucket

    def start_param_gather(self) -> None:
        if self.world == 1 or not self.distributed:
            return
        with span("dp gather bucket %d", self.index):
            self.gather_work = dist.all_gather_single(self.param_flat, self.shard_param(), group=self.group, async_op=True)

    def finish_param_gather(self) -> None:
        if self.gather_work is not None:
            with span("dp gather wait bucket %d", self.index):
                self.gather_work.wait()
            self.gather_work = None


def plan_param_buckets(
    params: list[nn.Parameter], bucket_size: int, alone: Callable[[nn.Parameter], bool]
) -> list[list[nn.Parameter]]:
    """Reverse order, one dtype per bucket, a new bucket past `bucket_size` elements; `alone` params get their own.
    FP8 primary weights (--fp8-param-gather, fp8_params.py) are planned apart, in buckets of their own."""
    apart = lambda a, b: a.dtype != b.dtype or alone(a) or alone(b)  # noqa: E731
    return plan_buckets(params, lambda p: p.numel(), bucket_size, apart, group=_is_fp8_primary)


def _is_fp8_primary(p: nn.Parameter) -> bool:
    return getattr(p, "fp8_primary", False)  # fp8_params.FP8_ATTR (that module imports this one)


def _unit_buckets(unit: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """ZeRO-3: a unit's one bucket, or two under --fp8-param-gather: its FP8 weights' and the rest's."""
    fp8 = [p for p in unit if _is_fp8_primary(p)]
    rest = [p for p in unit if not _is_fp8_primary(p)]
    return [g for g in (fp8, rest) if g]


def _contiguous(sizes: list[int], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Zeroed views of one buffer, one per size."""
    flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
    return list(flat.split(sizes)) if sizes else []


def _wait_for_gathers(buckets: list[Bucket]) -> Callable:
    def hook(_module: nn.Module, _args: tuple) -> None:
        for b in buckets:
            b.finish_param_gather()

    return hook


class DataParallel:
    """The gradient (and parameter) buffers of one model chunk and their DP x CP collectives."""

    def __init__(
        self,
        module: nn.Module,
        state: ParallelState,
        opts: DPOptions,
        units: Optional[list[list[nn.Parameter]]] = None,
        init: Optional[InitSpec] = None,  # materialises hollow parameters (model/init.py)
    ):
        self.module = module
        self.opts = opts
        self.group = state.dp_cp_group
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        if units is not None:  # ZeRO-3: one bucket per layer (two with FP8 primary weights), in backward order
            groups = [g for u in reversed(units) for g in _unit_buckets(list(u))]
        else:
            # Megatron: with PP and tied embeddings the two copies sit in buckets of their own, so both
            # stages shard them identically and the embedding all-reduce can act on owned shards only.
            tied = {id(p) for n, p in named if is_tied_embedding(n) or is_tied_copy(p)}
            separate = opts.distributed and state.embedding_group is not None
            size = opts.bucket_size or default_bucket_elements(dist.get_world_size(self.group), sum(p.numel() for p in params))
            # MoE experts sit alone too: their bucket reduces over the expert-DP group (expert.py).
            groups = plan_param_buckets(params, size, lambda p: (separate and id(p) in tied) or is_expert(p))
        self.buckets = [Bucket(i, g, opts, state.replica_group(is_expert(g[0]))) for i, g in enumerate(groups) if g]
        self.slot_of: dict[int, tuple[Bucket, Slot]] = {id(s.param): (b, s) for b in self.buckets for s in b.slots}
        if len(self.slot_of) != sum(len(b.slots) for b in self.buckets) or len(self.slot_of) != len(params):
            raise ValueError("every trainable parameter must sit in exactly one bucket (a parameter shared by two ZeRO-3 units?)")
        self.init = init
        self.units = units is not None
        self._pack_params(state.device, {id(p): n for n, p in named})
        self._allocate_grads(state.device)
        for b in self.buckets:
            b.arm()
        self.in_microbatch = False
        self.is_last = False  # inside the last microbatch of the iteration
        self.cursor = 0  # next bucket whose reduction starts (buckets start in order on every rank)
        self.reducing: list[Bucket] = []  # ZeRO-2/3: launched buckets whose transient buffer is still held
        self.dirty = False  # gradients arrived since the last completed reduction
        self.inject_inf = False  # test hook (see optimizer.py): poison the next gradient
        self.trace: Optional[list[tuple[str, int]]] = None  # ("grad"|"launch", bucket) events when a list
        self.on_bucket_ready: Optional[Callable[[Bucket], None]] = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        if opts.overlap_param_gather and opts.stage in (1, 2):
            self._register_gather_waits()

    # ------------------------------------------------------------ construction

    def _pack_params(self, device: torch.device, names: dict[int, str]) -> None:
        """Move every parameter into its bucket's flat storage (one buffer per dtype; per bucket for ZeRO-3).

        Hollow parameters (built on meta, model/init.py) are materialised here from ``self.init``, one at a
        time; under ZeRO-3 only the owned shard of their bucket is ever allocated (``param_shard``).
        """
        if self.units:  # ZeRO-3 over more than one rank (at DP x CP 1 nothing is sharded: plain buffers)
            for b in self.buckets:
                if any(is_hollow(s.param) for s in b.slots):
                    self._pack_owned_shard(b, device, names)
                else:
                    self._pack_bucket(b, torch.zeros(b.numel, dtype=b.dtype, device=device), names)
            return
        # One buffer per dtype, and one for the FP8 primary weights' buckets, whose 16-bit storage goes once the
        # optimizer has cast them to FP8 (fp8_params.py).
        for dtype, fp8 in {(b.dtype, _is_fp8_primary(b.slots[0].param)) for b in self.buckets}:
            mine = [b for b in self.buckets if b.dtype == dtype and _is_fp8_primary(b.slots[0].param) == fp8]
            for b, view in zip(mine, _contiguous([b.numel for b in mine], dtype, device)):
                self._pack_bucket(b, view, names)

    def _value(self, p: nn.Parameter, names: dict[int, str]) -> torch.Tensor:
        if not is_hollow(p):
            return p.detach()
        if self.init is None:
            raise ValueError("hollow parameters (a model built on meta) need DataParallel(init=InitSpec)")
        return self.init.value(names[id(p)], p, p.device)

    @torch.no_grad()
    def _pack_bucket(self, b: Bucket, flat: torch.Tensor, names: dict[int, str]) -> None:
        b.param_flat = flat
        for s in b.slots:
            view = flat[s.offset : s.end].view_as(s.param)
            view.copy_(self._value(s.param, names))
            s.param.data = view

    @torch.no_grad()
    def _pack_owned_shard(self, b: Bucket, device: torch.device, names: dict[int, str]) -> None:
        """ZeRO-3 from hollow parameters: the owned shard is filled, the flat buffer stays unallocated."""
        b.param_shard = torch.zeros(b.shard_size, dtype=b.dtype, device=device)
        b.param_flat = torch.empty(b.numel, dtype=b.dtype, device=device)  # released below, once the views exist
        for s in b.slots:
            lo, hi = b.owned(s)
            if lo < hi:
                value = self._value(s.param, names).reshape(-1)
                b.param_shard[lo - b.lo : hi - b.lo].copy_(value[lo - s.offset : hi - s.offset])
            s.param.data = b.param_flat[s.offset : s.end].view_as(s.param)
        b.param_flat.untyped_storage().resize_(0)  # (views of 0 bytes cannot be made: torch checks the storage size)

    def _allocate_grads(self, device: torch.device) -> None:
        """Full-size gradient buffer (stages 0-1, `main_grad` views) or the owned gradient shards (2-3)."""
        dtype = self.opts.grad_dtype
        if self.opts.sharded_grads:
            for b, view in zip(self.buckets, _contiguous([b.shard_size for b in self.buckets], dtype, device)):
                b.grad_shard = view
            return
        for b, view in zip(self.buckets, _contiguous([b.numel for b in self.buckets], dtype, device)):
            b.grad_flat = view
            for s in b.slots:
                s.param.main_grad = view[s.offset : s.end].view_as(s.param)

    def _register_gather_waits(self) -> None:
        """--overlap-param-gather: a module's forward waits only for the buckets holding its own parameters."""
        for m in self.module.modules():
            buckets: list[Bucket] = []
            for p in m.parameters(recurse=False):
                if id(p) in self.slot_of and self.slot_of[id(p)][0] not in buckets:
                    buckets.append(self.slot_of[id(p)][0])
            if buckets:
                m.register_forward_pre_hook(_wait_for_gathers(buckets))

    # ------------------------------------------------------------ backward

    @property
    def reduce_this_microbatch(self) -> bool:
        return self.in_microbatch and (self.is_last or self.opts.sharded_grads)

    def _on_grad(self, p: nn.Parameter) -> None:
        bucket, slot = self.slot_of[id(p)]
        grad = p.grad
        if grad is None:
            # torch runs the hook also when a backward gives the parameter no gradient: a weight (a linear's, a norm's,
            # the experts') whose gradient a zero-bubble W computes later (wgrad.py). The W's own backward delivers it here.
            return
        if self.inject_inf:
            grad.view(-1)[0] = float("inf")
            self.inject_inf = False
        slot_grad = bucket.accumulate(slot, grad)
        # Stages 0-1 with matching dtypes: the slot becomes p.grad, so autograd accumulates the next
        # microbatches into it in place (Optimizer.zero_grad sets p.grad to None before the next iteration,
        # whose first gradient is then written afresh). Otherwise the gradient is released now.
        p.grad = slot_grad.view_as(p) if not self.opts.sharded_grads and slot_grad.dtype == p.dtype else None
        self.dirty = True
        bucket.pending.discard(id(p))
        if self.trace is not None:
            self.trace.append(("grad", bucket.index))
        if not bucket.pending and not bucket.ready:
            self._complete(bucket)

    def _complete(self, bucket: Bucket) -> None:
        """Every gradient of this backward has reached ``bucket``."""
        bucket.ready = True
        if self.on_bucket_ready is not None:
            self.on_bucket_ready(bucket)
        # ZeRO-2/3 always reduce a bucket once it is complete: its buffer is transient and must go early.
        if (self.opts.overlap_grad_reduce or self.opts.sharded_grads) and self.reduce_this_microbatch:
            self._launch(ready_only=True)

    def _launch(self, ready_only: bool) -> None:
        while self.cursor < len(self.buckets):
            bucket = self.buckets[self.cursor]
            if ready_only and not bucket.ready:
                return
            bucket.start_reduce()
            if self.trace is not None:
                self.trace.append(("launch", bucket.index))
            self.cursor += 1
            if self.opts.sharded_grads:
                self.reducing.append(bucket)
                while len(self.reducing) > MAX_REDUCING:  # bound the transient buffers: release the oldest
                    self.reducing.pop(0).finish_reduce()

    def wait_reductions(self) -> None:
        for b in self.buckets:
            b.finish_reduce()
        self.reducing = []
        self.cursor = 0
        self.dirty = False

    @contextlib.contextmanager
    def microbatch(self, is_last: bool, expected: Optional[Collection[nn.Parameter]] = None) -> Iterator[None]:
        """Around one backward of this chunk; gradients are reduced only on the last one (every one for ZeRO-2/3).

        ``expected``: the only parameters whose gradients this backward delivers - a zero-bubble W, which runs
        the deferred weight gradients after every other gradient of the chunk is in (pipeline/executor.py).
        A bucket is then complete once its deferred weights are, and one that holds none is complete at once,
        so with --overlap-grad-reduce the last W starts each bucket's reduction from the hook of the last
        weight gradient that writes it."""
        self.in_microbatch, self.is_last = True, is_last
        ids = None if expected is None else {id(p) for p in expected}
        for b in self.buckets:
            b.arm(ids)
        if ids is not None:
            for b in self.buckets:
                if not b.pending:
                    self._complete(b)
        try:
            yield
        finally:
            self.in_microbatch, self.is_last = False, False
        if is_last or self.opts.sharded_grads:
            self._launch(ready_only=False)
        if self.opts.sharded_grads:
            self.wait_reductions()

    def finish_grad_sync(self) -> None:
        """Start whatever has not started (e.g. backward ran outside `microbatch`) and wait for all of it."""
        if self.dirty:
            self._launch(ready_only=False)
        self.wait_reductions()
        if not self.opts.sharded_grads:
            for b in self.buckets:  # a bucket no gradient reached this iteration was never reduced
                b.zero_unwritten()

    def close(self) -> None:
        """Remove the gradient hooks. torch keeps a post-accumulate-grad hook in C++, out of the garbage
        collector's sight, so hook -> self -> parameter -> hook is a cycle nothing collects: left alone, the
        buckets and their process group would outlive the run and die only in interpreter finalization."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.on_bucket_ready = None

    def zero_grad(self) -> None:
        """Empty the gradients for a new iteration: the owned shards (ZeRO-2/3) are zeroed, the full-size
        buffers only forgotten (each slot's first gradient overwrites it; Bucket.accumulate)."""
        for b in self.buckets:
            if self.opts.sharded_grads:
                b.grad_shard.zero_()
                b.grad_flat = None
            b.written = set()
            b.arm()
        self.reducing = []
        self.cursor = 0
        self.dirty = False

    # ------------------------------------------------------------ views for the optimizer

    def owned_grads(self) -> dict[int, torch.Tensor]:
        """id(param) -> the reduced gradient of the part of it this rank owns (1-D; may be empty)."""
        out = {}
        for b in self.buckets:
            shard = b.shard_grad()
            for s in b.slots:
                lo, hi = b.owned(s)
                out[id(s.param)] = shard[lo - b.lo : hi - b.lo]
        return out

    def start_param_gather(self) -> None:
        for b in self.buckets:
            b.start_param_gather()

    def finish_param_gather(self) -> None:
        for b in self.buckets:
            b.finish_param_gather()
