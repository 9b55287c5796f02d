"""What a run reports: start-up block, console line with ETA, TensorBoard scalars, JSON lines, per-rank log files.

Sinks. Rank 0 writes TensorBoard (Megatron's tag names, each also as "<tag> vs tokens" on a
consumed-tokens axis, the resolved config as text), Weights & Biases with --wandb-project (the same
scalars; wandb_sink.py), the --metrics-file JSON lines and the console line. Every rank sends its
warnings (the ``tricorn.*`` loggers and Python warnings) to stderr tagged with its rank, and with --log-dir writes its own ``rank-NNNNN.log`` (console lines,
info messages, warnings, an uncaught traceback); rank 0 also writes ``config.yaml`` there.

Metrics per logged iteration (lm loss, times and rates over the iterations since the previous
log, as Megatron does; the rest as of the logged iteration): lm loss, learning-rate, batch-size, grad-norm, params-norm (--log-params-norm), loss-scale,
skipped-iterations (so far in this run), iteration-time (s), throughput (model TFLOP/s per device), tokens-per-sec,
mfu (percent; needs a peak: the GPU table or --peak-tflops), mem-allocated-bytes and
mem-max-allocated-bytes (CUDA allocator; process RSS on CPU; the largest rank), and with
--timing-log-level >= 1 "<phase>-time" (s per iteration; level 2 adds -min/-max over ranks); with more than
one rank straggler-slowest-rank, straggler-slowest-seconds and straggler-median-seconds (stragglers.py); with
--check-for-spiky-loss spiky-iterations (spikes.py).
FLOPs come from tricorn.planning.flops (model FLOPs for throughput and MFU; hardware FLOPs with
recomputation in the start-up block). The metrics-file records keep the iteration's own values.

Collectives (all ranks call the methods that have them): at start-up one all-gather of parameter
counts; each log one all-reduce (max) of a few scalars (memory; level-2 timers), plus one scalar
all-reduce over TP x PP for params-norm. These are logging-time only: nothing is added inside an
iteration at --timing-log-level 0. No device memory beyond those scalars.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch

from tricorn.config import Config, dump_yaml
from tricorn.planning.flops import IterationFlops, iteration_flops_for_config, mfu, tflops_per_device
from tricorn.planning.hardware import detect_gpu_type, mfu_dtype, peak_tflops
from tricorn.timers import PHASES, Timers
from tricorn.training.measurements import max_over_ranks, memory_bytes, parameter_counts, params_norm
from tricorn.training.wandb_sink import WandbSink

log = logging.getLogger("tricorn")
console_log = logging.getLogger("tricorn.console")
_HANDLER_MARK = "_tricorn_rank_handler"


# ---------------------------------------------------------------- per-rank logging


def setup_rank_logging(rank: int, log_dir: Optional[str]) -> list[logging.Handler]:
    """Warnings of every rank to stderr with its rank; with ``log_dir`` everything this rank logs to its own file."""
    remove_rank_logging()
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setLevel(logging.WARNING)
    stderr.setFormatter(logging.Formatter(f"tricorn [rank {rank}] %(levelname)s: %(message)s"))
    handlers: list[logging.Handler] = [stderr]
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        file = logging.FileHandler(rank_log_path(log_dir, rank), mode="a")
        file.setLevel(logging.INFO)
        file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handlers.append(file)
    logging.captureWarnings(True)  # warnings.warn (torch's too) -> the "py.warnings" logger
    for logger in (log, logging.getLogger("py.warnings")):
        logger.setLevel(logging.INFO)
        logger.propagate = False
        for h in handlers:
            setattr(h, _HANDLER_MARK, True)
            logger.addHandler(h)
    return handlers


def remove_rank_logging() -> None:
    for logger in (log, logging.getLogger("py.warnings")):
        for h in [h for h in logger.handlers if getattr(h, _HANDLER_MARK, False)]:
            logger.removeHandler(h)
            h.close()
        logger.propagate = True
    logging.captureWarnings(False)


def rank_log_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank-{rank:05d}.log")


def warn(message: str) -> None:
    """A warning from any rank: stderr with the rank, and this rank's log file."""
    if any(getattr(h, _HANDLER_MARK, False) for h in log.handlers):
        log.warning(message)
    else:
        print(f"tricorn: warning: {message}", file=sys.stderr, flush=True)


def format_duration(seconds: float) -> str:
    """0.42s / 12.3s under a minute (tiny runs still count down), else H:MM:SS (with days past 24 h)."""
    if seconds < 10:
        return f"{seconds:.2f}s"
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = int(round(seconds))
    days, rest = divmod(s, 86400)
    text = f"{rest // 3600}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}d {text}" if days else text


@dataclass(frozen=True)
class Interval:
    """The iterations since the previous log, summed or averaged (Megatron averages the loss over them)."""

    count: int
    seconds: float
    loss: float  # mean over iterations that were neither skipped nor non-finite
    skipped: int
    nan: int
    tokens: int
    tflops: float  # model TFLOP/s per device
    mfu_pct: Optional[float]
    consumed_samples: int

    @property
    def seconds_per_iteration(self) -> float:
        return self.seconds / self.count

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens / self.seconds


# ---------------------------------------------------------------- the logger


class MetricsLogger:
    """One per rank; only rank 0 writes TensorBoard, metrics and console, every rank its own log file."""

    def __init__(self, cfg: Config, rank: int, device: Optional[torch.device] = None):
        self.cfg = cfg
        self.rank = rank
        self.enabled = rank == 0
        self.device = torch.device(device or cfg.device or "cpu")
        self.writer: Optional[Any] = None
        self.metrics_file = None
        # --wandb-project: rank 0's W&B run, started by start_wandb once the checkpoint (and its run id) is loaded
        self.wandb = WandbSink(cfg) if self.enabled and cfg.logging.wandb_project else None
        self._last_seconds = 0.0  # the latest iteration's time: the ETA's pace before there is a mean
        self._warmed_up = False  # the first iteration (allocation, caches) is left out of the ETA's pace
        self._iter_seconds, self._iter_count = 0.0, 0
        self._eval_seconds, self._eval_count = 0.0, 0
        self._flops: dict[int, IterationFlops] = {}
        self.peak_tflops, self.peak_source = self._peak()
        self._handlers = setup_rank_logging(rank, cfg.logging.log_dir)
        if cfg.logging.log_dir:
            self._previous_excepthook = sys.excepthook
            sys.excepthook = self._excepthook
        if not self.enabled:
            return
        if cfg.logging.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=cfg.logging.tensorboard_dir)
            self.text("config", "    " + dump_yaml(cfg).replace("\n", "\n    "))  # indented: a markdown code block
        if cfg.logging.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.logging.metrics_file)), exist_ok=True)
            self.metrics_file = open(cfg.logging.metrics_file, "a")
        if cfg.logging.log_dir:
            _write_atomic(os.path.join(cfg.logging.log_dir, "config.yaml"), dump_yaml(cfg))

    def _peak(self) -> tuple[Optional[float], str]:
        t = self.cfg.training
        dtype = mfu_dtype(self.cfg.param_dtype_name, bool(t.fp8_format), t.tf32)
        override = self.cfg.logging.peak_tflops
        gpu = detect_gpu_type() if self.device.type == "cuda" and override is None else None
        try:
            peak = peak_tflops(gpu, dtype, override)
        except ValueError:
            peak = None
        source = "--peak-tflops" if override is not None else f"{gpu}, {dtype}" if peak else ""
        return peak, source

    def _excepthook(self, kind, value, tb) -> None:
        log.critical("uncaught exception", exc_info=(kind, value, tb))
        self._previous_excepthook(kind, value, tb)

    # ------------------------------------------------------------ sinks

    @property
    def wandb_run_id(self) -> Optional[str]:
        return self.wandb.run_id if self.wandb is not None else None

    def start_wandb(self, resume_id: Optional[str]) -> None:
        """--wandb-project (rank 0): start the W&B run; `resume_id` (from the loaded checkpoint) continues that one."""
        if self.wandb is not None:
            self.wandb.start(resume_id)

    def scalars(self, iteration: int, values: dict[str, float], tokens: Optional[int] = None) -> None:
        """Each value at ``iteration``, and as "<tag> vs tokens" at ``tokens`` consumed tokens when given (W&B: the same
        values at the same iteration, and the tokens as ``consumed-tokens``)."""
        if self.wandb is not None:
            self.wandb.log(iteration, values, tokens)
        if self.writer is None:
            return
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, iteration)
            if tokens is not None:
                self.writer.add_scalar(f"{tag} vs tokens", value, tokens)

    def record(self, iteration: int, values: dict[str, Any]) -> None:
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps({"iteration": iteration, **values}) + "\n")
            self.metrics_file.flush()

    def console(self, line: str) -> None:
        if self.enabled:
            print(line, flush=True)
            console_log.info(line)

    def text(self, tag: str, text: str) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.close()
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None
        if self.metrics_file is not None:
            self.metrics_file.close()
            self.metrics_file = None
        if getattr(self, "_previous_excepthook", None) is not None:
            sys.excepthook = self._previous_excepthook
        remove_rank_logging()

    # ------------------------------------------------------------ start-up

    def startup(self, state: Any, chunks: list[torch.nn.Module], batch_sizes: Optional[tuple[int, int]] = None) -> None:
        """The start-up block (rank 0) and each rank's own line in its log file. All ranks must call it.

        ``batch_sizes``: (global batch, microbatches) of the first iteration (ramp-up starts small).
        The measured memory report follows after iteration 1 (memory_report.py).
        """
        cfg, p, t = self.cfg, self.cfg.parallel, self.cfg.training
        counts = parameter_counts(chunks, state)
        log.info(f"rank {state.rank} = {state.grid_name()}: {counts.per_rank[state.rank]:,} parameters on this rank")
        gbs, nmb = batch_sizes or (t.global_batch_size, cfg.num_microbatches)
        f = self.flops(gbs)
        schedule = (
            (
                "interleaved 1f1b"
                if cfg.virtual_stages > 1 and p.pipeline_schedule not in ("zbv", "dualpipev")
                else p.pipeline_schedule
            )
            if p.pipeline_model_parallel_size > 1
            else "none"
        )
        stages = ", ".join(f"{n:,} (pp{i})" for i, n in enumerate(counts.per_stage))
        rampup = f" | ramp-up {' '.join(map(str, t.rampup_batch_size))}" if t.rampup_batch_size else ""
        recompute = cfg.model.recompute_granularity or "none"
        if self.peak_tflops:
            peak = f"peak {self.peak_tflops:g} TFLOP/s per device ({self.peak_source})"
        else:
            peak = "MFU not shown: " + ("pass --peak-tflops" if self.device.type == "cpu" else "unknown GPU, pass --peak-tflops")
        rule = "tricorn: " + "-" * 72
        lines = [
            rule,
            f"tricorn: layout     world {state.world_size} = TP {p.tensor_model_parallel_size} x PP {p.pipeline_model_parallel_size} "
            f"(VPP {cfg.virtual_stages}) x CP {p.context_parallel_size} x DP {state.dp_size} | schedule {schedule} | "
            f"SP {'on' if p.sequence_parallel else 'off'} | device {self.device.type} | {cfg.param_dtype_name}",
            f"tricorn: batches    global {gbs} = micro {t.micro_batch_size} x {nmb} microbatches x DP {state.dp_size} | "
            f"seq {cfg.model.seq_length} | {f.tokens:,} tokens per iteration{rampup}",
            f"tricorn: parameters {counts.total:,} total | per rank {min(counts.per_rank):,} .. {max(counts.per_rank):,} | "
            f"per stage {stages}",
            f"tricorn: flops      model {f.model:.4g} per iteration, hardware {f.hardware:.4g} (recompute {recompute}) | {peak}",
            f"tricorn: logs       tensorboard {cfg.logging.tensorboard_dir or '-'} | per-rank logs {cfg.logging.log_dir or '-'} | "
            f"timing level {cfg.logging.timing_log_level} | {t.train_iters} iterations",
            *_memory_estimate_lines(cfg),
            rule,
        ]
        for line in lines:
            self.console(line)

    def flops(self, global_batch_size: int) -> IterationFlops:
        if global_batch_size not in self._flops:
            self._flops[global_batch_size] = iteration_flops_for_config(self.cfg, global_batch_size=global_batch_size)
        return self._flops[global_batch_size]

    # ------------------------------------------------------------ per iteration

    def log_iteration(self, trainer: Any) -> None:
        """Log the iterations since the last call (``trainer.unlogged``, emptied here); all ranks must call it (collectives)."""
        cfg, iteration = self.cfg, trainer.iteration
        results = list(trainer.unlogged)
        trainer.unlogged.clear()  # a run of a million iterations keeps only one log interval
        if not results:
            return
        self.observe_iterations(results)
        iv = self._interval(results, trainer)
        timers: Timers = getattr(trainer, "timers", None) or Timers.disabled()
        phase_times = {k: v / iv.count for k, v in timers.read().items()}
        (mem_alloc, mem_max), min_max = self._reduce_over_ranks(phase_times, timers.reduce_across_ranks, trainer.state.device)
        pnorm = params_norm(trainer.chunks, trainer.state, trainer.optimizer) if cfg.logging.log_params_norm else None
        eta = self.eta_seconds(trainer)
        last = results[-1]

        values = {
            "lm loss": iv.loss,
            "learning-rate": last.lr,
            "batch-size": last.global_batch_size,
            "grad-norm": last.grad_norm,
            "loss-scale": last.loss_scale,
            "skipped-iterations": getattr(trainer, "skipped_iterations", iv.skipped),  # this run so far (console: interval)
            "iteration-time": iv.seconds_per_iteration,
            "throughput": iv.tflops,
            "tokens-per-sec": iv.tokens_per_sec,
            "mem-allocated-bytes": mem_alloc,
            "mem-max-allocated-bytes": mem_max,
            **({"params-norm": pnorm} if pnorm is not None else {}),
            **({"mfu": iv.mfu_pct} if iv.mfu_pct is not None else {}),
        }
        straggler = getattr(trainer, "straggler_report", None)  # slowest rank and median (stragglers.py)
        if straggler is not None:
            values.update(straggler.scalars())
        self.scalars(iteration, values, iv.consumed_samples * cfg.model.seq_length)
        timer_values = {f"{k}-time": v for k, v in phase_times.items()}
        for name, (lo, hi) in min_max.items():
            timer_values[f"{name}-time-min"], timer_values[f"{name}-time-max"] = lo, hi
        self.scalars(iteration, timer_values)
        self.record(
            iteration,
            {
                "loss": last.loss,
                "grad_norm": last.grad_norm,
                "lr": last.lr,
                "skipped": last.skipped,
                "loss_scale": last.loss_scale,
                "batch_size": last.global_batch_size,
                "consumed_samples": iv.consumed_samples,
                "iteration_time": iv.seconds_per_iteration,
                "tokens_per_sec": iv.tokens_per_sec,
                "tflops_per_device": iv.tflops,
                "eta_s": eta,
                "mem_allocated_bytes": mem_alloc,
                "mem_max_allocated_bytes": mem_max,
                **({"params_norm": pnorm} if pnorm is not None else {}),
                **({"mfu": iv.mfu_pct} if iv.mfu_pct is not None else {}),
                **({"timers": phase_times} if phase_times else {}),
                **({"straggler": straggler.scalars()} if straggler is not None else {}),
            },
        )
        self.console(_console_line(iteration, cfg.training.train_iters, iv, last, pnorm, eta, straggler))
        if phase_times:
            self.console(_timers_line(phase_times, min_max))

    def _interval(self, results: list[Any], trainer: Any) -> Interval:
        cfg = self.cfg
        seconds = sum(r.seconds for r in results)
        good = [r.loss for r in results if not r.skipped and math.isfinite(r.loss)]
        model_flops = sum(self.flops(r.global_batch_size).model for r in results)
        peak = self.peak_tflops
        return Interval(
            count=len(results),
            seconds=seconds,
            loss=sum(good) / len(good) if good else float("nan"),
            skipped=sum(r.skipped for r in results),
            nan=sum(1 for r in results if not r.skipped and not math.isfinite(r.loss)),
            tokens=sum(r.global_batch_size for r in results) * cfg.model.seq_length,
            tflops=tflops_per_device(model_flops, seconds, cfg.world_size),
            mfu_pct=100 * mfu(model_flops, seconds, cfg.world_size, peak) if peak else None,
            consumed_samples=trainer.train_loader.consumed_samples,
        )

    def _reduce_over_ranks(
        self, phase_times: dict[str, float], min_max: bool, device: torch.device
    ) -> tuple[tuple[float, float], dict[str, tuple[float, float]]]:
        """Memory of the largest rank and (level 2) each phase's min/max over ranks: one all-reduce (max)."""
        vector = list(memory_bytes(self.device))
        if min_max:
            for name in PHASES:  # a fixed order: every rank sends the same layout, used or not
                t = phase_times.get(name, 0.0)
                vector += [1.0 if name in phase_times else 0.0, t, -t]
        vector = max_over_ranks(vector, device)
        out = {}
        for i, name in enumerate(PHASES if min_max else ()):
            used, t_max, neg_min = vector[2 + 3 * i : 5 + 3 * i]
            if used:
                out[name] = (-neg_min, t_max)
        return (vector[0], vector[1]), out

    def observe_iterations(self, results: list[Any]) -> None:
        """Feed the ETA's pace: the seconds of each training iteration (the run's first one is left out)."""
        for r in results:
            self._last_seconds = r.seconds
            if self._warmed_up:
                self._iter_seconds += r.seconds
                self._iter_count += 1
            self._warmed_up = True

    def observe_evaluation(self, seconds: float) -> None:
        self._eval_seconds += seconds
        self._eval_count += 1

    def eta_seconds(self, trainer: Any) -> float:
        """Remaining iterations at the mean pace so far (the first, warm-up iteration excluded), plus remaining evaluations.

        Called after iteration ``trainer.iteration`` and before its evaluation, so that evaluation still counts.
        """
        t, d = self.cfg.training, self.cfg.data
        pace = self._iter_seconds / self._iter_count if self._iter_count else self._last_seconds
        eta = max(t.train_iters - trainer.iteration, 0) * pace
        if getattr(trainer, "valid_loader", None) is not None and d.eval_interval:
            evals = t.train_iters // d.eval_interval - (trainer.iteration - 1) // d.eval_interval
            # Before the first evaluation, guess: a forward is about a third of a training iteration.
            per_eval = self._eval_seconds / self._eval_count if self._eval_count else d.eval_iters * pace / 3
            eta += max(evals, 0) * per_eval
        return eta

    def log_validation(self, iteration: int, loss: float, consumed_samples: Optional[int] = None) -> None:
        ppl = math.exp(min(loss, 20.0))
        tokens = consumed_samples * self.cfg.model.seq_length if consumed_samples is not None else None
        self.scalars(iteration, {"lm loss validation": loss, "lm loss validation ppl": ppl}, tokens)
        self.record(iteration, {"valid_loss": loss, "valid_ppl": ppl})
        self.console(f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E}")


def _memory_estimate_lines(cfg: Config) -> list[str]:
    """The estimator's worst rank (planning/memory.py); what the ranks really hold is reported after iteration 1."""
    from tricorn.planning.memory import estimate_config

    try:
        e = estimate_config(cfg)
    except Exception as exc:  # the estimate is advice: a config it cannot model must still train
        return [f"tricorn: memory     no estimate ({exc})"]
    mib = 2**20
    return [
        f"tricorn: memory     estimate for the worst rank (stage {e.stage}): model state {e.model_state_bytes / mib:.1f} MiB + "
        f"activations {e.activation_bytes / mib:.1f} MiB + logits {e.embedding_logits_bytes / mib:.1f} MiB + "
        f"buffers {(e.buffer_bytes + e.overhead_bytes) / mib:.1f} MiB = {e.total_bytes / mib:.1f} MiB; "
        "measured model state after iteration 1"
    ]


def _console_line(
    iteration: int, total: int, iv: Interval, last: Any, pnorm: Optional[float], eta: float, straggler: Any = None
) -> str:
    """Megatron's training_log line, plus params norm, tokens/s, TFLOP/s per device, MFU and ETA."""
    parts = [
        f" iteration {iteration:8d}/{total:8d}",
        f"consumed samples: {iv.consumed_samples:12d}",
        f"elapsed time per iteration (ms): {1000 * iv.seconds_per_iteration:.1f}",
        f"learning rate: {last.lr:.6E}",
        f"global batch size: {last.global_batch_size:5d}",
        f"lm loss: {iv.loss:.6E}",
        f"loss scale: {last.loss_scale:.1f}",
        f"grad norm: {last.grad_norm:.3f}",
        *([f"params norm: {pnorm:.3f}"] if pnorm is not None else []),
        f"number of skipped iterations: {iv.skipped:3d}",
        f"number of nan iterations: {iv.nan:3d}",
        f"tokens/s: {iv.tokens_per_sec:.0f}",
        f"TFLOP/s per device: {iv.tflops:.3g}",
        *([f"MFU: {iv.mfu_pct:.1f}%"] if iv.mfu_pct is not None else []),
        *([straggler.console()] if straggler is not None else []),
        f"ETA: {format_duration(eta)}",
    ]
    return " | ".join(parts)


def _timers_line(times: dict[str, float], min_max: dict[str, tuple[float, float]]) -> str:
    parts = []
    for name in [*[p for p in PHASES if p in times], *sorted(set(times) - set(PHASES))]:
        text = f"{name} {1000 * times[name]:.2f}"
        if name in min_max:
            lo, hi = min_max[name]
            text += f" (min {1000 * lo:.2f}, max {1000 * hi:.2f})"
        parts.append(text)
    return "    timers (ms per iteration" + (", min/max over ranks" if min_max else "") + "): " + " | ".join(parts)


def _write_atomic(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)
