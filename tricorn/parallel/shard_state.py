"""Master weights and AdamW state for the part of one DP bucket that this rank owns.

The owned range of a bucket (all of it for DDP, 1/DP with the distributed
optimizer) has three flat fp32 tensors: master values, exp_avg and exp_avg_sq.
Each parameter that overlaps the range is stepped through a 1-D view of them,
so torch.optim.AdamW does the math on the real storage and the state stays
contiguous (and checkpointable per parameter, see ParamShard). AdamW is torch's
fused kernel wherever torch has one for the masters' device (CPU and CUDA),
foreach otherwise (adamw_kind): one kernel for the whole step, no temporaries.

The master is the parameter storage itself when parameters are fp32 and not
offloaded; otherwise an fp32 copy, on the CPU (pinned when the device is CUDA)
with --optimizer-cpu-offload. Memory per owned element: 4 (master, unless
aliased) + 8 (moments), plus offload staging buffers. No collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from tricorn.config import TrainingConfig
from tricorn.parallel.data_parallel import Bucket
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
        """fp32 parameters on the device are their own master copy (the same storage)."""
        return self.master.data_ptr() == self.value.data_ptr() and self.master.dtype == self.value.dtype


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
    def __init__(self, bucket: Bucket, t: TrainingConfig, offload: bool):
        self.bucket = bucket
        shard = bucket.shard_param()
        self.offloaded = offload
        home = torch.device("cpu") if offload else shard.device
        pin = offload and pins_host_memory(shard.device)
        # fp32 parameters on the device are their own master copy.
        self.alias = shard.dtype == torch.float32 and not offload
        self.master = shard if self.alias else _buffer(shard.numel(), torch.float32, home, offload, pin).copy_(shard)
        self.exp_avg = _buffer(shard.numel(), torch.float32, home, offload, pin)
        self.exp_avg_sq = _buffer(shard.numel(), torch.float32, home, offload, pin)
        needs_grad_copy = offload or bucket.grad_dtype != torch.float32
        self.grad_staging = _buffer(bucket.shard_size, torch.float32, home, offload, pin) if needs_grad_copy else None
        self.param_staging = _buffer(shard.numel(), shard.dtype, home, offload, pin) if pin else None
        # (param, lo, hi, first element of the param): shard range [lo, hi) holds p.view(-1)[first : first + hi - lo].
        self.entries: list[tuple[nn.Parameter, int, int, int]] = []
        for s in bucket.slots:
            a, b = bucket.owned(s)
            if a < b:
                self.entries.append((s.param, a - bucket.lo, b - bucket.lo, a - s.offset))
        self.masters = [self.master[lo:hi] for _, lo, hi, _ in self.entries]
        self.adam: Optional[torch.optim.AdamW] = None
        if self.entries:  # a rank may own only padding of a small bucket
            decay = [m for m, (p, *_) in zip(self.masters, self.entries) if p.ndim > 1]
            no_decay = [m for m, (p, *_) in zip(self.masters, self.entries) if p.ndim <= 1]
            groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
            kind = adamw_kind(home)
            self.fused = "fused" in kind
            self.adam = torch.optim.AdamW(
                [g for g in groups if g["params"]], lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, **kind
            )
            # State created up front as views of the flat moments (AdamW only initialises empty state).
            for m, (_, lo, hi, _) in zip(self.masters, self.entries):
                step = torch.tensor(0.0, dtype=torch.float32, device=home if self.fused else "cpu")
                self.adam.state[m] = {
                    "step": mark_host(step) if offload else step,  # offloaded: host memory, as the state it counts
                    "exp_avg": self.exp_avg[lo:hi],
                    "exp_avg_sq": self.exp_avg_sq[lo:hi],
                }

    def grads_for_step(self) -> torch.Tensor:
        """The reduced owned gradients as fp32 beside the master (copied when offloaded or reduced in bf16)."""
        grads = self.bucket.shard_grad()
        if self.grad_staging is None:
            return grads
        return self.grad_staging.copy_(grads, non_blocking=is_pinned(self.grad_staging))

    def step(self, grads: torch.Tensor, found_inf: Optional[torch.Tensor] = None) -> None:
        """AdamW on the owned range; with `found_inf` a True flag leaves everything untouched."""
        if self.adam is not None:
            for m, (_, lo, hi, _) in zip(self.masters, self.entries):
                m.grad = grads[lo:hi]
            if found_inf is not None and self.fused:  # offloaded: the CPU kernel needs the flag in host memory (this syncs)
                self.adam.found_inf = found_inf.to(self.master.device, torch.float32).reshape(())
            # The foreach fallback (a device without a fused kernel) takes no flag: it reads it on the host.
            if found_inf is None or self.fused or not bool(found_inf):
                self.adam.step()
            for m in self.masters:
                m.grad = None
        if not self.alias:
            self._copy_to_params()

    def _copy_to_params(self) -> None:
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

    def set_lr(self, lr: float) -> None:
        if self.adam is not None:
            for group in self.adam.param_groups:
                group["lr"] = lr

    def _steps(self) -> list[torch.Tensor]:
        return [self.adam.state[m]["step"] for m in self.masters] if self.adam is not None else []

    def param_shards(self, names: dict[int, tuple[int, str]]) -> list[ParamShard]:
        out = []
        for m, step, (p, lo, hi, first) in zip(self.masters, self._steps(), self.entries):
            chunk, name = names[id(p)]
            value = self.bucket.shard_param()[lo:hi]
            out.append(
                ParamShard(chunk, name, p, first, first + hi - lo, m, self.exp_avg[lo:hi], self.exp_avg_sq[lo:hi], step, value)
            )
        return out

    def state_dict(self) -> dict:
        steps = self._steps()
        return {
            "master": None if self.alias else self.master,
            "exp_avg": self.exp_avg,
            "exp_avg_sq": self.exp_avg_sq,
            "step": float(steps[0]) if steps else 0.0,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["exp_avg"].numel() != self.exp_avg.numel():
            raise ValueError(
                f"optimizer shard of {state['exp_avg'].numel()} elements does not fit this layout's {self.exp_avg.numel()}"
            )
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        for step in self._steps():
            step.fill_(state["step"])
        if state.get("master") is not None and not self.alias:
            self.master.copy_(state["master"])
            self._copy_to_params()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        staging = [t for t in (self.param_staging,) if t is not None]
        return {
            "master_params": ([] if self.alias else [self.master]) + staging,
            "optimizer_state": [self.exp_avg, self.exp_avg_sq, *self._steps()],
            "grads": [self.grad_staging] if self.grad_staging is not None else [],
        }
