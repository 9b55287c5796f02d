"""FP8 primary weights (--fp8-param-gather, native FP8 tensorwise): the FP8 linears' weights live in FP8.

Which: the weights of every column- and row-parallel linear that runs FP8 (fp8.py): QKV, the attention output
projection, w1, w2. Norms, biases, the embedding and the head stay 16-bit.

Storage: those weights sit in DP buckets of their own (data_parallel.py plans them apart, as Megatron keeps one
buffer per dtype; ZeRO-3 gives each unit one bucket of them beside its 16-bit one), whose parameter storage is
FP8 bytes, 1 per element. Each weight keeps an nn.Parameter of its shape and 16-bit dtype without storage (its
gradient arrives in bf16 and goes to the fp32 main_grad as every gradient does) and carries ``fp8_data``, the
float8 view of its bucket, and ``fp8_scale``, the 0-d fp32 power of two it was cast with. The fp32 master in the
optimizer is the source of truth; there is no bf16 copy of these weights anywhere.

The step (``cast``): after AdamW has updated the masters, each weight's amax (max |value|) over its whole logical
tensor (every rank's owned master ranges: one MAX all-reduce over the stage's TP x DP x CP ranks of one fp32 per
weight), the largest power of two that keeps it inside e4m3 (fp8.scale_for), and each owner casts its master range
into its FP8 bucket shard (fp8.quantize). The distributed optimizer then all-gathers FP8 bytes, half of bf16's,
and ZeRO-3 gathers a unit's FP8 bytes before its forward and backward. The scale travels by that all-reduce: every
rank holds every weight's scale, so the gather carries only the bytes. One process computes the same amax (of its
full master), the same scale and the same cast, element by element: the gathered weight equals one process's cast.

The linears (fp8.py) then use the stored FP8 weight and its scale in forward (x W^T) and backward (g W) instead of
casting the weight each GEMM; only the input's and the gradient's amaxes are still reduced. Memory: parameters
1 byte per element for these weights instead of 2, ZeRO-3's gathered units likewise; the scales are one fp32 per
weight. Collectives: the amax all-reduce per step (and per checkpoint load); the gathers are the existing ones.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from tricorn.config import Config
from tricorn.parallel.data_parallel import Bucket, DataParallel
from tricorn.parallel.fp8 import quantize, scale_for
from tricorn.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from tricorn.pinned import host_buffer, is_pinned

FP8_ATTR = "fp8_primary"  # marks a weight stored in FP8 (set before DataParallel plans its buckets)
STORAGE = torch.uint8  # FP8 bytes: collectives (gloo, NCCL) carry no float8 dtypes


def is_fp8_primary(p: torch.Tensor) -> bool:
    return getattr(p, FP8_ATTR, False)


def mark_fp8_weights(modules: list[nn.Module]) -> list[nn.Parameter]:
    """Mark the weights of the native FP8 linears (those with an FP8Recipe) as FP8 primary weights."""
    marked = []
    for chunk in modules:
        for m in chunk.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.fp8 is not None and m.weight.requires_grad:
                setattr(m.weight, FP8_ATTR, True)
                marked.append(m.weight)
    return marked


def validate_fp8_param_gather(cfg: Config) -> list[str]:
    """--fp8-param-gather's combinations it cannot honour, one sentence each (before launch)."""
    t, m, p = cfg.training, cfg.model, cfg.parallel
    if not t.fp8_param_gather:
        return []
    if not t.fp8_format:
        return ["--fp8-param-gather needs --fp8-format e4m3|hybrid: without FP8 GEMMs there is no FP8 weight to keep"]
    errs = []
    if m.transformer_impl == "transformer_engine":
        errs.append(
            "--fp8-param-gather runs with native FP8 (--transformer-impl local) only; with Transformer Engine tricorn "
            "does not build TE's FP8 parameters: drop --fp8-param-gather or use --transformer-impl local"
        )
    if p.zero_stage_in_effect == 0:
        errs.append(
            "--fp8-param-gather needs --use-distributed-optimizer (or --zero-stage 2/3): it is the parameter all-gather "
            "that moves FP8 bytes, and plain DDP has none"
        )
    if m.transformer_impl == "local" and (t.fp8_recipe or "tensorwise") != "tensorwise":
        errs.append(
            f"--fp8-param-gather with --transformer-impl local needs --fp8-recipe tensorwise (one scale per weight); "
            f"{t.fp8_recipe} scales every row of each GEMM afresh"
        )
    return errs


def _view_as(flat: torch.Tensor, offset: int, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return flat[offset : offset + p.numel()].view(dtype).view(p.shape)


class FP8Params:
    """The FP8 buckets of an optimizer, their scales, and the cast from the masters (module docstring)."""

    def __init__(self, data_parallel: list[DataParallel], shards: list, dtype: torch.dtype, group: dist.ProcessGroup):
        self.dtype, self.group = dtype, group
        self.shards = [s for s in shards if any(is_fp8_primary(sl.param) for sl in s.bucket.slots)]
        self.params = [sl.param for s in self.shards for sl in s.bucket.slots]
        self.index = {id(p): k for k, p in enumerate(self.params)}
        device = self.shards[0].bucket.param_flat.device if self.shards else torch.device("cpu")
        self.scales = torch.ones(len(self.params), dtype=torch.float32, device=device)
        # Each shard's entries' weights in self.params, a LongTensor on the device built once (a Python list as an
        # index would be a host tensor copied over, blocking, at every cast).
        self.positions = [
            torch.tensor([self.index[id(p)] for p, *_ in s.entries], dtype=torch.long, device=device) for s in self.shards
        ]
        # --optimizer-cpu-offload: the masters are on the host, and so is the cast. Every scale comes over in one
        # copy per cast into pinned memory (as the gradients do: shard_state.py), and each shard's FP8 bytes go back
        # from its pinned staging buffer (the 16-bit one ShardState made for this bucket, of twice the bytes needed).
        offloaded = any(s.param_staging is not None for s in self.shards)
        self.host_scales = host_buffer(len(self.params), torch.float32, True) if offloaded else None
        self.zero3 = any(b.param_shard is not None for dp in data_parallel for b in dp.buckets)
        for s in self.shards:
            self._to_fp8_storage(s.bucket)
            s.fp8 = True  # its copy to the parameters is this module's cast, after the amax all-reduce
        for k, p in enumerate(self.params):
            p.fp8_scale = self.scales[k]

    # ------------------------------------------------------------ storage

    @torch.no_grad()
    def _to_fp8_storage(self, b: Bucket) -> None:
        """Replace the bucket's 16-bit parameter storage by FP8 bytes; each weight keeps a storage-less 16-bit
        Parameter (for autograd) and gets ``fp8_data``, the float8 view of its slot."""
        device = b.param_flat.device
        flat = torch.zeros(b.numel, dtype=STORAGE, device=device)
        for sl in b.slots:
            sl.param.fp8_data = _view_as(flat, sl.offset, sl.param, self.dtype)
        if self.zero3:  # the owned FP8 shard is persistent; the flat buffer only while the unit is gathered
            b.param_shard = torch.zeros(b.shard_size, dtype=STORAGE, device=device)
            flat.untyped_storage().resize_(0)  # (the parameters already view ZeRO-3's freed 16-bit buffer)
        else:
            hollow = torch.empty(b.numel, dtype=b.dtype, device=device)
            for sl in b.slots:
                sl.param.data = _view_as(hollow, sl.offset, sl.param, b.dtype)
            hollow.untyped_storage().resize_(0)  # views made first: torch makes no view of a storage smaller than it
        b.param_flat = flat
        b.dtype = STORAGE

    # ------------------------------------------------------------ the cast

    def cast_all(self, start_gathers: bool) -> None:
        """Every FP8 weight from its master: the global amaxes, the scales, the cast of each owned range, and (ZeRO-1/2)
        each bucket's all-gather of FP8 bytes."""
        if not self.shards:
            return
        amax = torch.zeros(len(self.params), dtype=torch.float32, device=self.scales.device)
        for s, positions in zip(self.shards, self.positions):
            if s.entries:
                local = torch._foreach_norm([s.master[lo:hi] for _, lo, hi, _ in s.entries], float("inf"))
                amax.index_copy_(0, positions, torch.stack(local).to(amax.device, torch.float32))
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        self.scales.copy_(scale_for(amax, self.dtype))
        if self.host_scales is not None:  # the host casts: every scale in one copy, and one wait for it
            self.host_scales.copy_(self.scales, non_blocking=is_pinned(self.host_scales))
            if self.scales.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
        for s in self.shards:
            self.cast_shard(s)
            if start_gathers:
                s.bucket.start_param_gather()

    def cast_shard(self, s) -> None:
        """The owned master range of one FP8 bucket, cast with each weight's scale into the bucket's FP8 shard."""
        target = s.bucket.shard_param()
        if s.param_staging is None:  # the masters beside the parameters: cast straight into the FP8 shard
            for p, lo, hi, _ in s.entries:
                scale = self.scales[self.index[id(p)]]
                target.view(self.dtype)[lo:hi].copy_(quantize(s.master[lo:hi], scale, self.dtype))
            return
        # Offloaded: cast on the host (scales: host_scales, copied in cast_all) into the pinned staging bytes (the
        # shard's other elements stay zero, as on the device), then one asynchronous host-to-device copy, as
        # ShardState._copy_to_params does. The next write to the staging buffer follows a stream synchronize.
        staging = s.param_staging.view(STORAGE)[: target.numel()]
        for p, lo, hi, _ in s.entries:
            scale = self.host_scales[self.index[id(p)]]
            staging.view(self.dtype)[lo:hi].copy_(quantize(s.master[lo:hi], scale, self.dtype))
        target.copy_(staging, non_blocking=True)


def fp8_params_for(cfg: Config, data_parallel: list[DataParallel], shards: list, group: Optional[dist.ProcessGroup]):
    """The optimizer's FP8Params under --fp8-param-gather (native FP8), else None."""
    if not cfg.training.fp8_param_gather or cfg.model.transformer_impl != "local":
        return None
    return FP8Params(data_parallel, shards, torch.float8_e4m3fn, group)
