"""The training loop: batches in, optimizer steps out, metrics logged.

Per iteration: cut this DP rank's slice of the global batch into microbatches,
count the valid tokens of the whole global batch (one all-reduce over DP),
run forward/backward (pipelined or not), finish the gradient reductions, step,
and reduce the loss for logging (one scalar all-reduce over DP x CP and PP).

No host synchronisation in an iteration that does not log: the loss, grad norm, skip flag
and loss scale stay on the device (IterationResult holds 0-dim tensors) and are read in one
go when a log line is due (`materialize`). The fp16 skip is decided on the device (optimizer.py).
NaN/Inf detection (--check-for-nan-in-loss-and-grad) accumulates the first bad iteration on
the device and reads it at each log line, every --nan-check-interval iterations, and before
every checkpoint save: a NaN stops the run at the first of those after it happens (latency
up to --log-interval iterations by default), never after a checkpoint of the bad state.
On CUDA the trainer synchronises the device only in logging iterations, so the interval's
wall time includes its kernels; phase timers synchronise only at --timing-log-level 2 (timers.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from tricorn.config import Config
from tricorn.data.base import Batch, GlobalBatchLoader
from tricorn.lr_schedule import schedule_from_config, steps_can_be_skipped
from tricorn.model.masking import document_rows
from tricorn.parallel.batch_schedule import MicrobatchCalculator
from tricorn.parallel.context import slice_batch
from tricorn.parallel.expert import MoEMonitor
from tricorn.parallel.state import ParallelState
from tricorn.parallel.step import StepContext, forward_backward_no_pipelining, microbatch_denominators
from tricorn.planning.flops import useful_pairs
from tricorn.profiling import Profiler
from tricorn.timers import (
    CHECKPOINT_STALL,
    DATA_LOADING,
    FORWARD_BACKWARD,
    GRADS_REDUCE_WAIT,
    OPTIMIZER_STEP,
    Timers,
)
from tricorn.training.faults import maybe_inject
from tricorn.training.logging import MetricsLogger, warn
from tricorn.training.lr_step import ScheduleDriver
from tricorn.training.memory_report import iteration_peak, write_memory_report
from tricorn.training.spikes import SpikeGuard
from tricorn.training.stragglers import StragglerMonitor, StragglerReport


class NaNError(RuntimeError):
    pass


Number = Union[torch.Tensor, float]


@dataclass
class IterationResult:
    """One iteration's outcome; loss, grad_norm, skipped and loss_scale are device tensors until `materialize`."""

    loss: Number
    grad_norm: Number
    lr: Optional[float]  # after the scheduler step, as Megatron logs it (None until the log line settles the skips)
    skipped: Union[torch.Tensor, bool]
    loss_scale: Number
    global_batch_size: int
    num_microbatches: int
    seconds: float


@dataclass
class Trainer:
    cfg: Config
    state: ParallelState
    chunks: list[nn.Module]
    optimizer: object
    train_loader: GlobalBatchLoader
    valid_loader: Optional[GlobalBatchLoader]
    logger: MetricsLogger
    forward_backward: Callable = forward_backward_no_pipelining
    iteration: int = 0
    unlogged: list = field(default_factory=list)  # results since the last log line (the logger empties it)
    timers: Timers = field(default_factory=Timers.disabled)  # phase timers (--timing-log-level); main.py passes them
    skipped_iterations: int = 0  # optimizer steps skipped for fp16 overflow, this run
    # Called after each iteration (tricorn/checkpoint/checkpointer.py: save at --save-interval, exit conditions); True stops training.
    on_iteration_end: Optional[Callable[[Trainer], bool]] = None
    step_fences: list = field(default_factory=list)  # CUDA events the next optimizer step waits for (async save staging)
    _nan_first: Optional[torch.Tensor] = None  # [iteration, loss, grad norm] of the first non-finite iteration (device)
    moe: Optional[MoEMonitor] = None  # router statistics and the expert-bias update (parallel/expert.py)
    _recompile_warned: bool = False  # --torch-compile: a recompilation after iteration 1 was reported
    spikes: Optional[SpikeGuard] = None  # --check-for-spiky-loss: skips spiky iterations on the device (spikes.py)
    stragglers: Optional[StragglerMonitor] = None  # each rank's own work, gathered at log lines (stragglers.py)
    straggler_report: Optional[StragglerReport] = None  # of the last log line (logging.py shows it)
    profiler: Profiler = field(default_factory=Profiler.disabled)  # --profile's window around iterations (profiling.py)
    lr_schedule: Optional[ScheduleDriver] = None  # Megatron's lr schedule (lr_schedule.py, lr_step.py); built if None
    # Documents / window: the (query, key) pairs this rank's samples needed since the last log line (host ints), and
    # at the log line the global batch's (summed over DP): logged as useful attention FLOPs beside MFU (flops.py).
    attention_pairs: Optional[int] = None
    useful_attention_pairs: Optional[int] = None

    def __post_init__(self) -> None:
        if self.lr_schedule is None:
            t = self.cfg.training
            self.lr_schedule = ScheduleDriver(schedule_from_config(t), self.state.device, steps_can_be_skipped(t))
        if self.cfg.data.reset_attention_mask or self.cfg.model.attention_window is not None:
            self.attention_pairs = 0

    # ------------------------------------------------------------ batches

    def batch_sizes(self) -> tuple[int, int]:
        """(global batch size, microbatches) for the next iteration; grows with --rampup-batch-size."""
        return MicrobatchCalculator.from_config(self.cfg).get(self.train_loader.consumed_samples)

    def _microbatches(self, batch: Batch, num_microbatches: int) -> list[Batch]:
        d = self.cfg.data
        if (d.reset_attention_mask and batch.documents is None) or (d.reset_position_ids and batch.position_ids is None):
            # Never train on without them: attention would silently see across documents (or RoPE not restart).
            raise RuntimeError("--reset-attention-mask / --reset-position-ids: the loader gave a batch without them")
        size = self.cfg.training.micro_batch_size
        # Own storage per microbatch (as a host-to-GPU copy gives): a view would keep the whole batch
        # alive for as long as any microbatch's activations are, on CPU.
        return [batch.slice(i * size, (i + 1) * size).to(self.state.device, copy=True) for i in range(num_microbatches)]

    def _cp_slice(self, mb: Batch) -> Batch:
        return slice_batch(mb, self.state.cp_rank, self.state.cp_size)

    def _step_context(self, microbatches: list[Batch], forward_only: bool = False) -> StepContext:
        """The loss normalisation of a global batch (parallel/step.py): valid tokens counted on the device from the
        microbatches already copied there (the batch's own mask is in host memory: a host count would be a blocking
        copy on CUDA), per microbatch and over the global batch (one all-reduce)."""
        counts = torch.stack([mb.loss_mask.sum(dtype=torch.float32) for mb in microbatches])
        tokens = counts.sum()
        dist.all_reduce(tokens, group=self.state.dp_group)
        per_microbatch = not (forward_only or self.cfg.training.calculate_per_token_loss)
        denominators = microbatch_denominators(counts, self.state.dp_size) if per_microbatch else None
        ctx = StepContext(self.optimizer, tokens, denominators, forward_only, prepare=self._cp_slice)
        if not forward_only:
            ctx.timers = self.timers
        return ctx

    def _reduce_loss(self, local: torch.Tensor) -> torch.Tensor:
        """Sum over DP x CP (each holds part of the global batch) and PP (only the last stage has it)."""
        # Off the loss stage the executor's sum is already zero (on the v placement the loss is on pp rank 0).
        dist.all_reduce(local, group=self.state.dp_cp_group)
        dist.all_reduce(local, group=self.state.pp_group)
        return local

    # ------------------------------------------------------------ one iteration

    def train_step(self, batch: Batch, num_microbatches: int) -> tuple[torch.Tensor, object]:
        for chunk in self.chunks:
            chunk.train()
        self.optimizer.zero_grad()
        microbatches = self._microbatches(batch, num_microbatches)
        ctx = self._step_context(microbatches)
        with self.timers(FORWARD_BACKWARD), self._own_work():
            local_loss = self.forward_backward(self.chunks, microbatches, ctx)
        with self.timers(GRADS_REDUCE_WAIT):
            self.optimizer.finish_grad_sync()
        with self.timers(OPTIMIZER_STEP):
            self._wait_step_fences()
            self.optimizer.set_lr(*self.lr_schedule.for_step())
            if self.spikes is None:
                info = self.optimizer.step()
            else:  # the global loss is needed before the step: the spike guard may veto it
                loss = self.spikes.observed(self._reduce_loss(local_loss), self.iteration)
                info = self.optimizer.step(veto=self.spikes.veto(loss, self.iteration, self.train_loader.last_batch_ids))
        if self.moe is not None:
            self.moe.after_step(info.skipped)  # the skip flag stays on the device
        return (loss if self.spikes is not None else self._reduce_loss(local_loss)), info

    def _own_work(self):
        """A phase in which this rank waits for no peer: what the straggler monitor times."""
        return self.stragglers.span() if self.stragglers is not None else nullcontext()

    def _wait_step_fences(self) -> None:
        """The device waits (the host does not) for work that must read the state before the step writes it."""
        for event in self.step_fences:
            torch.cuda.current_stream().wait_event(event)
        self.step_fences.clear()

    @torch.no_grad()
    def evaluate(self) -> Optional[float]:
        if self.valid_loader is None:
            return None
        start = time.perf_counter()
        for chunk in self.chunks:
            chunk.eval()
        gbs, nmb = self.batch_sizes()
        # Megatron's evaluate(): the token losses of every evaluation batch summed, over all their valid tokens (not
        # a mean of the batches' means, which differs where batches hold different numbers of valid tokens).
        total = torch.zeros((), dtype=torch.float32, device=self.state.device)
        tokens = torch.zeros((), dtype=torch.float32, device=self.state.device)
        for _ in range(self.cfg.data.eval_iters):
            microbatches = self._microbatches(self.valid_loader.next(gbs), nmb)
            ctx = self._step_context(microbatches, forward_only=True)
            # forward_only: each batch's loss is its token-loss sum over its valid tokens (ctx.num_tokens, all ranks)
            total += self._reduce_loss(self.forward_backward(self.chunks, microbatches, ctx)) * ctx.num_tokens
            tokens += ctx.num_tokens
        self.optimizer.release_gathered()  # ZeRO-3: a unit kept for its (absent) backward is freed
        self.logger.observe_evaluation(time.perf_counter() - start)  # the ETA counts the remaining evaluations
        return (total / tokens.clamp(min=1)).item()  # one host read per evaluation

    def current_lr(self) -> float:
        """The lr of the next iteration (after the last scheduler step, as Megatron logs it): what a checkpoint records."""
        return self.lr_schedule.current_lr()

    def logs_at(self, iteration: int) -> bool:
        return iteration % self.cfg.logging.log_interval == 0 or iteration == self.cfg.training.train_iters

    def run_iteration(self) -> IterationResult:
        start = time.perf_counter()
        self.iteration += 1
        gbs, nmb = self.batch_sizes()
        with self.timers(DATA_LOADING), self._own_work():
            batch = self.train_loader.next(gbs)
        if self.attention_pairs is not None:  # host integers of the host batch: nothing waits for the device
            rows = None if batch.documents is None else document_rows(batch.documents)
            self.attention_pairs += useful_pairs(rows, len(batch), self.cfg.model.seq_length, self.cfg.model.attention_window)
        maybe_inject(self.state.rank, self.iteration)  # tests only: $TRICORN_TEST_FAULT kills/stops/stalls a rank
        loss, info = self.train_step(batch, nmb)
        self.lr_schedule.after_step(gbs, info.skipped)  # Megatron's scheduler steps after a successful step only
        lr = None if self.lr_schedule.skippable else self.lr_schedule.current_lr()
        t = self.cfg.training
        if t.check_for_nan_in_loss_and_grad:
            self._track_nan(loss, info)
        if self.logs_at(self.iteration) and self.state.device.type == "cuda":
            torch.cuda.synchronize()  # the interval's wall time includes its kernels; other iterations run ahead
        result = IterationResult(loss, info.grad_norm, lr, info.skipped, info.loss_scale, gbs, nmb, time.perf_counter() - start)
        interval = t.nan_check_interval
        if self.logs_at(self.iteration) or (interval and self.iteration % interval == 0):
            self.check_nan()
        return result

    def _track_nan(self, loss: torch.Tensor, info) -> None:
        """Keep [iteration, loss, grad norm] of the first non-finite, not skipped iteration on the device."""
        norm = info.grad_norm if isinstance(info.grad_norm, torch.Tensor) else torch.full((), info.grad_norm, device=loss.device)
        bad = ~(torch.isfinite(loss) & torch.isfinite(norm))
        if isinstance(info.skipped, torch.Tensor):  # a Python False (no loss scaler) as a tensor would be a host copy
            bad = bad & ~info.skipped
        now = torch.stack(
            [torch.full((), float(self.iteration), dtype=torch.float64, device=loss.device), loss.double(), norm.double()]
        )
        first = self._nan_first if self._nan_first is not None else torch.zeros_like(now)
        self._nan_first = torch.where(bad & (first[0] == 0), now, first)

    def check_nan(self) -> None:
        """Raise NaNError if any iteration so far had a non-finite loss or grad norm (one host read)."""
        if self._nan_first is None:
            return
        iteration, loss, norm = self._nan_first.tolist()
        if iteration:
            raise NaNError(
                f"iteration {int(iteration)}: loss {loss} / grad norm {norm} is not finite; stopping "
                f"(detected after iteration {self.iteration}; --nan-check-interval 1 checks every iteration)"
            )

    def materialize(self, extra: Optional[torch.Tensor] = None) -> list[float]:
        """Read the unlogged results' device values into Python numbers, and `extra`'s values (returned, flat),
        with one host read."""
        fields = ("loss", "grad_norm", "skipped", "loss_scale")
        pending = [(r, f) for r in self.unlogged for f in fields if isinstance(getattr(r, f), torch.Tensor)]
        parts = [getattr(r, f).detach().to(self.state.device, torch.float64).reshape(1) for r, f in pending]
        if extra is not None:
            parts.append(extra.detach().to(self.state.device, torch.float64).flatten())
        values = torch.cat(parts).tolist() if parts else []
        for (r, f), v in zip(pending, values):
            setattr(r, f, bool(v) if f == "skipped" else v)
        self.skipped_iterations += sum(int(r.skipped) for r, f in pending if f == "skipped")
        return values[len(pending) :]

    def log(self, r: IterationResult) -> None:
        """Console line, TensorBoard and metrics of the iterations since the last log (logging.py); all ranks call it."""
        # Collectives on the device first (router statistics, each rank's own work), then one host read of everything.
        extras = {
            "moe": self.moe.collect() if self.moe is not None else None,
            "stragglers": self.stragglers.gather(len(self.unlogged)) if self.stragglers is not None else None,
            "spikes": self.spikes.records() if self.spikes is not None else None,
            "lr_skipped": self.lr_schedule.pending(),  # the samples of the skipped steps since the last log line
            "pairs": self._global_attention_pairs(),
        }
        present = {k: t.flatten() for k, t in extras.items() if t is not None}
        flat = self.materialize(torch.cat(list(present.values())) if present else None)
        values: dict[str, list[float]] = {}
        for k, t in present.items():
            values[k], flat = flat[: t.numel()], flat[t.numel() :]
        if "lr_skipped" in values:
            self.lr_schedule.settle(values["lr_skipped"][0])
        r.lr = self.lr_schedule.current_lr()  # Megatron's: after the last scheduler step
        if self.stragglers is not None:
            self.straggler_report = self.stragglers.report(values["stragglers"], self.iteration)
        if "pairs" in values:
            self.useful_attention_pairs, self.attention_pairs = int(values["pairs"][0]), 0
        self.logger.log_iteration(self)
        if self.moe is not None:
            moe = self.moe.values(values["moe"])
            self.logger.scalars(self.iteration, moe)
            self.logger.record(self.iteration, {"moe": moe})
        if self.spikes is not None:  # after the iteration's line: names the spiky iterations, may stop the run
            self.logger.scalars(self.iteration, self.spikes.report(values.get("spikes", []), self.iteration, self.logger.console))
            self.spikes.check_limit(self.iteration)

    def _global_attention_pairs(self) -> Optional[torch.Tensor]:
        """The pairs every DP rank's samples needed since the last log line (one all-reduce, at log lines only)."""
        if self.attention_pairs is None:
            return None
        pairs = torch.full((1,), float(self.attention_pairs), dtype=torch.float64, device=self.state.device)
        dist.all_reduce(pairs, group=self.state.dp_group)
        return pairs

    def train(self) -> None:
        t, d = self.cfg.training, self.cfg.data
        first_of_run = True
        while self.iteration < t.train_iters:
            self.profiler.begin(self.iteration + 1)
            report = first_of_run and hasattr(self.optimizer, "memory_tensors")
            # The peak tracker is a TorchDispatchMode, under which dynamo does not trace (and then never compiles
            # that code): with --torch-compile the report has only CUDA's allocator peak (none on CPU).
            by_kind = not self.cfg.model.torch_compile
            peak_of = iteration_peak(self.optimizer, self.chunks, self.state.device, by_kind) if report else nullcontext({})
            with peak_of as peak:
                result = self.run_iteration()
            self.unlogged.append(result)
            if report:
                write_memory_report(self.cfg, self.state, self.optimizer, peak)
            if self.cfg.model.torch_compile:
                self._compile_report(first_of_run)
            first_of_run = False
            if self.logs_at(self.iteration):
                self.log(result)
            if self.valid_loader is not None and d.eval_interval and self.iteration % d.eval_interval == 0:
                self.log_validation(self.evaluate())
            stop = False
            if self.on_iteration_end is not None:
                with self.timers(CHECKPOINT_STALL):  # shows in the next log: this iteration's line is already out
                    stop = self.on_iteration_end(self)
            self.profiler.end(self.iteration)  # the window's iteration range holds the log line and the save
            if stop:
                break

    def _compile_report(self, first: bool) -> None:
        """--torch-compile: "compiled N regions in S s" once, after iteration 1; a warning if training compiles again."""
        from tricorn.parallel.compile import recompiled_in_training, report_after_first_iteration

        if first:
            report_after_first_iteration(self.logger.console)
        elif recompiled_in_training() and not self._recompile_warned:
            self._recompile_warned = True
            warn(
                f"torch.compile compiled {recompiled_in_training()} more graph(s) in iteration {self.iteration}: "
                "a shape or guard changed after the first iteration (TORCH_LOGS=recompiles says which)"
            )

    def log_validation(self, loss: Optional[float]) -> None:
        if loss is not None:
            self.logger.log_validation(self.iteration, loss, self.train_loader.consumed_samples)
