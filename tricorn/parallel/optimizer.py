"""The optimizer the trainer drives: mixed precision, DP gradient sync, loss scaling, norm and clip, AdamW, ZeRO.

Precision (Megatron style): model parameters are fp32, bf16 or fp16; gradients
accumulate in fp32 `main_grad` buffers (bf16 with --grad-reduce-in-bf16); the
optimizer keeps fp32 master values and steps them with torch's AdamW (fused
where torch has a kernel for the device, foreach otherwise: shard_state.py),
then copies them back into the model's parameters. With fp32 parameters (and
no offload) the parameters are their own master copy: no extra memory.

Each DP bucket (data_parallel.py) gets a ShardState holding the master values
and the two Adam moments of the elements this rank owns - the whole bucket for
DDP, 1/DP of it with the distributed optimizer (ZeRO-1/2/3). Per parameter,
AdamW steps a 1-D view of that flat shard, so the math is torch's and the
state is contiguous. With --optimizer-cpu-offload the shards live in (pinned)
host memory: gradients are copied there, the step runs on the CPU, and bucket
by bucket the new values go back to the device (asynchronously) while the
next bucket steps; each bucket's parameter all-gather starts right after its
copy.

One step: finish the DP reductions; all-reduce sequence-parallel gradients
over TP and tied-embedding gradients over the embedding group (on the owned
views); then for fp16, unscale and agree on overflow with one all-reduce over
all ranks (a skipped step leaves parameters and state untouched: fused AdamW's
found_inf, decided on the device, never read on the host); the global
norm counts every parameter once (grads.py), summed over DP shards when
sharded; clip; AdamW; copy back; all-gather the parameters (ZeRO-1/2), bucket by bucket in the
order the next forward uses them (with --overlap-param-gather each module's forward pre-hook
waits only for its own buckets' gathers, as Megatron's).

Test hook: TRICORN_TEST_INJECT_INF_AT_ITER=N (with TRICORN_TEST_INJECT_INF_RANK,
default 0) writes an inf into one gradient element on that rank during
iteration N's last microbatch, before any reduction. Tests use it; nothing else may.

Contract with the trainer (kept by every variant):
    zero_grad(); microbatch(is_last, chunk=c) context around each backward of model chunk c;
    scale_loss(loss); finish_grad_sync(); step() -> StepInfo; set_lr(lr, weight_decay); state_dict()/load_state_dict().
For checkpoints: gathered_params(write_back) around reading/writing parameters,
sharded_param_state() for the per-parameter optimizer state in global coordinates.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from tricorn.config import Config
from tricorn.model.init import INIT_KEY_ATTR, InitSpec
from tricorn.parallel.data_parallel import DataParallel, dp_options
from tricorn.parallel.fp8_params import fp8_params_for, mark_fp8_weights
from tricorn.parallel.grads import clip_grads, global_grad_norm, reduce_sequence_parallel_grads, reduce_tied_embedding_grads
from tricorn.parallel.loss_scaler import build_loss_scaler
from tricorn.parallel.precision import StateDtypes, moment_scale, to_storage
from tricorn.parallel.shard_state import ParamShard, ShardState, StepContext
from tricorn.parallel.state import ParallelState
from tricorn.parallel.zero3 import ParamSharder, unit_params, zero3_units
from tricorn.profiling import span_of

INJECT_INF_AT_ITER = "TRICORN_TEST_INJECT_INF_AT_ITER"
INJECT_INF_RANK = "TRICORN_TEST_INJECT_INF_RANK"


@dataclass
class StepInfo:
    """Device tensors (0-dim) or plain numbers; the trainer reads them once per log line."""

    grad_norm: Union[torch.Tensor, float]
    skipped: Union[torch.Tensor, bool] = False
    loss_scale: Union[torch.Tensor, float] = 1.0


def param_groups(modules: list[nn.Module], weight_decay: float) -> list[dict]:
    """No weight decay on biases and norm weights (every 1-D parameter), as in Megatron."""
    decay, no_decay = [], []
    for m in modules:
        for p in m.parameters():
            if p.requires_grad:
                (no_decay if p.ndim == 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class Optimizer:
    def __init__(self, cfg: Config, state: ParallelState, modules: list[nn.Module]):
        self.cfg = cfg
        self.state = state
        self.modules = modules
        self.opts = dp_options(cfg)
        self.scaler = build_loss_scaler(cfg, state.device)
        shard_params = self.opts.stage == 3 and dist.get_world_size(state.dp_cp_group) > 1
        self.data_parallel: list[DataParallel] = []
        self.sharders: list[Optional[ParamSharder]] = []
        init = InitSpec(cfg.training.seed, cfg.model.init_method_std, cfg.model.num_layers)  # for hollow parameters
        if cfg.training.fp8_param_gather and cfg.model.transformer_impl == "local":
            mark_fp8_weights(modules)  # FP8 primary weights: buckets of their own (fp8_params.py)
        for m in modules:
            units = zero3_units(m) if shard_params else None
            dp = DataParallel(m, state, self.opts, [unit_params(u, u is m) for u in units] if units else None, init)
            self.data_parallel.append(dp)
            self.sharders.append(ParamSharder(m, units, dp) if units else None)
        self.params = [p for m in modules for p in m.parameters() if p.requires_grad]
        offload = cfg.parallel.optimizer_cpu_offload
        self.dtypes = StateDtypes.from_config(cfg)  # --use-precision-aware-optimizer (precision.py)
        self.shards = [ShardState(b, cfg.training, offload, self.dtypes) for dp in self.data_parallel for b in dp.buckets]
        index = {id(p): k for k, p in enumerate(self.params)}
        names = {id(p): getattr(p, INIT_KEY_ATTR, n) for m in modules for n, p in m.named_parameters()}
        for s in self.shards:
            s.set_param_index(index)
            if self.dtypes.master != torch.float32:  # a 16-bit master: stochastic rounding keyed by global coordinates
                s.set_rounding_ranges(names)
        # fp16 moments: per parameter, an upper bound of its largest moment, the same on every rank of the stage
        # (precision.py); their all-reduce runs over TP x DP x CP, the ranks that split one stage's parameters.
        self.moment_bounds = {m: torch.zeros(len(self.params), device=state.device) for m in self.dtypes.scaled}
        self.stage_group = getattr(state, "stage_group", None)  # created by init_parallel when either needs it
        # --fp8-param-gather: the FP8 linears' weights become FP8 bytes, cast from the masters (fp8_params.py)
        self.fp8_params = fp8_params_for(cfg, self.data_parallel, self.shards, self.stage_group)
        if self.fp8_params is not None:
            self.fp8_params.cast_all(start_gathers=self.opts.stage in (1, 2))
            self.finish_param_sync()
        # Shards in the order the next forward uses their buckets: chunk by chunk, and within a chunk the buckets
        # reversed (they are packed in backward order), so the embedding's all-gather is issued first and the
        # first layer's forward pre-hook (data_parallel.py) waits for that one gather only, not for all of them.
        starts = [0]
        for dp in self.data_parallel:
            starts.append(starts[-1] + len(dp.buckets))
        self._forward_order = [i for c in range(len(self.data_parallel)) for i in reversed(range(starts[c], starts[c + 1]))]
        self.iteration = 0  # steps taken, skipped ones included
        self._inject_at = int(os.environ.get(INJECT_INF_AT_ITER, "0"))
        self._inject_rank = int(os.environ.get(INJECT_INF_RANK, "0"))
        self._step_grads: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------ forward / backward

    def zero_grad(self) -> None:
        for dp in self.data_parallel:
            dp.zero_grad()
        for p in self.params:
            p.grad = None

    @contextlib.contextmanager
    def microbatch(self, is_last: bool, chunk: int = 0, expected: Optional[Collection[torch.Tensor]] = None) -> Iterator[None]:
        """Around one backward of chunk ``chunk`` (``DataParallel.microbatch``; ``expected``: a W's weights)."""
        dp = self.data_parallel[chunk]
        if is_last and self.iteration + 1 == self._inject_at and self.state.rank == self._inject_rank:
            dp.inject_inf = True
            self._inject_at = 0
        with dp.microbatch(is_last, expected):
            yield
        if self.sharders[chunk] is not None:
            self.sharders[chunk].release_all()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler is not None else loss

    def finish_grad_sync(self) -> None:
        owned: dict[int, torch.Tensor] = {}
        for dp in self.data_parallel:
            dp.finish_grad_sync()
            owned.update(dp.owned_grads())
        # Linear reductions commute with the DP one, and TP peers (and, for the tied embedding, the two
        # stages) own identical ranges, so reducing only the owned views is exact and moves 1/DP of the bytes.
        reduce_sequence_parallel_grads(self.modules, self.state, grad_fn=lambda p: owned.get(id(p)))
        tied = not self.cfg.model.untie_embeddings_and_output_weights
        reduce_tied_embedding_grads(self.modules, self.state, tied, grad_fn=lambda p: owned.get(id(p)))

    # ------------------------------------------------------------ step

    @span_of("optimizer step")
    def step(self, veto: Optional[Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]] = None) -> StepInfo:
        """One optimizer step with no host read: the norm, the overflow flag and the skip stay on the device.

        With a loss scaler, a step whose gradients hold an inf/nan on any rank (or, with
        --check-for-nan-in-loss-and-grad, whose norm is not finite) is skipped by the fused AdamW
        kernel's found_inf argument, which leaves parameters, moments and step counts untouched.
        `veto(norm, overflow)` (--check-for-spiky-loss, tricorn/training/spikes.py) returns a device bool
        that skips the step the same way; the norm it sees is the global one, before clipping.
        """
        self.iteration += 1
        grads = [s.grads_for_step() for s in self.shards]
        if any(s.offloaded for s in self.shards) and self.state.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the device-to-host gradient copies have landed
        self._step_grads = {id(p): g[lo:hi] for s, g in zip(self.shards, grads) for p, lo, hi, _ in s.entries}
        scale = self.scaler.scale if self.scaler is not None else 1.0
        skip: Optional[torch.Tensor] = None
        if self.scaler is not None:
            skip = self._unscale_and_check(grads, scale)
            self.scaler.update(skip)
        grad_fn = self._step_grad
        norm = global_grad_norm(self.params, self.state, dp_sharded=self.opts.distributed, grad_fn=grad_fn)
        if skip is not None:
            if self.cfg.training.check_for_nan_in_loss_and_grad:
                skip = skip | ~torch.isfinite(norm)
            norm = torch.where(skip, float("nan"), norm)  # a skipped step reports no norm, as Megatron's log does
        if veto is not None:  # a spike skips the step but keeps its norm: the log line shows what spiked
            spike = veto(norm, skip)
            skip = spike if skip is None else skip | spike
        clip_grads(self.params, self.cfg.training.clip_grad, norm, grad_fn=grad_fn)
        ctx = self._step_context(grads, skip)
        gather = self.opts.stage in (1, 2)
        for i in self._forward_order:  # each bucket's gather starts right after its step, first-used bucket first
            self.shards[i].step(grads[i], found_inf=skip, ctx=ctx)
            if gather and not self.shards[i].fp8:
                self.shards[i].bucket.start_param_gather()
        if self.fp8_params is not None:  # FP8 weights: once every master has stepped, the amaxes, the cast, the gathers
            self.fp8_params.cast_all(start_gathers=gather)
        if not self.opts.overlap_param_gather or self.iteration >= self.cfg.training.train_iters:
            self.finish_param_sync()  # with overlap, the next forward waits; after the last step nothing would
        self._after_step()
        return StepInfo(grad_norm=norm, skipped=skip if skip is not None else False, loss_scale=scale)

    def _step_context(self, grads: list[torch.Tensor], skip: Optional[torch.Tensor]) -> StepContext:
        """Stochastic rounding's key, and fp16 moments' scales before and after this step (precision.py): each
        bound follows AdamW's recurrence with the parameter's largest |gradient| over the stage (after clipping),
        and stays put on a skipped step."""
        ctx = StepContext(step=self.iteration, seed=self.cfg.training.seed)
        if not self.moment_bounds:
            return ctx
        amax = torch.zeros(len(self.params), device=self.state.device)
        for s, g in zip(self.shards, grads):
            if s.entries:
                local = torch._foreach_norm([g[lo:hi] for _, lo, hi, _ in s.entries], float("inf"))
                amax.index_copy_(0, s.index, torch.stack(local).to(amax.device, torch.float32))  # index on the device
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.stage_group)
        t = self.cfg.training
        for name, beta, g in (("exp_avg", t.adam_beta1, amax), ("exp_avg_sq", t.adam_beta2, amax * amax)):
            if name in self.moment_bounds:
                old = self.moment_bounds[name]
                new = beta * old + (1 - beta) * g
                new = new if skip is None else torch.where(skip, old, new)
                ctx.old_scales[name], ctx.new_scales[name] = moment_scale(old), moment_scale(new)
                self.moment_bounds[name] = new
        return ctx

    def _step_grad(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        return self._step_grads.get(id(p))

    def _unscale_and_check(self, grads: list[torch.Tensor], scale) -> torch.Tensor:
        """Unscale in place; a device bool, True when any gradient on any rank (TP, PP, DP) is inf/nan."""
        device = grads[0].device if grads else self.state.device
        found = torch.zeros(1, dtype=torch.float32, device=device)
        if grads:
            if isinstance(scale, torch.Tensor):
                inv_scale = scale.to(device, torch.float32).reciprocal().reshape(1)
            else:  # --loss-scale: a Python float, filled on the device (as_tensor of it would be a host copy)
                inv_scale = torch.full((1,), scale, dtype=torch.float32, device=device).reciprocal()  # bits as before
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)
        found = found.to(self.state.device)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return found[0] > 0

    def _after_step(self) -> None:
        self._step_grads = {}
        self.release_gathered()  # gathered copies are stale now

    def release_gathered(self) -> None:
        """ZeRO-3: free every gathered unit (after a step, and after an evaluation's forward-only passes)."""
        for sharder in self.sharders:
            if sharder is not None:
                sharder.release_all()

    def wait_all(self) -> None:
        """Wait for every collective this optimizer has in flight (end of a run: nothing may outlive the groups)."""
        for dp in self.data_parallel:
            dp.wait_reductions()
            dp.finish_param_gather()

    def close(self) -> None:
        """End of a run (success or error): drop the gradient hooks that would keep the buckets alive."""
        for dp in self.data_parallel:
            dp.close()

    def set_lr(self, lr: Union[float, torch.Tensor], weight_decay: Optional[float] = None) -> None:
        """The next step's lr (a float, or a 0-dim device tensor: training/lr_step.py) and the weight decay of the
        decayed parameters (None: --weight-decay); biases and norms have none."""
        wd = self.cfg.training.weight_decay if weight_decay is None else weight_decay
        for s in self.shards:
            s.set_lr(lr, wd)

    # ------------------------------------------------------------ parameters for other readers

    def finish_param_sync(self) -> None:
        """Wait for the parameter all-gathers of the last step (they overlap the next forward otherwise)."""
        for dp in self.data_parallel:
            dp.finish_param_gather()

    @contextlib.contextmanager
    def gathered_params(self, write_back: bool = False) -> Iterator[None]:
        """Full, current parameters inside the block (ZeRO-3 gathers them). With `write_back`, values
        written into the parameters (a checkpoint load) become the optimizer's master values too."""
        self.finish_param_sync()
        with contextlib.ExitStack() as stack:
            for sharder in self.sharders:
                if sharder is not None:
                    stack.enter_context(sharder.gathered(write_back))
            yield
        if write_back:
            self.sync_master_from_params()

    def params_from_masters(self) -> None:
        """After a checkpoint load wrote the owned master values: the owned parameter values follow, the
        distributed optimizer all-gathers them (ZeRO-1/2), and ZeRO-3's gathered copies are dropped."""
        for s in self.shards:
            s.copy_master_to_params()
            if self.opts.stage in (1, 2) and not s.fp8:
                s.bucket.start_param_gather()
        if self.fp8_params is not None:
            self.fp8_params.cast_all(start_gathers=self.opts.stage in (1, 2))
        self.finish_param_sync()
        self.release_gathered()

    def sync_master_from_params(self) -> None:
        for s in self.shards:
            if not s.fp8:  # an FP8 weight's master is the source of truth; its FP8 bytes are a cast of it
                s.sync_from_params()

    # ------------------------------------------------------------ state

    def sharded_param_state(self) -> list[ParamShard]:
        """Per parameter: the element range of p.view(-1) this rank owns, with its master and Adam views."""
        names = {id(p): (c, n) for c, m in enumerate(self.modules) for n, p in m.named_parameters()}
        return [shard for s in self.shards for shard in s.param_shards(names)]

    def store_moments(self, moment: str, values: dict[int, torch.Tensor]) -> None:
        """A checkpoint load that switched a moment's dtype: fp32 ``values`` of the owned range of each parameter
        (by id) into storage, fp16 with a new bound, the loaded values' largest magnitude over the stage."""
        shards = {id(ps.param): ps for ps in self.sharded_param_state()}
        index = {id(p): k for k, p in enumerate(self.params)}
        scales = None
        if moment in self.moment_bounds:
            amax = torch.zeros(len(self.params), device=self.state.device)
            for pid, v in values.items():
                if v.numel():
                    amax[index[pid]] = v.abs().max().to(amax.device)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.stage_group)
            self.moment_bounds[moment].copy_(amax)
            scales = moment_scale(amax)
        for pid, v in values.items():
            store = getattr(shards[pid], moment)
            to_storage(v, store, None if scales is None else scales[index[pid]].to(store.device))

    def state_dict(self) -> dict:
        """This rank's state, for a resume on the same layout (the checkpoint reshards via sharded_param_state)."""
        self.finish_param_sync()
        return {
            "iteration": self.iteration,
            "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "shards": [s.state_dict() for s in self.shards],
            "moment_bounds": dict(self.moment_bounds),
        }

    def load_state_dict(self, state: dict) -> None:
        if len(state["shards"]) != len(self.shards):
            raise ValueError(
                f"optimizer state has {len(state['shards'])} buckets, this layout has {len(self.shards)}; "
                "load it through the checkpoint's resharding path (sharded_param_state)"
            )
        for s, saved in zip(self.shards, state["shards"]):
            s.load_state_dict(saved)
        if self.fp8_params is not None:
            self.fp8_params.cast_all(start_gathers=self.opts.stage in (1, 2))
            self.finish_param_sync()
        self.iteration = int(state["iteration"])
        for name, bound in state.get("moment_bounds", {}).items():
            if name in self.moment_bounds:
                self.moment_bounds[name].copy_(bound)
        if self.scaler is not None and state.get("loss_scaler"):
            self.scaler.load_state_dict(state["loss_scaler"])

    def host_scalars(self) -> list[torch.Tensor]:
        """Tensors kept in host memory by design (foreach AdamW's step counters, and every step counter of an
        offloaded shard, which the host's AdamW steps): reading them syncs nothing."""
        return [
            step
            for s in self.shards
            for step in s._steps()
            if step.device.type == "cpu" and s.adam and (not s.fused or s.offloaded)
        ]

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor this rank holds for the model state, by category (memory_report.py counts storages)."""
        out: dict[str, list[torch.Tensor]] = {
            "params": list(self.params),
            "grads": [],
            "master_params": [],
            "optimizer_state": [],
        }
        out["grads"] += [p.grad for p in self.params if p.grad is not None]
        for dp in self.data_parallel:
            for b in dp.buckets:
                out["params"] += [b.param_flat] + ([b.param_shard] if b.param_shard is not None else [])
                out["grads"] += [t for t in (b.grad_flat, b.grad_shard) if t is not None]
        for s in self.shards:
            for key, tensors in s.memory_tensors().items():
                out[key] += tensors
        return out
