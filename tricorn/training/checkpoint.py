"""Sharded checkpoints in global coordinates: save, async save, resume on any layout, exit conditions.

Every tensor goes into torch.distributed.checkpoint (DCP) under its global name
and global shape, so any TP/PP/VPP/DP layout, with or without the distributed
optimizer and at any ZeRO stage, loads any other:

    model.<name>                   the parameter (layers keyed by global layer id); a TP-split one is a
                                   DTensor Shard(dim) on the TP mesh (its real rows: vocab padding is
                                   never saved), a replicated one a plain tensor (DCP keeps one copy)
    optim.<name>.exp_avg/.exp_avg_sq   Adam moments, same shape and split as the parameter
    optim.<name>.master            fp32 master weights (only when parameters are bf16/fp16)

A tied head copy on the last pipeline stage is not saved; it loads from the
embedding. Non-tensor state is JSON/YAML (checkpoint_io.py): iteration,
consumed samples, optimizer step, loss scaler, layout, config, and per-rank
RNG states keyed by grid position (restored only on an identical layout,
otherwise re-derived from the seed and the iteration).

Optimizer contract (tricorn.parallel.optimizer): `sharded_param_state()` lists,
per parameter, the range [start, stop) of p.view(-1) this rank owns with 1-D
views of its master/exp_avg/exp_avg_sq and its step; `gathered_params(write_back)`
makes full parameters readable/writable (ZeRO-3). When the ranges are DP
shards (distributed optimizer), a save assembles each parameter's TP-local
state with one all-reduce over DP x CP (zeros outside the owned range), and a
load reads the TP-local state and keeps the owned range.

Atomicity: every rank writes into DIR/iter_N.tmp-<token>; once DCP's collective
finish has returned on all ranks, rank 0 renames it to DIR/iter_N, then
replaces latest_checkpointed_iteration.txt (write temp + rename), then prunes
(--keep-last-n-checkpoints). --async-save copies the state to CPU memory (the
only stall) and writes it on a background thread over a dedicated gloo group;
the next save, or the exit, waits for it.

Collectives: a save = one broadcast (temp name), one scalar all-reduce (step),
one all-reduce per parameter over DP x CP when the optimizer is DP-sharded,
DCP's plan/finish gathers, one gather of the checksums, a barrier; a load =
one all-gather of checksum results (unless --no-verify-checkpoint), DCP's plan gathers.
Checksums: each rank hashes the shard it wrote on the writer thread (the
background thread with --async-save) and its RNG file; rank 0 writes them with
its own files' into checksums.json before the rename that publishes the save.
Memory: sync save none (writes from the live tensors) except assembled DP-sharded
optimizer state (TP-local, ~3x the parameters); async save one CPU copy of
what this rank writes; load one TP-local copy of what it reads.
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

from tricorn.config import Config, dump_yaml
from tricorn.model.init import INIT_KEY_ATTR, global_shape, shard_info
from tricorn.parallel.state import ParallelState
from tricorn.training import checkpoint_io as io
from tricorn.training.checkpoint_io import CheckpointError
from tricorn.training.checksums import file_checksums
from tricorn.training.lr_schedule import learning_rate
from tricorn.training.staging import HostStaging, Staged

MOMENTS = ("exp_avg", "exp_avg_sq")


def _named_params(chunks: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """(checkpoint name, parameter) for every parameter of this rank, in the same order on every DP rank."""
    return [(getattr(p, INIT_KEY_ATTR, n), p) for c in chunks for n, p in c.named_parameters()]


def _is_copy(p: torch.Tensor) -> bool:
    return hasattr(p, INIT_KEY_ATTR)


def _to_global(local: torch.Tensor, p: torch.Tensor, tp_mesh) -> torch.Tensor:
    """`local` (shaped like p, padded) as its piece of the global tensor: the real rows, a DTensor when TP-split."""
    info = shard_info(p)
    if info is None:
        return local
    real = local.narrow(info.dim, 0, info.real_range()[1])
    if info.world == 1:
        return real
    from torch.distributed.tensor import DTensor, Shard

    shape = torch.Size(global_shape(p))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(real, tp_mesh, [Shard(info.dim)], run_check=False, shape=shape, stride=stride)


def _local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class Checkpointer:
    def __init__(self, cfg: Config, state: ParallelState, tracker: Any, console: Callable[[str], None] = print):
        self.cfg = cfg
        self.state = state
        self.tracker = tracker  # the model's RNGTracker (tensor-parallel dropout stream)
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
        self._cpu_mesh = None
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
            "world": s.world_size,
            "distributed_optimizer": p.use_distributed_optimizer,
            "zero_stage": p.zero_stage,
            "params_dtype": self.cfg.param_dtype_name,
        }

    def _rng_states(self) -> dict[str, torch.Tensor]:
        states = {"cpu": torch.get_rng_state()}
        if self.state.device.type == "cuda":
            states["cuda"] = torch.cuda.get_rng_state(self.state.device)
        states.update({f"tracker.{k}": v.clone() for k, v in self.tracker.states.items()})
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
            "optimizer_step": step.item(),
            "optimizer_iteration": getattr(opt, "iteration", trainer.iteration),
            "loss_scaler": scaler.state_dict() if scaler is not None else None,
            "lr": learning_rate(self.cfg.training, max(trainer.iteration, 1)),
            "layout": self.layout(),
            "saved_at": time.time(),
        }

    def _optimizer_locals(self, trainer, params: list[tuple[str, nn.Parameter]]) -> dict[str, tuple[torch.Tensor, nn.Parameter]]:
        owned = {id(ps.param): ps for ps in trainer.optimizer.sharded_param_state()}
        whole = all(id(p) in owned and owned[id(p)].stop - owned[id(p)].start == p.numel() for _, p in params)
        flag = torch.tensor([0.0 if whole else 1.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        sharded = flag.item() > 0  # some rank holds only a DP shard: assemble over DP x CP
        out: dict[str, tuple[torch.Tensor, nn.Parameter]] = {}
        for name, p in params:
            if _is_copy(p):  # the embedding's twin: identical state, saved once under the embedding's name
                continue
            ps = owned.get(id(p))
            fields = MOMENTS + (("master",) if p.dtype != torch.float32 else ())
            if sharded:
                buf = torch.zeros(len(fields), p.numel(), dtype=torch.float32, device=self.state.device)
                if ps is not None:
                    for i, f in enumerate(fields):
                        buf[i, ps.start : ps.stop].copy_(getattr(ps, f))
                dist.all_reduce(buf, group=self.state.dp_cp_group)
                values = {f: buf[i].view(p.shape) for i, f in enumerate(fields)}
            else:
                values = {f: getattr(ps, f).view(p.shape) for f in fields}
            out.update({f"optim.{name}.{f}": (v, p) for f, v in values.items()})
        return out

    def _locals(self, trainer) -> dict[str, tuple[torch.Tensor, nn.Parameter]]:
        """Checkpoint name -> (this rank's tensor shaped like the parameter, the parameter)."""
        params = _named_params(trainer.chunks)
        out = {f"model.{n}": (p.detach(), p) for n, p in params if not _is_copy(p)}
        out.update(self._optimizer_locals(trainer, params))
        return out

    def _tp_mesh(self, device: torch.device):
        """The TP mesh for DTensors of `device`: CPU staging copies of CUDA state need a CPU mesh (same ranks)."""
        if device.type == self.state.mesh.device_type:
            return self.state.mesh["tp"]
        if self._cpu_mesh is None:  # created once, by every rank in the same save (a collective)
            from torch.distributed.device_mesh import DeviceMesh

            self._cpu_mesh = DeviceMesh("cpu", self.state.mesh.mesh, mesh_dim_names=self.state.mesh.mesh_dim_names)
        return self._cpu_mesh["tp"]

    # ------------------------------------------------------------ saving

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
        with trainer.optimizer.gathered_params():
            local = self._locals(trainer)
            staged = None
            if self.cfg.checkpoint.async_save:  # the stall of an async save: queue copies to host memory (staging.py)
                staged = self.staging.stage(local)
                local = staged.tensors
                if staged.done is not None:
                    trainer.step_fences.append(staged.done)  # the next optimizer step waits for the copies
            tensors = {k: _to_global(t, p, self._tp_mesh(t.device)) for k, (t, p) in local.items()}
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
        meta, md = io.verify_checkpoint(path, self.cfg.model)
        self._verify_checksums(path, md)
        # A weights-only checkpoint (`tricorn import-hf`) has no optimizer state, data position or RNG states:
        # like Megatron's converted "release" checkpoints it always starts training at iteration 0.
        weights_only = bool(meta.get("weights_only"))
        load_optim = not (c.no_load_optim or c.finetune or weights_only)
        self._load_tensors(trainer, path, md, load_optim, meta)
        if c.finetune or weights_only:
            why = f"weights-only checkpoint from {meta.get('source', 'an import')}" if weights_only else "--finetune"
            self.console(f"checkpoint: {why}: weights of iteration {meta['iteration']}, training starts at iteration 0")
            return 0
        self._load_progress(trainer, meta, load_optim)
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

    def _target(self, key: str, p: torch.Tensor, md) -> tuple[torch.Tensor, torch.Tensor]:
        """(zero buffer shaped like p, incl. padding; the DCP target over its real rows) for checkpoint tensor `key`."""
        entry = md.state_dict_metadata.get(key)
        if entry is None or not hasattr(entry, "size"):
            raise CheckpointError(f"checkpoint lacks tensor {key!r}; it was saved from a different model")
        if tuple(entry.size) != global_shape(p):
            raise CheckpointError(f"checkpoint tensor {key!r} has shape {tuple(entry.size)}, this model needs {global_shape(p)}")
        buf = torch.zeros(p.shape, dtype=entry.properties.dtype, device=self.state.device)
        return buf, _to_global(buf, p, self._tp_mesh(buf.device))

    def _load_tensors(self, trainer, path: Path, md, load_optim: bool, meta: dict) -> None:
        params = _named_params(trainer.chunks)
        owned = {id(ps.param): ps for ps in trainer.optimizer.sharded_param_state()}
        keys = md.state_dict_metadata
        bufs: dict[str, torch.Tensor] = {}
        targets: dict[str, torch.Tensor] = {}
        sources: dict[str, torch.Tensor] = {}

        def want(key: str, p: torch.Tensor) -> torch.Tensor:
            if key not in bufs:
                bufs[key], targets[key] = self._target(key, p, md)
                sources[key] = p
            return bufs[key]

        weights, moments = {}, {}
        for name, p in params:
            master = f"optim.{name}.master"  # the exact fp32 weights when the saving run was mixed precision
            weights[id(p)] = want(master if master in keys else f"model.{name}", p)
            if load_optim and id(p) in owned:
                moments[id(p)] = {f: want(f"optim.{name}.{f}", p) for f in MOMENTS}
        io.dcp_load(targets, path, self.group)
        for key, t in targets.items():  # DCP writes through the real-row views; copy where a wrapper did not alias
            info, local = shard_info(sources[key]), _local_of(t)
            real = bufs[key] if info is None else bufs[key].narrow(info.dim, 0, info.real_range()[1])
            if local.data_ptr() != real.data_ptr():
                real.copy_(local)
        with torch.no_grad():
            with trainer.optimizer.gathered_params(write_back=True):
                for _, p in params:
                    p.copy_(weights[id(p)])
            step = torch.tensor(float(meta["optimizer_step"]))
            for ps in owned.values():
                w = weights[id(ps.param)]
                if w.dtype == torch.float32:  # precise master (the sync from bf16 params rounded it)
                    ps.master.copy_(w.view(-1)[ps.start : ps.stop])
                if id(ps.param) in moments:
                    for f in MOMENTS:
                        getattr(ps, f).copy_(moments[id(ps.param)][f].view(-1)[ps.start : ps.stop])
                    ps.step.copy_(step)

    def _load_progress(self, trainer, meta: dict, load_optim: bool) -> None:
        trainer.iteration = int(meta["iteration"])
        trainer.train_loader.load_state_dict({"consumed_samples": meta["consumed_train_samples"]})
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

    def _load_rng(self, path: Path, meta: dict) -> None:
        same = all(meta["layout"].get(k) == v for k, v in self.layout().items() if k in ("tp", "pp", "vpp", "cp", "dp"))
        rng_file = path / io.RNG_DIR / f"{self.state.grid_name()}.json"
        if same and not self.cfg.checkpoint.no_load_rng and rng_file.is_file():
            states = io.decode_rng(rng_file)
            torch.set_rng_state(states.pop("cpu"))
            if "cuda" in states:
                torch.cuda.set_rng_state(states.pop("cuda"), self.state.device)
            self.tracker.states.update({k.removeprefix("tracker."): v for k, v in states.items()})
            return
        from tricorn.parallel.tensor import seed_everything

        fresh = seed_everything(
            self.cfg.training.seed + int(meta["iteration"]), self.state.pp_rank, self.state.tp_rank, self.state.device
        )
        self.tracker.states.update(fresh.states)
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
    return f"TP {layout['tp']} x PP {layout['pp']} (VPP {layout['vpp']}) x CP {layout['cp']} x DP {layout['dp']}{opt}"
