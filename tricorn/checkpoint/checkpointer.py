"""Sharded checkpoints in global coordinates: save, async save, resume on any layout, exit conditions.

Every tensor goes into torch.distributed.checkpoint (DCP) under its global name
and global shape, so any TP/PP/VPP/DP layout, with or without the distributed
optimizer and at any ZeRO stage, loads any other:

    model.<name>                   the parameter (layers keyed by global layer id), in global shape (its
                                   real rows: vocab padding is never saved), written in pieces by the
                                   ranks that own them (see Streaming)
    optim.<name>.exp_avg/.exp_avg_sq   Adam moments, same shape and split as the parameter
    optim.<name>.master            fp32 master weights (only when parameters are bf16/fp16)

A mixture of experts' stacked weights are saved one expert at a time, as model.<...>.experts.<e>.w1 etc.
with that expert's global index (pieces.py), so the expert-parallel split is free to change;
the MoE router's expert bias (--moe-router-enable-expert-bias, no optimizer state) is saved whole by one
rank per pipeline stage and read whole by every rank holding its layer.
A tied head copy on the last pipeline stage is not saved; it loads from the
embedding. Non-tensor state is JSON/YAML (io.py): iteration,
consumed samples, optimizer step, loss scaler, layout, config, and per-rank
RNG states keyed by grid position (restored only on an identical layout,
otherwise re-derived from the seed and the iteration).

Streaming (pieces.py): each rank writes only the pieces it owns - per parameter the range of
its TP-local tensor that its optimizer shard covers (1/(DP x CP) with the distributed optimizer, at any ZeRO
stage, 1/expert-DP of the experts under EP; without it DP rank 0's copy, expert-DP rank 0's for experts),
cut into global rectangles - straight from its live flat buffers:
parameter values, fp32 master, Adam moments. A load asks DCP for the pieces this rank owns in the new
layout and reads them into the same buffers; the parameters then follow the masters, and the distributed
optimizer all-gathers them (ZeRO-1/2; ZeRO-3 keeps its shards). Nothing is gathered per parameter, and
ZeRO-3 never materialises a layer for a checkpoint.

Atomicity: every rank writes into DIR/iter_N.tmp-<token>; once DCP's collective
finish has returned on all ranks, rank 0 renames it to DIR/iter_N, then
replaces latest_checkpointed_iteration.txt (write temp + rename), then prunes
(--keep-last-n-checkpoints). --async-save copies the state to CPU memory (the
only stall) and writes it on a background thread over a dedicated gloo group;
the next save, or the exit, waits for it.

Collectives: a save = one broadcast (temp name), one scalar all-reduce (step), DCP's plan/finish
gathers, one gather of the checksums, two barriers; a load = one all-gather of checksum results (unless
--no-verify-checkpoint), DCP's plan gathers, then the distributed optimizer's parameter all-gather.
Checksums: each rank hashes the shard it wrote on the writer thread (the background thread with
--async-save) and its RNG file; rank 0 writes them with its own files' into checksums.json before the
rename that publishes the save.
Memory: a sync save nothing beyond the rank's own state but DCP's staging of one piece at a time (at most
one parameter's owned range; bench/checkpoint.py and tests/test_checkpoint.py measure the peak); an async save
one CPU copy of what this rank owns; a load nothing (it reads into the optimizer's buffers).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from tricorn.checkpoint import io
from tricorn.checkpoint.checksums import file_checksums
from tricorn.checkpoint.io import CheckpointError
from tricorn.checkpoint.optim_state import MomentLoad, bound_tensors, saved_fields, state_dtypes, switch_line
from tricorn.checkpoint.pieces import Piece, owned_parts, owned_tensor
from tricorn.checkpoint.staging import HostStaging, Staged
from tricorn.config import Config, dump_yaml
from tricorn.model.init import INIT_KEY_ATTR, is_expert, is_tp_split
from tricorn.parallel.state import ParallelState
from tricorn.profiling import span_of


def _named_params(chunks: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """(checkpoint name, parameter) for every parameter of this rank, in the same order on every DP rank."""
    return [(getattr(p, INIT_KEY_ATTR, n), p) for c in chunks for n, p in c.named_parameters()]


def _is_copy(p: torch.Tensor) -> bool:
    return hasattr(p, INIT_KEY_ATTR)


def _frozen(chunks: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """Parameters outside the optimizer (the MoE expert bias), which checkpoints save whole."""
    return [(n, p) for n, p in _named_params(chunks) if not p.requires_grad]


Where = tuple[tuple[int, ...], list[Piece]]  # a checkpoint tensor's global shape and the pieces this rank holds


class Checkpointer:
    def __init__(self, cfg: Config, state: ParallelState, console: Callable[[str], None] = print):
        self.cfg = cfg
        self.state = state
        self.console = console
        c = cfg.checkpoint
        self.root = Path(c.save) if c.save else None
        # A separate gloo group: async saves run DCP's collectives on a thread while training uses the others.
        # Its own timeout too: a peer that dies mid-save is an error after --distributed-timeout-minutes, not a hang.
        timeout = timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
        self.group = dist.new_group(backend="gloo", timeout=timeout) if (c.save or c.load) else None
        self.executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.pending: Optional[concurrent.futures.Future] = None
        self.staging = HostStaging()  # --async-save: pinned host buffers and a side stream on CUDA
        self.last_saved: Optional[int] = None
        self.loaded_iteration = 0
        self.loaded_meta: dict[str, Any] = {}  # meta.json of the checkpoint --load resumed from
        self.stall_seconds: list[float] = []  # training time each save took (bench/checkpoint.py)

    # ------------------------------------------------------------ what is saved

    def layout(self) -> dict[str, Any]:
        s, p = self.state, self.cfg.parallel
        return {
            "tp": s.tp_size,
            "pp": s.pp_size,
            "vpp": self.cfg.virtual_stages,
            "cp": s.cp_size,
            "dp": s.dp_size,
            "ep": p.expert_model_parallel_size,
            "etp": p.expert_tensor_parallel_size,
            "world": s.world_size,
            "distributed_optimizer": p.use_distributed_optimizer,
            "zero_stage": p.zero_stage,
            "params_dtype": self.cfg.param_dtype_name,
        }

    def _rng_states(self) -> dict[str, torch.Tensor]:
        states = {"cpu": torch.get_rng_state()}
        if self.state.device.type == "cuda":
            states["cuda"] = torch.cuda.get_rng_state(self.state.device)
        return states

    def _meta(self, trainer) -> dict[str, Any]:
        opt = trainer.optimizer
        steps = [float(ps.step) for ps in opt.sharded_param_state()]
        step = torch.tensor([max(steps, default=0.0)])
        dist.all_reduce(step, op=dist.ReduceOp.MAX, group=self.group)  # a rank may own no optimizer state
        scaler = getattr(opt, "scaler", None)
        return {
            "format_version": io.FORMAT_VERSION,
            "iteration": trainer.iteration,
            "consumed_train_samples": trainer.train_loader.state_dict()["consumed_samples"],
            "consumed_valid_samples": trainer.valid_loader.state_dict()["consumed_samples"] if trainer.valid_loader else 0,
            # --skip-samples: the listed samples passed over so far (the raw position is consumed + skipped)
            "skipped_train_samples": getattr(trainer.train_loader, "skipped_samples", 0),
            **({"spiky_loss": trainer.spikes.state_dict()} if getattr(trainer, "spikes", None) is not None else {}),
            "optimizer_step": step.item(),
            "optimizer_iteration": getattr(opt, "iteration", trainer.iteration),
            "loss_scaler": scaler.state_dict() if scaler is not None else None,
            "optimizer_dtypes": state_dtypes(opt),
            "lr": trainer.current_lr(),
            # Megatron's OptimizerParamScheduler state (its keys; lr_schedule.py), exact at a save
            io.SCHEDULER_STATE: trainer.lr_schedule.exact().state_dict(),
            "layout": self.layout(),
            "saved_at": time.time(),
            # --wandb-project: the W&B run this training logs to (rank 0's, who writes this file); a resume continues it
            **({"wandb_run_id": run_id} if (run_id := getattr(trainer.logger, "wandb_run_id", None)) else {}),
        }

    def _writes(self, p: nn.Parameter, sharded: bool) -> bool:
        """Whether this rank writes its owned range of `p`: never the tied twin (the embedding's is saved); a
        TP-replicated tensor (MoE experts without expert TP too) on TP rank 0 only; with unsharded state (DDP, or a frozen
        parameter) on rank 0 of the ranks holding the same copy (expert-DP for experts, else DP x CP)."""
        if _is_copy(p):
            return False
        if not is_tp_split(p) and self.state.tp_rank != 0:
            return False
        return sharded or dist.get_rank(self.state.replica_group(is_expert(p))) == 0

    def _owned(self, trainer) -> dict[str, tuple[torch.Tensor, Where]]:
        """Checkpoint name -> (a flat owned buffer, (global shape, the pieces it holds)) for what this rank writes:
        its optimizer shard's range of every parameter, once per replica group and TP replica; and the frozen
        parameters (the MoE expert bias, moved by token counts, not by the optimizer) whole, once."""
        opt = trainer.optimizer
        names = {id(p): n for n, p in _named_params(trainer.chunks)}
        out: dict[str, tuple[torch.Tensor, Where]] = {}
        for ps in opt.sharded_param_state():
            p = ps.param
            if not self._writes(p, opt.opts.distributed):
                continue
            fields = saved_fields(ps)
            for part in owned_parts(names[id(p)], p, ps.start, ps.stop):
                where = (part.shape, part.pieces)
                out[f"model.{part.name}"] = (ps.value[part.lo : part.hi], where)
                out.update({f"optim.{part.name}.{f}": (getattr(ps, f)[part.lo : part.hi], where) for f in fields})
        # fp16 moments' per-parameter bounds: global scalars, written by one rank of the stage (TP rank 0 of DP x CP rank 0)
        one = self.state.tp_rank == 0 and dist.get_rank(self.state.dp_cp_group) == 0
        out.update(bound_tensors(opt, names, lambda p: one and not _is_copy(p)))
        for name, p in _frozen(trainer.chunks):
            if self._writes(p, sharded=False):
                for part in owned_parts(name, p, 0, p.numel()):
                    out[f"model.{part.name}"] = (p.detach().view(-1)[part.lo : part.hi], (part.shape, part.pieces))
        return out

    # ------------------------------------------------------------ saving

    @span_of("checkpoint save")
    def save(self, trainer) -> None:
        """Checkpoint the state after `trainer.iteration`; returns once it is written, or staged with --async-save."""
        assert self.root is not None, "save() needs --save"
        if hasattr(trainer, "check_nan"):
            trainer.check_nan()  # the device-side NaN flag is read before the state is written, never after
        self.wait()
        start = time.perf_counter()
        it = trainer.iteration
        tmp = self._make_tmp(it)
        meta = self._meta(trainer)
        rng = io.encode_rng(self._rng_states())
        trainer.optimizer.finish_param_sync()  # the owned values are final before they are read
        owned = self._owned(trainer)
        staged = None
        if self.cfg.checkpoint.async_save:  # the stall of an async save: queue copies to host memory (staging.py)
            staged = self.staging.stage(owned)
            owned = staged.tensors
            if staged.done is not None:
                trainer.step_fences.append(staged.done)  # the next optimizer step waits for the copies
        tensors = {k: owned_tensor(t, shape, pieces) for k, (t, (shape, pieces)) in owned.items()}
        if not self.cfg.checkpoint.async_save:
            self._write(tensors, meta, rng, tmp, it)
            self.last_saved = it
            self.stall_seconds.append(time.perf_counter() - start)
            return
        self.executor = self.executor or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tricorn-ckpt")
        self.pending = self.executor.submit(self._write_staged, staged, tensors, meta, rng, tmp, it)
        self.last_saved = it
        self.stall_seconds.append(time.perf_counter() - start)

    def _make_tmp(self, iteration: int) -> Path:
        """Rank 0 clears leftovers of dead saves and creates this save's temporary directory; all ranks learn its name."""
        name = [None]
        if self.state.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            io.remove_stale_tmp(self.root)
            path = io.tmp_dir(self.root, iteration, uuid.uuid4().hex[:8])
            (path / io.RNG_DIR).mkdir(parents=True)
            name = [str(path)]
        dist.broadcast_object_list(name, src=0, group=self.group)
        return Path(name[0])

    def _write(self, tensors: dict[str, torch.Tensor], meta: dict, rng: str, tmp: Path, iteration: int) -> None:
        import torch.distributed.checkpoint as dcp

        rank = self.state.rank
        (tmp / io.RNG_DIR).mkdir(parents=True, exist_ok=True)
        io.atomic_write_text(tmp / io.RNG_DIR / f"{self.state.grid_name()}.json", rng)
        if rank == 0:
            io.atomic_write_text(tmp / io.META_FILE, json.dumps(meta, indent=1))
            io.atomic_write_text(tmp / io.CONFIG_FILE, dump_yaml(self.cfg))
        # DCP's finish gathers every rank's write result before rank 0 writes .metadata, so when save()
        # returns every shard file (and, written before, every RNG file) is on disk.
        writer = io.Writer(tmp, iteration, rank)
        dcp.save(tensors, storage_writer=writer, process_group=self.group)
        # Each rank's checksums (its shard, hashed by the writer; its RNG file) go to rank 0, which adds its
        # own small files and writes the manifest before publishing: a published checkpoint always has one.
        mine = {**writer.checksums, **file_checksums(tmp, [f"{io.RNG_DIR}/{self.state.grid_name()}.json"])}
        everyone: Optional[list] = [None] * self.state.world_size if rank == 0 else None
        dist.gather_object(mine, everyone, dst=0, group=self.group)
        if rank == 0:
            checksums = {k: v for part in everyone for k, v in part.items()}
            checksums.update(file_checksums(tmp, [io.META_FILE, io.CONFIG_FILE]))  # .metadata: hashed by rank 0's writer
            io.write_manifest(tmp, checksums)
            self._publish(tmp, iteration)
        dist.barrier(group=self.group)

    def _write_staged(self, staged: Staged, *args) -> None:
        staged.wait()  # the side-stream copies have landed in the pinned buffers
        self._write(*args)

    def _publish(self, tmp: Path, iteration: int) -> None:
        io.fsync_dir(tmp)
        final = self.root / io.iter_name(iteration)
        if final.exists():  # saved again at the same iteration (a rerun): replace the old one
            old = io.tmp_dir(self.root, iteration, "replaced")
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)
        io.fsync_dir(self.root)
        io.atomic_write_text(self.root / io.LATEST_FILE, f"{iteration}\n")
        keep = self.cfg.checkpoint.keep_last_n_checkpoints
        if keep:
            io.prune(self.root, keep, iteration)
        self.console(f"saved checkpoint {final}")

    def wait(self) -> None:
        """Block until the in-flight async save is complete (its errors are raised here)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def finish(self, trainer) -> None:
        """End of training: save the final state if it is newer than the last checkpoint, and wait for writes."""
        it = trainer.iteration
        if self.root is not None and it > self.loaded_iteration and self.last_saved != it:
            self.save(trainer)
        self.wait()

    def close(self) -> None:
        """Best effort on error paths: let an in-flight save of earlier, healthy state complete."""
        try:
            self.wait()
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException (a peer died mid-save) is one
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            # Reported only: the error that brought us here is what matters.
            print(f"tricorn: warning: the background checkpoint save failed: {e}", flush=True)
        if self.executor is not None:
            self.executor.shutdown(wait=True)

    # ------------------------------------------------------------ loading

    def load(self, trainer) -> int:
        """Resume from --load (latest or --ckpt-step); returns the iteration to continue after (0: fresh)."""
        c = self.cfg.checkpoint
        if not c.load:
            return 0
        path, note = io.find_checkpoint(Path(c.load), c.ckpt_step)
        self.console(f"checkpoint: {note}")
        if path is None:
            return 0
        self._loaded_path = path
        meta, md = io.verify_checkpoint(path, self.cfg.model)
        self.loaded_meta = meta
        self._verify_checksums(path, md)
        # A weights-only checkpoint (`tricorn import-hf`) has no optimizer state, data position or RNG states:
        # like Megatron's converted "release" checkpoints it always starts training at iteration 0.
        weights_only = bool(meta.get("weights_only"))
        no_optimizer_state = meta.get(io.OPTIMIZER_STATE, True) is False
        load_optim = not (c.no_load_optim or c.finetune or weights_only or no_optimizer_state)
        self._load_tensors(trainer, path, md, load_optim, meta)
        if c.finetune or weights_only:
            why = f"weights-only checkpoint from {meta.get('source', 'an import')}" if weights_only else "--finetune"
            self.console(f"checkpoint: {why}: weights of iteration {meta['iteration']}, training starts at iteration 0")
            return 0
        if no_optimizer_state and not c.no_load_optim:
            self.console(f"checkpoint: {path} holds no optimizer state ({meta.get('source', 'an import')}): fresh Adam moments")
        self._load_progress(trainer, meta, load_optim)
        self._load_schedule(trainer, meta)
        self._load_rng(path, meta)
        self.loaded_iteration = trainer.iteration
        return trainer.iteration

    def _verify_checksums(self, path: Path, md) -> None:
        """Every file against checksums.json, each rank a share; the first mismatch is the same error on every rank."""
        if not self.cfg.checkpoint.verify_checkpoint:
            return
        manifest = io.read_manifest(path)
        if manifest is None:
            self.console(f"checkpoint: {path} has no {io.CHECKSUM_FILE} (saved by an older tricorn): files not verified")
            return
        unlisted = sorted({info.relative_path for info in md.storage_data.values()} - set(manifest))
        if unlisted:
            raise CheckpointError(f"checkpoint damaged: {path / unlisted[0]} is not listed in {path / io.CHECKSUM_FILE}")
        share = sorted(manifest)[self.state.rank :: self.state.world_size]
        found: list = [None] * self.state.world_size
        dist.all_gather_object(found, io.checksum_errors(path, manifest, share), group=self.group)
        errors = sorted(e for part in found for e in part)
        if errors:
            more = f" ({len(errors) - 1} more files differ)" if len(errors) > 1 else ""
            raise CheckpointError(errors[0] + more)

    def _check_entry(self, key: str, shape: tuple[int, ...], md) -> None:
        entry = md.state_dict_metadata.get(key)
        if entry is None or not hasattr(entry, "size"):
            raise CheckpointError(f"checkpoint lacks tensor {key!r}; it was saved from a different model")
        if tuple(entry.size) != shape:
            raise CheckpointError(f"checkpoint tensor {key!r} has shape {tuple(entry.size)}, this model needs {shape}")

    def _load_tensors(self, trainer, path: Path, md, load_optim: bool, meta: dict) -> None:
        """Read the pieces this rank owns in this layout straight into its master and moment buffers, and the
        frozen parameters (the MoE expert bias) whole into every rank's copy."""
        opt = trainer.optimizer
        owned = {id(ps.param): ps for ps in opt.sharded_param_state()}
        keys = md.state_dict_metadata
        targets: dict[str, Any] = {}
        moments = MomentLoad(opt, md) if load_optim else None
        for name, p in _named_params(trainer.chunks):
            if not p.requires_grad:
                for part in owned_parts(name, p, 0, p.numel()):
                    self._check_entry(f"model.{part.name}", part.shape, md)
                    targets[f"model.{part.name}"] = owned_tensor(p.data.view(-1)[part.lo : part.hi], part.shape, part.pieces)
                continue
            for part in owned_parts(name, p, 0, p.numel()):  # every tensor of the parameter, owned or not
                self._check_entry(self._weight_key(part.name, keys), part.shape, md)
            ps = owned.get(id(p))
            for part in owned_parts(name, p, ps.start, ps.stop) if ps is not None else []:
                weight_key = self._weight_key(part.name, keys)
                if weight_key in targets:
                    raise CheckpointError(f"{name} appears twice on one rank (a tied head beside its embedding)")
                targets[weight_key] = owned_tensor(ps.master[part.lo : part.hi], part.shape, part.pieces)
            if moments is not None and ps is not None:
                targets.update(moments.targets(name, ps, lambda key, shape: self._check_entry(key, shape, md)))
        io.dcp_load(targets, path, self.group)
        with torch.no_grad():
            if moments is not None:
                moments.finish()
                line = switch_line(meta.get("optimizer_dtypes"), state_dtypes(opt))
                if line:
                    self.console(line)
            if load_optim:
                step = float(meta["optimizer_step"])
                for ps in owned.values():
                    ps.step.fill_(step)
            opt.params_from_masters()

    @staticmethod
    def _weight_key(name: str, keys) -> str:
        """The exact fp32 master weights when the saving run was mixed precision, else the saved values."""
        master = f"optim.{name}.master"
        return master if master in keys else f"model.{name}"

    def _load_progress(self, trainer, meta: dict, load_optim: bool) -> None:
        trainer.iteration = int(meta["iteration"])
        trainer.train_loader.load_state_dict(
            {"consumed_samples": meta["consumed_train_samples"], "skipped_samples": meta.get("skipped_train_samples", 0)}
        )
        if getattr(trainer, "spikes", None) is not None and meta.get("spiky_loss"):
            trainer.spikes.load_state_dict(meta["spiky_loss"])  # the running means: a resume decides bitwise alike
        if trainer.valid_loader is not None:
            trainer.valid_loader.load_state_dict({"consumed_samples": meta["consumed_valid_samples"]})
        opt = trainer.optimizer
        if load_optim:
            if hasattr(opt, "iteration"):
                opt.iteration = int(meta["optimizer_iteration"])
            scaler = getattr(opt, "scaler", None)
            if scaler is not None and meta.get("loss_scaler"):
                scaler.load_state_dict(meta["loss_scaler"])
        self.console(
            f"checkpoint: resuming after iteration {trainer.iteration} "
            f"({meta['consumed_train_samples']} samples consumed; saved at {_layout_str(meta['layout'])})"
        )

    def _load_schedule(self, trainer, meta: dict) -> None:
        """The lr schedule, loaded as Megatron's: with the optimizer only, so --no-load-optim starts it again at
        sample 0 (warm-up included) while the iteration goes on. A checkpoint written before the schedule was
        Megatron's (no scheduler state) keeps its own: its iteration i ran at the lr of i x global batch samples,
        so it resumes one global batch ahead of Megatron's count, and its curve goes on without a jump."""
        c, t = self.cfg.checkpoint, self.cfg.training
        schedule = trainer.lr_schedule.schedule
        if c.no_load_optim:
            self.console(
                "checkpoint: --no-load-optim: the lr schedule starts again at sample 0 (Megatron loads it with the optimizer)"
            )
            return
        if io.SCHEDULER_STATE in meta and meta[io.SCHEDULER_STATE] is None:
            self.console(
                f"checkpoint: it holds no lr scheduler state ({meta.get('source', 'on purpose')}): the schedule starts at sample 0"
            )
            return
        state = meta.get(io.SCHEDULER_STATE)
        if state is None:
            schedule.num_steps = (int(meta["iteration"]) + 1) * int(t.global_batch_size)
            self.console(
                f"checkpoint: saved before tricorn's lr schedule was Megatron's: it keeps its own (iteration i at the "
                f"lr of i x global batch samples, Megatron's at i - 1), from {schedule.num_steps} samples on"
            )
            return
        try:
            changed = schedule.load_state_dict(
                state, override=t.override_opt_param_scheduler, use_checkpoint=t.use_checkpoint_opt_param_scheduler
            )
        except ValueError as e:  # ScheduleMismatch, or a state without its count
            raise CheckpointError(f"{self._loaded_path}: {e}") from None
        for line in changed:
            self.console(f"checkpoint: lr schedule: {line}")

    def _load_rng(self, path: Path, meta: dict) -> None:
        same = all(meta["layout"].get(k) == v for k, v in self.layout().items() if k in ("tp", "pp", "vpp", "cp", "dp"))
        rng_file = path / io.RNG_DIR / f"{self.state.grid_name()}.json"
        if same and not self.cfg.checkpoint.no_load_rng and rng_file.is_file():
            states = io.decode_rng(rng_file)
            torch.set_rng_state(states.pop("cpu"))
            if "cuda" in states:
                torch.cuda.set_rng_state(states.pop("cuda"), self.state.device)
            # Checkpoints written before the RNG tracker was removed also hold "tracker.*" streams: nothing
            # draws from them any more (dropout masks are keyed, tricorn/model/dropout.py), so they are ignored.
            return
        from tricorn.parallel.tensor import seed_default_stream

        seed_default_stream(self.cfg.training.seed + int(meta["iteration"]), self.state.pp_rank)
        why = "--no-load-rng" if self.cfg.checkpoint.no_load_rng else "the layout changed"
        self.console(f"checkpoint: RNG states re-derived from the seed and the iteration ({why})")

    # ------------------------------------------------------------ the trainer's end-of-iteration hook

    def iteration_hook(self, exits) -> Callable[[Any], bool]:
        """Save at --save-interval; on an exit condition (signal, duration, interval) save and stop (True)."""

        def hook(trainer) -> bool:
            reason = exits.check(trainer.iteration, self.state.device)
            c = self.cfg.checkpoint
            if self.root is not None and (reason or (c.save_interval and trainer.iteration % c.save_interval == 0)):
                self.save(trainer)
            if reason is None:
                return False
            self.wait()
            saved = "checkpoint saved" if self.root is not None else "no --save, nothing saved"
            self.console(f"exiting after iteration {trainer.iteration}: {reason} ({saved})")
            return True

        return hook


def _layout_str(layout: dict) -> str:
    opt = f", distributed optimizer ZeRO-{layout['zero_stage']}" if layout.get("distributed_optimizer") else ""
    ep = f" (EP {layout['ep']})" if layout.get("ep", 1) > 1 else ""
    ep += f" (ETP {layout['etp']})" if layout.get("etp", 1) > 1 else ""
    return f"TP {layout['tp']} x PP {layout['pp']} (VPP {layout['vpp']}) x CP {layout['cp']} x DP {layout['dp']}{ep}{opt}"
