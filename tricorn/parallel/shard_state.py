"""Master weights and AdamW state for the part of one DP bucket that this rank owns.

The owned range of a bucket (all of it for DDP, 1/DP with the distributed optimizer) has three flat tensors:
master values, exp_avg and exp_avg_sq. Each parameter that overlaps the range is stepped through a 1-D view of
them, so torch's AdamW does the math on the real storage and the state stays contiguous (and checkpointable per
parameter, see ParamShard). AdamW is torch's fused kernel wherever torch has one for the masters' device (CPU and
CUDA), foreach otherwise (adamw_kind): one kernel per parameter group, no temporaries.

The master is the parameter storage itself when its dtype is the parameters' (fp32 parameters; with the
precision-aware optimizer, bf16 or fp16 masters of parameters of that dtype) and nothing is offloaded; otherwise a
copy, on the CPU (pinned when the device is CUDA) with --optimizer-cpu-offload.

Precision-aware storage (precision.py: which dtype, how each value is rounded): when any state is below fp32,
a step widens the bucket's owned states into fp32 work buffers (fp16 moments unscaled), runs the same AdamW on
them, and rounds the results back: moments to nearest (fp16 with their new per-parameter scale), a 16-bit master
stochastically. With every state fp32 the step runs on the storage itself, exactly as before.

Memory per owned element: master (4 as a copy, 0 when it is the parameters) + moments (8 in fp32, 4 in bf16 or
fp16), plus offload staging buffers; transient during the step, fp32 copies of 16-bit gradients (4 bytes per owned
element, all buckets: the norm and the clip read them before any bucket steps) and, in a precision-aware step,
fp32 work copies of one bucket's states (at most 12 bytes per owned element of that bucket) and the rounding's
chunked temporaries. No collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from torch import nn
from torch.optim.adamw import adamw

from tricorn.config import TrainingConfig
from tricorn.parallel.data_parallel import Bucket
from tricorn.parallel.precision import MOMENTS, KeyedRange, StateDtypes, from_storage, stochastic_store, to_storage
from tricorn.pinned import host_buffer, is_pinned, mark_host, pins_host_memory


@dataclass
class ParamShard:
    """The elements [start, stop) of p.view(-1) this rank owns, and their optimizer state (1-D views)."""

    chunk: int
    name: str
    param: nn.Parameter
    start: int
    stop: int
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
    value: torch.Tensor  # the parameter's own (possibly 16-bit) values of the range, a view of its bucket

    @property
    def master_is_value(self) -> bool:
        """Parameters whose dtype is the master's, on the device, are their own master copy (the same storage)."""
        return self.master.data_ptr() == self.value.data_ptr() and self.master.dtype == self.value.dtype


@dataclass
class StepContext:
    """What a precision-aware step needs besides the gradients: the optimizer step (stochastic rounding's key) and,
    for fp16 moments, each parameter's scale before and after this step (index: Optimizer.params)."""

    step: int = 0
    seed: int = 0
    old_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    new_scales: dict[str, torch.Tensor] = field(default_factory=dict)


def adamw_kind(device: torch.device) -> dict:
    """torch's fused AdamW where torch has a kernel for `device` (CPU and CUDA in torch 2.13), foreach otherwise.

    The choice depends on the masters' device only, so every layout (DDP, ZeRO-1/2/3, any TP/PP/CP) and the
    single-process run step with the same implementation. The fused kernel also takes the fp16 skip flag on
    the device (found_inf), so skipping an overflowing step needs no host read. (The CPU kernel computes the
    last numel % vector-width elements of each tensor in a scalar loop that rounds differently in the last
    bit, so an element's bits depend on where its DP shard starts: layouts agree to the fp32 reorder bound
    they already differ by, and a resume on the same layout is bitwise, as before.)
    """
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return {"fused": True} if device.type in _get_fused_kernels_supported_devices() else {"foreach": True}


def _buffer(numel: int, dtype: torch.dtype, device: torch.device, offload: bool, pin: bool) -> torch.Tensor:
    """Offloaded state lives in host memory (pinned on CUDA: its copies to and from the device do not block)."""
    return host_buffer(numel, dtype, pin) if offload else torch.zeros(numel, dtype=dtype, device=device)


class ShardState:
    def __init__(self, bucket: Bucket, t: TrainingConfig, offload: bool, dtypes: StateDtypes = StateDtypes()):
        self.bucket = bucket
        shard = bucket.shard_param()
        self.offloaded = offload
        self.dtypes = dtypes
        home = torch.device("cpu") if offload else shard.device
        self.device = shard.device  # the parameters' (the run's) device, where per-parameter vectors such as scales live
        pin = offload and pins_host_memory(shard.device)
        # Parameters of the master's dtype on the device are their own master copy.
        self.alias = shard.dtype == dtypes.master and not offload
        self.master = shard if self.alias else _buffer(shard.numel(), dtypes.master, home, offload, pin).copy_(shard)
        self.exp_avg = _buffer(shard.numel(), dtypes.exp_avg, home, offload, pin)
        self.exp_avg_sq = _buffer(shard.numel(), dtypes.exp_avg_sq, home, offload, pin)
        self.precision_aware = not dtypes.all_fp32
        # Offloaded: a persistent host buffer the gradients are copied into. 16-bit gradients on the device are widened
        # into a buffer that lives for the step only (nothing of it stays through forward and backward).
        self.grad_staging = _buffer(bucket.shard_size, torch.float32, home, offload, pin) if offload else None
        self.param_staging = _buffer(shard.numel(), shard.dtype, home, offload, pin) if pin else None
        # (param, lo, hi, first element of the param): shard range [lo, hi) holds p.view(-1)[first : first + hi - lo].
        self.entries: list[tuple[nn.Parameter, int, int, int]] = []
        for s in bucket.slots:
            a, b = bucket.owned(s)
            if a < b:
                self.entries.append((s.param, a - bucket.lo, b - bucket.lo, a - s.offset))
        # Each entry's parameter in Optimizer.params (set_param_index: fp16 moments' scales), a LongTensor on the
        # device, built once: a Python list as an index becomes a host tensor copied over (blocking) at every use.
        self.index = torch.zeros(0, dtype=torch.long, device=self.device)
        self.ranges: list[KeyedRange] = []  # global coordinates of the owned elements (set_rounding_ranges)
        kind = adamw_kind(home)
        self.fused = "fused" in kind
        self.kind = kind
        self.lr, self.betas, self.eps = t.lr, (t.adam_beta1, t.adam_beta2), t.adam_eps
        # AdamW's two parameter groups, as Megatron's: no weight decay on biases and norms (1-D parameters). Each
        # group's weight decay is its wd_mult (Megatron's) times the scheduled one (set_lr).
        decay = [i for i, (p, *_) in enumerate(self.entries) if p.ndim > 1]
        no_decay = [i for i, (p, *_) in enumerate(self.entries) if p.ndim <= 1]
        self.groups = [(g, mult) for g, mult in ((decay, 1.0), (no_decay, 0.0)) if g]
        self.weight_decay = t.weight_decay
        step_device = home if self.fused else torch.device("cpu")
        self.steps = [torch.tensor(0.0, dtype=torch.float32, device=step_device) for _ in self.entries]
        if offload:  # host memory, as the state they count (registered so on a CPU run: tricorn/pinned.py)
            self.steps = [mark_host(step) for step in self.steps]
        self.fp8 = False  # FP8 primary weights (fp8_params.py): the optimizer casts the masters into the parameters

    @property
    def adam(self) -> bool:
        """Whether this rank steps anything here (a rank may own only padding of a small bucket)."""
        return bool(self.entries)

    def set_param_index(self, index: dict[int, int]) -> None:
        self.index = torch.tensor([index[id(p)] for p, *_ in self.entries], dtype=torch.long, device=self.device)

    def set_rounding_ranges(self, names: dict[int, str]) -> None:
        """The global coordinates that key a 16-bit master's stochastic rounding (precision.keyed_ranges)."""
        from tricorn.parallel.precision import keyed_ranges

        self.ranges = [r for p, lo, hi, first in self.entries for r in keyed_ranges(names[id(p)], p, first, first + hi - lo, lo)]

    def grads_for_step(self) -> torch.Tensor:
        """The reduced owned gradients as fp32 beside the master (copied when offloaded or reduced in bf16)."""
        grads = self.bucket.shard_grad()
        if self.grad_staging is not None:
            return self.grad_staging.copy_(grads, non_blocking=is_pinned(self.grad_staging))
        return grads if grads.dtype == torch.float32 else grads.float()

    # ------------------------------------------------------------ the step

    def step(self, grads: torch.Tensor, found_inf: Optional[torch.Tensor] = None, ctx: Optional[StepContext] = None) -> None:
        """AdamW on the owned range; with `found_inf` a True flag leaves everything untouched."""
        if self.entries:
            if self.precision_aware:
                self._precision_aware_step(grads, found_inf, ctx or StepContext())
            else:
                self._adamw(self.master, self.exp_avg, self.exp_avg_sq, grads, found_inf)
        if not self.alias:
            self._copy_to_params()

    def _adamw(self, master, exp_avg, exp_avg_sq, grads, found_inf: Optional[torch.Tensor]) -> None:
        """torch's AdamW (its functional form, which AdamW.step calls) on 1-D views of flat fp32 tensors."""
        if found_inf is not None and self.fused:  # offloaded: the CPU kernel needs the flag in host memory (this syncs)
            found_inf = found_inf.to(master.device, torch.float32).reshape(())
        elif found_inf is not None and bool(found_inf):  # the foreach fallback takes no flag: it reads it on the host
            return
        else:
            found_inf = None
        views = [(master[lo:hi], grads[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi]) for _, lo, hi, _ in self.entries]
        for members, wd_mult in self.groups:
            adamw(
                *([views[i][k] for i in members] for k in range(4)),
                [],
                [self.steps[i] for i in members],
                found_inf=found_inf,
                amsgrad=False,
                beta1=self.betas[0],
                beta2=self.betas[1],
                lr=self.lr,
                weight_decay=self.weight_decay * wd_mult,
                eps=self.eps,
                maximize=False,
                **self.kind,
            )

    def _scales(self, scales: dict[str, torch.Tensor], name: str) -> list[Optional[torch.Tensor]]:
        """Each entry's scale of moment `name` (fp16 moments only), on the states' device."""
        if name not in scales:
            return [None] * len(self.entries)
        mine = scales[name].index_select(0, self.index).to(self.exp_avg.device)
        return list(mine.unbind())

    def _precision_aware_step(self, grads: torch.Tensor, found_inf: Optional[torch.Tensor], ctx: StepContext) -> None:
        """Widen the stored states into fp32, step them, round them back (precision.py says how)."""
        work_master = self.master if self.master.dtype == torch.float32 else self.master.float()
        work = {}
        for name in MOMENTS:
            store, scales = getattr(self, name), self._scales(ctx.old_scales, name)
            work[name] = torch.empty(store.shape, dtype=torch.float32, device=store.device)
            for (_, lo, hi, _), scale in zip(self.entries, scales):
                from_storage(store[lo:hi], work[name][lo:hi], scale)
        self._adamw(work_master, work["exp_avg"], work["exp_avg_sq"], grads, found_inf)
        for name in MOMENTS:
            store, scales = getattr(self, name), self._scales(ctx.new_scales, name)
            for (_, lo, hi, _), scale in zip(self.entries, scales):
                to_storage(work[name][lo:hi], store[lo:hi], scale)
        if work_master is not self.master:
            stochastic_store(work_master, self.master, self.ranges, ctx.seed, ctx.step)

    def _copy_to_params(self) -> None:
        if self.fp8:  # FP8 primary weights: cast by the optimizer once every amax is known (fp8_params.py)
            return
        target = self.bucket.shard_param()
        if self.param_staging is None:
            target.copy_(self.master)
        else:  # cast on the host into pinned memory, then an asynchronous host-to-device copy
            self.param_staging.copy_(self.master)
            target.copy_(self.param_staging, non_blocking=True)

    def copy_master_to_params(self) -> None:
        """After the master values were written (a checkpoint load): the owned parameter values follow."""
        if not self.alias:
            self._copy_to_params()

    def sync_from_params(self) -> None:
        if not self.alias:
            self.master.copy_(self.bucket.shard_param())

    def set_lr(self, lr: Union[float, torch.Tensor], weight_decay: float) -> None:
        """A tensor lr (a run whose steps can be skipped) goes to the fused kernel as it is; the offloaded step (on
        the host) and the foreach fallback (no tensor lr without capturable) read it, as they read found_inf."""
        if isinstance(lr, torch.Tensor) and (self.offloaded or not self.fused):
            lr = float(lr)
        self.lr, self.weight_decay = lr, weight_decay

    def _steps(self) -> list[torch.Tensor]:
        return self.steps

    # ------------------------------------------------------------ state

    def param_shards(self, names: dict[int, tuple[int, str]]) -> list[ParamShard]:
        out = []
        for step, (p, lo, hi, first) in zip(self.steps, self.entries):
            chunk, name = names[id(p)]
            # An FP8 primary weight's value for checkpoints and norms is its fp32 master, the source of truth.
            value = self.master[lo:hi] if self.fp8 else self.bucket.shard_param()[lo:hi]
            out.append(
                ParamShard(
                    chunk,
                    name,
                    p,
                    first,
                    first + hi - lo,
                    self.master[lo:hi],
                    self.exp_avg[lo:hi],
                    self.exp_avg_sq[lo:hi],
                    step,
                    value,
                )
            )
        return out

    def state_dict(self) -> dict:
        return {
            "master": None if self.alias else self.master,
            "exp_avg": self.exp_avg,
            "exp_avg_sq": self.exp_avg_sq,
            "step": float(self.steps[0]) if self.steps else 0.0,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["exp_avg"].numel() != self.exp_avg.numel():
            raise ValueError(
                f"optimizer shard of {state['exp_avg'].numel()} elements does not fit this layout's {self.exp_avg.numel()}"
            )
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        for step in self.steps:
            step.fill_(state["step"])
        if state.get("master") is not None and not self.alias:
            self.master.copy_(state["master"])
            self._copy_to_params()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        staging = [t for t in (self.param_staging,) if t is not None]
        return {
            "master_params": ([] if self.alias else [self.master]) + staging,
            "optimizer_state": [self.exp_avg, self.exp_avg_sq, *self.steps],
            "grads": [self.grad_staging] if self.grad_staging is not None else [],
        }
