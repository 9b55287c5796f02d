"""Entry point of pretrain_gpt.py / `tricorn train`: validate, build, train.

Order matters for "fail before launching": the config (and the tokenizer's
vocabulary) are checked before any process group exists; only then are the
groups, the model, the optimizer and the loaders built.
"""

from __future__ import annotations

import sys
import traceback
from typing import Optional

from tricorn.config import Config
from tricorn.launch_errors import (
    CONFIG_ERROR,
    HANG_ERROR,
    RUN_ERROR,
    fail,
    inherited_identity,
    launch_rank,
    write_error_file,
)


def resolve_config(argv: Optional[list[str]]) -> Config:
    from tricorn.config import ConfigError
    from tricorn.config_args import config_from_args
    from tricorn.parallel.state import world_size_from_env
    from tricorn.training.wandb_sink import wandb_errors
    from tricorn.validation import output_path_errors, validate

    try:
        cfg = config_from_args(argv, world_size=world_size_from_env())
        if cfg.device == "cuda" and not _cuda_visible():
            raise ConfigError("--device cuda was given but no CUDA device is visible; use --device cpu")
        # The output paths first: reading the data files already writes (the token-range cache in
        # --data-cache-path), and nothing may be created where a path is unusable.
        errors = output_path_errors(cfg)
        errors = errors or _prepare_vocab(cfg)
        errors += validate(cfg) if not errors else []
        errors += wandb_errors(cfg) if not errors else []  # --wandb-project: the package and a login on this machine
        if not errors and cfg.device == "cuda":  # memory estimate vs the device (GPU only: CPU RAM is not the limit)
            from tricorn.planning.estimate import memory_errors, visible_device_memory

            errors += memory_errors(cfg, visible_device_memory()) + _attention_kernel_errors(cfg)
    except ConfigError as e:
        errors = [str(e)]
    if errors:
        # One line, from one rank, exit 2 on every rank: every problem, the most layout-relevant first.
        sys.exit(fail("; also: ".join(errors), CONFIG_ERROR, prints=launch_rank() == 0))
    if cfg.megatron_notice and launch_rank() == 0:  # a Megatron command line: its no-ops, in one line
        print(f"tricorn: {cfg.megatron_notice}", flush=True)
    return cfg


def _attention_kernel_errors(cfg: Config) -> list[str]:
    """Documents / windows whose block calls no fused kernel of this GPU takes (attention_kernels.py)."""
    if not (cfg.data.reset_attention_mask or cfg.model.attention_window is not None):
        return []  # plain causal attention: SDPA picks its kernel (math_fallback_warning says when it is math)
    import torch

    from tricorn.attention_kernels import masked_attention_refusal

    line = masked_attention_refusal(cfg, torch.cuda.get_device_capability())
    return [line] if line else []


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def _prepare_vocab(cfg: Config) -> list[str]:
    from tricorn.data.loader import prepare_vocab

    return prepare_vocab(cfg)


def build(cfg: Config, state):
    """Model chunks, optimizer, loaders and the forward/backward function for this rank."""
    from tricorn.model.init import InitSpec, materialize
    from tricorn.parallel.compile import apply_compile
    from tricorn.parallel.context import apply_context_parallel
    from tricorn.parallel.expert import apply_expert_parallel, apply_expert_tensor_parallel
    from tricorn.parallel.offload import apply_offload
    from tricorn.parallel.optimizer import Optimizer
    from tricorn.parallel.pipeline.build import build_model_chunks
    from tricorn.parallel.pipeline.executor import PipelineExecutor
    from tricorn.parallel.recompute import apply_recompute
    from tricorn.parallel.step import forward_backward_no_pipelining
    from tricorn.parallel.tensor import seed_default_stream, tensor_parallel_spec
    from tricorn.training.activation_probe import attach_trainer_probe

    seed_default_stream(cfg.training.seed, state.pp_rank)
    spec = apply_context_parallel(tensor_parallel_spec(cfg, state.tp_group), state.cp_group, cfg.parallel.cp_comm_type)
    spec = apply_expert_tensor_parallel(apply_expert_parallel(spec, state.ep_group), cfg, state.tp_group)
    if cfg.model.transformer_impl == "transformer_engine":
        from tricorn.parallel.te import te_spec

        spec = te_spec(spec, cfg, state.tp_group, state.device)
    elif cfg.training.fp8_format:  # native FP8: the local linears' GEMMs through torch._scaled_mm
        from tricorn.parallel.fp8 import FP8Recipe, fp8_spec

        t = cfg.training
        recipe = FP8Recipe.from_config(t.fp8_format, t.fp8_recipe, state.tp_group, state.cp_group, state.cp_tp_group)
        spec = fp8_spec(spec, recipe)
    # One chunk per virtual pipeline stage of this rank (the whole model without PP), built on meta with
    # hollow parameters that the DP buckets fill (ZeRO-3: only the owned shard); native FP8's linears are the local
    # ones, and TE's Linear builds on meta too (deferred init).
    hollow = True
    chunks = build_model_chunks(cfg, spec, state.pp_rank, state.tp_size, state.device, hollow=hollow)
    # --torch-compile: each layer's forward compiled (before recompute, whose checkpoints wrap the compiled layer)
    apply_compile(chunks, cfg.model.torch_compile)
    apply_recompute(chunks, cfg.model)  # --recompute-granularity: checkpoint layers / modules in place
    apply_offload(chunks, cfg, state.device)  # --cpu-offloading-num-layers: around the recompute wrappers
    for chunk in chunks:
        cast_params(chunk, cfg)
    if cfg.training.fp8_format and cfg.model.transformer_impl == "transformer_engine":
        from tricorn.parallel.te import amax_reduction_group, enable_fp8

        enable_fp8(chunks, cfg, amax_reduction_group(state.mesh))
    for chunk in chunks:  # frozen parameters: the DP buckets of the optimizer materialise the trainable ones
        materialize(chunk, InitSpec(cfg.training.seed, cfg.model.init_method_std, cfg.model.num_layers), frozen_only=True)
    optimizer = Optimizer(cfg, state, chunks)
    # Counts what iteration 1 saves for backward; write_memory_report reads it after that iteration.
    attach_trainer_probe(chunks, forwards=cfg.num_microbatches * len(chunks))
    forward_backward = PipelineExecutor(cfg, state) if state.pp_size > 1 else forward_backward_no_pipelining
    return chunks, optimizer, forward_backward


def cast_params(model, cfg: Config) -> None:
    """--bf16/--fp16: parameters in half precision (drawn in fp32 first, so init is the same at any dtype).

    Buffers (RoPE tables) stay fp32; norms, softmax and the loss compute in fp32 regardless.
    """
    import torch

    from tricorn.model.init import cast_parameter

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.param_dtype_name)
    if dtype is not None:
        for p in model.parameters():
            if p.requires_grad:  # the MoE expert bias (moved by counts, not gradients) stays fp32
                cast_parameter(p, dtype)


def build_loaders(cfg: Config, state):
    """(train, valid) loaders of this DP rank (mock data or the .bin/.idx datasets)."""
    from tricorn.data.loader import build_loaders as data_loaders
    from tricorn.pinned import pins_host_memory

    train, valid, _ = data_loaders(cfg, state.dp_rank, state.dp_size)
    for loader in (train, valid):  # pinned batches: the copies of their microbatches do not make the host wait
        if loader is not None:
            loader.pin_memory = pins_host_memory(state.device)
    if cfg.data.num_workers > 0:  # worker processes build the next batches (same samples, same order)
        from tricorn.data.prefetch import PrefetchingBatchLoader
        from tricorn.parallel.batch_schedule import MicrobatchCalculator

        schedule = MicrobatchCalculator.from_config(cfg)
        train = PrefetchingBatchLoader(
            train, cfg.data.num_workers, schedule.global_batch_size_at, pin_memory=state.device.type == "cuda"
        )
    return train, valid


def build_trainer(cfg: Config, state, logger, with_validation: bool = True):
    """The whole training setup of this rank. Used by main() and the benchmarks."""
    from tricorn.parallel.expert import MoEMonitor
    from tricorn.timers import Timers
    from tricorn.training.loop import Trainer
    from tricorn.training.spikes import SpikeGuard
    from tricorn.training.stragglers import StragglerMonitor

    chunks, optimizer, forward_backward = build(cfg, state)
    train_loader, valid_loader = build_loaders(cfg, state)
    timers = Timers(cfg.logging.timing_log_level, state.device)
    trainer = Trainer(
        cfg,
        state,
        chunks,
        optimizer,
        train_loader,
        valid_loader if with_validation else None,
        logger,
        forward_backward,
        timers=timers,
        moe=MoEMonitor.for_model(cfg, chunks, state),
        spikes=SpikeGuard.from_config(cfg, state.device),
        stragglers=StragglerMonitor.from_config(cfg, state),
    )
    return trainer


def _warn_math_attention(cfg: Config, state) -> None:
    """One line (rank 0) when attention can only run torch's math kernel on this GPU (fp32 with GQA)."""
    import torch

    from tricorn.attention_kernels import math_fallback_warning
    from tricorn.training.logging import warn

    if state.rank != 0 or state.device.type != "cuda":
        return
    line = math_fallback_warning(cfg, torch.cuda.get_device_capability(state.device))
    if line:
        warn(line)


def main(argv: Optional[list[str]] = None) -> int:
    try:
        return _run(argv)
    except Exception as e:  # a bug outside training (that one is caught below): torchrun's summary shows it too
        write_error_file(f"{type(e).__name__}: {e}", traceback.format_exc())
        raise


def _run(argv: Optional[list[str]]) -> int:
    inherited = inherited_identity()  # an srun task with a submitting shell's RANK/WORLD_SIZE: SLURM's win, one line
    if inherited and launch_rank() == 0:
        print(f"tricorn: warning: {inherited}", file=sys.stderr, flush=True)
    cfg = resolve_config(argv)
    if cfg.dry_run:  # the memory estimate of this exact config, no process group, no model
        from tricorn.planning.estimate import format_report

        if launch_rank() == 0:
            print(format_report(cfg))
        return 0
    from tricorn.checkpoint.io import load_errors
    from tricorn.parallel.state import destroy_parallel, init_parallel
    from tricorn.training.signals import ExitConditions

    damaged = load_errors(cfg)  # the --load checkpoint's files, checked alike on every rank before anything starts
    if damaged:
        return fail(damaged[0], RUN_ERROR, prints=launch_rank() == 0)

    exits = ExitConditions(cfg)  # from here on --exit-signal means "save and exit 0", not "die"
    from tricorn.training.flight_recorder import configure as configure_flight_recorder

    configure_flight_recorder(cfg, rank=launch_rank())  # torch reads its variables when the process group is made
    code = 1
    try:
        code = _train(cfg, init_parallel(cfg), exits)
    except Exception as e:  # a bug, not a user error: show it, then still tear down in order (below)
        traceback.print_exc()
        write_error_file(f"{type(e).__name__}: {e}", traceback.format_exc())  # torchrun's summary shows it
    finally:
        # Every object holding a process group or a gloo work died with _train's frame; destroy_parallel
        # collects what cycles kept, so no C++ communicator outlives the interpreter (issue: abort at exit).
        destroy_parallel(clean_exit=code == 0)
    return code


def _train(cfg: Config, state, exits) -> int:
    """Build, load, train, save; 0 on success, 1 on a user-facing error (one line on stderr)."""
    from tricorn.checkpoint.checkpointer import Checkpointer, CheckpointError
    from tricorn.data.errors import DataError
    from tricorn.profiling import Profiler
    from tricorn.training import oom
    from tricorn.training.logging import MetricsLogger
    from tricorn.training.loop import NaNError
    from tricorn.training.spikes import SpikeLimit
    from tricorn.training.watchdog import Watchdog

    logger = MetricsLogger(cfg, state.rank, state.device)
    ckpt = trainer = None
    profiler = Profiler.from_config(cfg, state)
    profiler.start_memory_history()  # --record-memory-history: before the model, so every allocation is in it
    watchdog = Watchdog(cfg, state).start()  # a stopped, dead or stuck rank is named; every rank exits 75
    try:
        trainer = build_trainer(cfg, state, logger)
        trainer.profiler = profiler
        watchdog.iteration = lambda: trainer.iteration
        logger.startup(state, trainer.chunks, trainer.batch_sizes())  # layout, parameters, FLOPs, memory estimate
        _warn_math_attention(cfg, state)
        ckpt = Checkpointer(cfg, state, logger.console)
        ckpt.load(trainer)  # --load: model, optimizer, data position, RNG (any saved layout)
        logger.start_wandb(ckpt.loaded_meta.get("wandb_run_id"))  # --wandb-project: a resume continues the same run
        trainer.on_iteration_end = ckpt.iteration_hook(exits)
        trainer.train()
        profiler.finish(trainer.iteration)  # a window an exit signal cut short; the whole run's memory history
        ckpt.finish(trainer)  # the final save, and the wait for a background one
        trainer.optimizer.wait_all()  # nothing in flight when the groups go
        return 0
    except SpikeLimit as e:  # raised alike on every rank at a log line: save, then one line
        ckpt.finish(trainer)
        trainer.optimizer.wait_all()  # nothing in flight when the groups go
        saved = (
            f"checkpoint of iteration {trainer.iteration} saved in {cfg.checkpoint.save}" if cfg.checkpoint.save else "no --save"
        )
        return fail(f"{e} ({saved})", RUN_ERROR, prints=state.rank == 0)
    except (NaNError, DataError, CheckpointError) as e:
        # Raised alike on every rank (checked before, or gathered by, the collectives): printed once.
        return fail(str(e), RUN_ERROR, prints=state.rank == 0)
    except RuntimeError as e:  # a dead or stopped peer: one line naming the collective, not gloo's traceback
        from tricorn.parallel.failures import collective_failure, peer_named

        if oom.is_out_of_memory(e):  # one line from each rank that ran out, exit 3, nothing saved after it
            return oom.report(e, cfg, state, trainer.iteration if trainer is not None else 0, profiler)

        line = collective_failure(e, state.rank, state.world_size, cfg.parallel.distributed_timeout_minutes)
        if line is None:
            raise
        if watchdog.explain_failure():  # the watchdog named the rank that is gone and ends the process (75)
            return HANG_ERROR
        # Every survivor times out: rank 0 says it, or whoever lost rank 0.
        return fail(line, RUN_ERROR, prints=state.rank == 0 or peer_named(line) == 0)
    finally:
        watchdog.stop()  # first: the peers must not take this rank's leaving for a hang
        profiler.close(trainer.iteration if trainer is not None else 0)  # a window an error cut short: its trace
        if ckpt is not None:
            ckpt.close()  # joins the background save thread
        logger.close()  # joins TensorBoard's writer thread
        if trainer is not None:
            trainer.optimizer.close()
            getattr(trainer.train_loader, "close", lambda: None)()  # --num-workers: stop the prefetch workers


if __name__ == "__main__":
    sys.exit(main())
