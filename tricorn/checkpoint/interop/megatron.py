"""Megatron-LM -> tricorn checkpoints: `tricorn import-megatron` (export-megatron: megatron_export.py).

import-megatron reads a Megatron-LM GPTModel checkpoint, torch_dist (`iter_N/.metadata`, `__*_*.distcp`,
`metadata.json`) or legacy torch (`iter_N/mp_rank_XX[_YYY]/model_optim_rng.pt`), the format detected from
the files, at any saved TP/PP/DP, and writes a tricorn checkpoint `OUT/iter_N` that `--load` resumes on
any tricorn layout: the model, the iteration, the consumed samples, Megatron's lr scheduler state and the Adam
moments and fp32 masters in every format Megatron writes: stored per parameter (the FP32 optimizer's or the
distributed optimizer's `fully_reshardable` torch_dist state; the legacy FP32 optimizer's, indexed by
Megatron's parameter order, derived and checked in megatron_mapping.legacy_optimizer_order) or in the
distributed optimizer's flat buffers (`dp_reshardable`, Megatron's default, and the legacy `distrib_optim.pt`;
their layout derived and checked in megatron_distopt.py). --no-load-optim is Megatron's: the optimizer and
scheduler state are left out (training goes on from Megatron's iteration and data position with fresh Adam
moments and the schedule from sample 0). `OUT/megatron.yaml` holds the run's model, training, data and
evaluation flags, and on its first line the Megatron args tricorn does not reproduce (megatron_flags.py).

Reading is safe (megatron_pickle.py); mapping is exact (megatron_mapping.py). Memory: one tensor at a time
for torch_dist (one layer of a stacked tensor, or one parameter's slice of a large optimizer bucket, is read
through a one-process gloo group's ShardedTensor; small buckets whole, up to BUCKET_CACHE_BYTES); the legacy
format reads its per-rank files whole. No collectives beyond that local group.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from tricorn.checkpoint import io
from tricorn.checkpoint.interop.convert import (
    DTYPES,
    check_new_save,
    import_meta,
    read_one,
    run_command,
    write_checkpoint,
)
from tricorn.checkpoint.interop.hf_mapping import ConvertError, model_flags
from tricorn.checkpoint.interop.megatron_distopt import DistOptState, bucket_key, bucket_lengths, legacy_buffer
from tricorn.checkpoint.interop.megatron_mapping import (
    Entry,
    legacy_optimizer_order,
    merge_tp,
    model_config_from_args,
    run_fields,
    tensor_map,
    to_tricorn,
    training_fields,
    tricorn_shape,
    unsupported_args,
)
from tricorn.checkpoint.interop.megatron_pickle import namespace_dict, safe_load
from tricorn.config import Config, ModelConfig, TrainingConfig, dump_yaml
from tricorn.lr_schedule import schedule_from_megatron

COMMON_KEY = "common_state/shard_0_1"
MOMENTS = ("exp_avg", "exp_avg_sq")
DISTOPT_KINDS = ("dp_reshardable", "distrib_optim")
DISTRIB_OPTIM = "distrib_optim.pt"
BUCKET_CACHE_BYTES = 256 * 2**20  # dp_reshardable buckets up to this are read whole and kept (memory: at most this)
RUN_CONFIG = "megatron.yaml"


@contextlib.contextmanager
def local_group() -> Iterator[None]:
    """A one-process gloo group, so that a ShardedTensor can name one layer of a stacked tensor for DCP."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass
class MegatronCheckpoint:
    """One iteration of a Megatron checkpoint: its format, args, common state and a reader of global tensors."""

    path: Path  # the iter_N directory
    fmt: str  # "torch_dist" | "torch"
    args: dict
    common: dict
    md: Any = None  # torch_dist: DCP metadata
    ranks: dict = field(default_factory=dict)  # legacy: (tp, pp) -> state dict of model_optim_rng.pt
    _order: Optional[dict] = None  # legacy FP32 optimizer: (tp, pp) -> model key -> optimizer state index
    _distopt: Optional[DistOptState] = None  # the distributed optimizer's buffers (dp_reshardable, distrib_optim.pt)
    _distrib_optim: dict = field(default_factory=dict)  # legacy: (tp, pp) -> distrib_optim.pt's buffer

    @property
    def iteration(self) -> int:
        return int(self.common.get("iteration", 0))

    # ------------------------------------------------------------ tensors

    def has(self, key: str) -> bool:
        if key.startswith("optimizer.state.") and self.optimizer_kind() in DISTOPT_KINDS:
            return key.split(".")[2] in ("param", *MOMENTS)
        if self.fmt == "torch_dist":
            return key in self.md.state_dict_metadata
        if key.startswith("optimizer.state."):  # the legacy FP32 optimizer: moments, never separate masters
            return key.split(".")[2] in MOMENTS and self.optimizer_kind() == "per_param"
        return key in self.ranks[(0, 0)]["model"]

    def shape(self, e: Entry, key: Optional[str] = None) -> tuple[int, ...]:
        """Megatron's global shape of entry `e` (layers unstacked), read from the files."""
        if self.fmt == "torch_dist":
            size = tuple(self.md.state_dict_metadata[key or e.dist].size)
            return size[1:] if e.layer is not None else size
        return tuple(self.tensor(e).shape)

    def tensor(self, e: Entry, key: Optional[str] = None) -> torch.Tensor:
        """Megatron's global tensor of `e` (key: an optimizer-state key of the same layout)."""
        if key is not None and self.optimizer_kind() in DISTOPT_KINDS:
            return self.distopt().tensor(e, key.split(".")[2])
        if self.fmt == "torch_dist":
            return self._dist_tensor(key or e.dist, e.layer)
        tp = int(self.args.get("tensor_model_parallel_size", 1))
        stage, local = self._stage(e)
        name = e.legacy if local is None else e.legacy.replace(f"layers.{e.layer}.", f"layers.{local}.", 1)
        if key is None:
            return merge_tp(e, [self.ranks[(r, stage)]["model"][name] for r in range(tp)])
        field = key.split(".")[2]
        pieces = []
        for r in range(tp):
            opt = self.ranks[(r, stage)]["optimizer"]
            pieces.append(opt["state"][self._order[(r, stage)][name]][field])
        return merge_tp(e, pieces)

    def _stage(self, e: Entry) -> tuple[int, Optional[int]]:
        """The legacy pipeline stage holding `e` and its local layer index there."""
        pp = int(self.args.get("pipeline_model_parallel_size", 1))
        if e.layer is None:
            last = e.name.startswith(("norm.", "output."))
            return (pp - 1 if last else 0), None
        per_stage = int(self.args["num_layers"]) // pp
        return e.layer // per_stage, e.layer % per_stage

    def _dist_tensor(self, key: str, layer: Optional[int]) -> torch.Tensor:
        entry = self.md.state_dict_metadata[key]
        if layer is None:
            return read_one(self.path, key, tuple(entry.size), entry.properties.dtype)
        shape = tuple(entry.size)
        return self._dist_region(key, (layer,) + (0,) * (len(shape) - 1), (1, *shape[1:])).view(shape[1:])

    def _dist_region(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The rectangle `sizes` at `offsets` of torch_dist tensor `key`, read alone (flat)."""
        from tricorn.checkpoint.pieces import Piece, owned_tensor

        entry = self.md.state_dict_metadata[key]
        flat = torch.empty(int(torch.Size(sizes).numel()), dtype=entry.properties.dtype)
        piece = Piece(0, flat.numel(), tuple(offsets), tuple(sizes))
        with local_group(), warnings.catch_warnings():  # ShardedTensor's deprecation: DCP reads one piece all the same
            warnings.simplefilter("ignore", FutureWarning)
            io.dcp_load({key: owned_tensor(flat, tuple(entry.size), [piece])}, self.path, no_dist=True)
        return flat

    def read_object(self, key: str) -> Any:
        return _dist_object(self.path, self.md, key)

    # ------------------------------------------------------------ optimizer state

    def optimizer_kind(self) -> Optional[str]:
        """'per_param' (moments stored under each parameter's name), 'dp_reshardable' or 'distrib_optim' (the
        distributed optimizer's buffers), 'legacy' (state tricorn cannot map), or None (no optimizer state)."""
        if self.fmt == "torch":
            if any((self.path / _rank_dir(self.args, t, p) / DISTRIB_OPTIM).is_file() for t, p in self.ranks):
                return "distrib_optim"
            if not self.ranks[(0, 0)].get("optimizer"):
                return None
            if self._order is None:
                try:
                    self._order = {rank: legacy_optimizer_order(sd) for rank, sd in self.ranks.items()}
                except ValueError:
                    self._order = {}
            return "per_param" if self._order else "legacy"
        keys = self.md.state_dict_metadata
        if any(k.startswith("optimizer.distributed.") and ".bucket_idx_" in k for k in keys):
            return "dp_reshardable"
        if any(k.startswith("optimizer.state.exp_avg.") for k in keys):
            return "per_param"
        return None

    def distopt(self) -> DistOptState:
        """The distributed optimizer's buffers, their layout derived from the args and checked against the files."""
        if self._distopt is not None:
            return self._distopt
        m = model_config_from_args(self.args, str(self.path))
        tp = int(self.args.get("tensor_model_parallel_size") or 1)
        where = str(self.path)
        if self.fmt == "torch_dist":
            keys = list(self.md.state_dict_metadata)
            cache: dict[str, torch.Tensor] = {}

            def lengths(t: int, p: int) -> list[int]:
                obj = self.read_object(f"optimizer.distributed.dp_group_idx_{t + tp * p}.per_bucket_numel_unpadded/shard_0_1")
                return bucket_lengths(obj, where)

            def read(t: int, p: int, name: str, bucket: int, start: int, end: int) -> torch.Tensor:
                key = bucket_key(keys, t + tp * p, bucket, name)
                if key is None:
                    raise ConvertError(f"{where}: bucket {bucket}'s {name} of model-parallel rank {t + tp * p} is missing")
                size = int(self.md.state_dict_metadata[key].size[0])
                if size * 4 > BUCKET_CACHE_BYTES:  # a large bucket: this parameter's slice alone
                    return self._dist_region(key, (start,), (end - start,))
                if key not in cache:  # small buckets are read whole, once (one DCP read costs more than their bytes)
                    if sum(v.numel() * 4 for v in cache.values()) + size * 4 > BUCKET_CACHE_BYTES:
                        cache.clear()
                    cache[key] = self._dist_region(key, (0,), (size,))
                return cache[key][start:end]

            self._distopt = DistOptState(self.args, m, tensor_map(m), lengths, read, False, where)
        else:

            def buffer(t: int, p: int) -> dict:
                if (t, p) not in self._distrib_optim:
                    file = self.path / _rank_dir(self.args, t, p) / DISTRIB_OPTIM
                    if not file.is_file():
                        raise ConvertError(f"{file} is missing; the legacy checkpoint is incomplete")
                    self._distrib_optim[(t, p)] = legacy_buffer(safe_load(file, str(file)), str(file))
                return self._distrib_optim[(t, p)]

            def read(t: int, p: int, name: str, bucket: int, start: int, end: int) -> torch.Tensor:
                return buffer(t, p)[name][start:end]

            self._distopt = DistOptState(
                self.args, m, tensor_map(m), lambda t, p: [int(buffer(t, p)["numel_unpadded"])], read, True, where
            )
        return self._distopt

    def _optimizer_common(self) -> dict:
        """The optimizer's non-tensor state (the distributed optimizer nests torch's under 'optimizer'; dp_reshardable
        keeps it, param groups and step, as an object per model-parallel rank)."""
        opt = self.common.get("optimizer") or {}
        if "param_groups" not in opt and self.fmt == "torch_dist" and self.optimizer_kind() == "dp_reshardable":
            opt = self.read_object("optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1") or {}
        return opt["optimizer"] if "param_groups" not in opt and isinstance(opt.get("optimizer"), dict) else opt

    def optimizer_step(self) -> float:
        """Adam's step count: Megatron's common step, a param group's step, or the iteration."""
        opt = self._optimizer_common()
        groups = opt.get("param_groups") or [{}]
        state = opt.get("state") or {}
        first = state.get(0) if isinstance(state.get(0), dict) else {}  # torch's per-parameter state (legacy)
        step = state.get("common_step", groups[0].get("step", first.get("step", self.iteration)))
        return float(step.item() if isinstance(step, torch.Tensor) else step)

    def lr(self) -> float:
        groups = self._optimizer_common().get("param_groups") or [{}]
        return float(groups[0].get("lr", 0.0))


# ---------------------------------------------------------------- reading


def _iteration_dir(src: Path) -> Path:
    if not src.is_dir():
        raise ConvertError(f"{src} is not a directory; pass a Megatron-LM --save directory or one of its iter_N directories")
    if src.name.startswith("iter_") or src.name == "release":
        return src
    latest = src / io.LATEST_FILE
    if not latest.is_file():
        raise ConvertError(f"{src} is not a Megatron checkpoint: it has no {io.LATEST_FILE} and is not an iter_N directory")
    text = latest.read_text().strip()
    if text == "release":
        return src / "release"
    if not text.isdigit() or len(text) > 18:
        raise ConvertError(f"{latest} holds {text[:40]!r}, not an iteration number")
    path = src / io.iter_name(int(text))
    if not path.is_dir():
        raise ConvertError(f"{latest} points at {path.name}, which is missing; the checkpoint is incomplete")
    return path


def _dist_object(path: Path, md: Any, key: str) -> Any:
    """A pickled torch_dist item (Megatron's common state, a ShardedObject such as NAME/shard_0_1), read safely."""
    info = md.storage_data.get(next((k for k in md.storage_data if k.fqn == key), None))
    if info is None:
        raise ConvertError(f"{path}: the torch_dist checkpoint has no {key}")
    with open(path / info.relative_path, "rb") as fh:
        fh.seek(info.offset)
        blob = fh.read(info.length)
    obj = safe_load(blob, f"{path}: {key}")
    return obj[0] if isinstance(obj, list) and len(obj) == 1 else obj  # torch_dist saves an object as a 1-list


def _read_dist(path: Path) -> MegatronCheckpoint:
    md = io.read_dcp_metadata(path)
    io.check_files(path, md)  # a missing or truncated shard: one line, before anything is read
    if not any(k.fqn == COMMON_KEY for k in md.storage_data):
        raise ConvertError(f"{path}: the torch_dist checkpoint has no {COMMON_KEY} (Megatron's args and iteration)")
    common = _dist_object(path, md, COMMON_KEY)
    if not isinstance(common, dict) or "args" not in common:
        raise ConvertError(f"{path}: {COMMON_KEY} does not hold Megatron's common state (args, iteration)")
    args = namespace_dict(common["args"], str(path))
    return MegatronCheckpoint(path, "torch_dist", args, common, md=md)


def _rank_dir(args: dict, tp: int, pp: int) -> str:
    """Megatron's legacy directory of TP rank tp and pipeline stage pp."""
    return f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if int(args.get("pipeline_model_parallel_size") or 1) > 1 else "")


def _read_legacy(path: Path) -> MegatronCheckpoint:
    ranks: dict = {}
    for sub in sorted(p for p in path.iterdir() if p.is_dir() and p.name.startswith("mp_rank_")):
        parts = sub.name.removeprefix("mp_rank_").split("_")
        if not all(p.isdigit() for p in parts) or len(parts) > 3:
            continue
        tp, pp = int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
        file = sub / "model_optim_rng.pt"
        if not file.is_file():
            raise ConvertError(f"{file} is missing; the legacy checkpoint is incomplete")
        ranks[(tp, pp)] = safe_load(file, str(file))
    args = namespace_dict(ranks[(0, 0)].get("args"), str(path))
    want = {
        (t, p)
        for t in range(args.get("tensor_model_parallel_size", 1))
        for p in range(args.get("pipeline_model_parallel_size", 1))
    }
    missing = sorted(want - set(ranks))
    if missing:
        name = _rank_dir(args, *missing[0])
        raise ConvertError(
            f"{path}: {name} is missing ({len(missing)} rank files in all); the saved args say "
            f"TP {args.get('tensor_model_parallel_size')} PP {args.get('pipeline_model_parallel_size')}"
        )
    common = {k: v for k, v in ranks[(0, 0)].items() if k not in ("model", "rng_state")}
    return MegatronCheckpoint(path, "torch", args, common, ranks=ranks)


def read_megatron(src: Path) -> MegatronCheckpoint:
    """The latest (or given) iteration of a Megatron checkpoint, format detected from its files."""
    path = _iteration_dir(Path(src))
    meta = path / "metadata.json"
    if (path / io.DCP_METADATA).is_file() or meta.is_file():
        try:
            backend = json.loads(meta.read_text()).get("sharded_backend") if meta.is_file() else "torch_dist"
        except ValueError as e:
            raise ConvertError(f"{meta} is not valid JSON ({e})") from None
        if backend != "torch_dist":
            raise ConvertError(f"{path}: sharded backend {backend!r}; import-megatron reads torch_dist and legacy torch")
        return _read_dist(path)
    if any(p.name.startswith("mp_rank_") for p in path.iterdir()):
        return _read_legacy(path)
    raise ConvertError(f"{path} is not a Megatron checkpoint: no .metadata (torch_dist) and no mp_rank_* (torch) inside")


def _check_dist(ck: MegatronCheckpoint, entries: list[Entry], m: ModelConfig) -> None:
    extra = [k for k in ("output_layer.weight",) if not m.untie_embeddings_and_output_weights and ck.has(k)]
    if extra:
        raise ConvertError(f"{ck.path}: args say tied embeddings, but the weights hold a separate {extra[0]}")
    for e in entries:
        if not ck.has(e.dist):
            raise ConvertError(f"{ck.path}: tensor {e.dist!r} is missing; the saved args describe a different model")
        stacked = tuple(ck.md.state_dict_metadata[e.dist].size)
        if e.layer is not None and stacked[0] != m.num_layers:
            raise ConvertError(f"{ck.path}: {e.dist} stacks {stacked[0]} layers, the args say --num-layers {m.num_layers}")
        if ck.shape(e) != tricorn_shape(e, m):
            raise ConvertError(
                f"{ck.path}: {e.dist} has shape {ck.shape(e)} per layer, the saved args imply {tricorn_shape(e, m)}"
            )


# ---------------------------------------------------------------- import


def import_megatron(src: Path, out: Path, load_optim: bool = True, console=print) -> Path:
    """Write Megatron checkpoint `src` as OUT/iter_N (+ OUT/megatron.yaml); returns the checkpoint directory."""
    src, out = Path(src), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"output {out} exists and is not empty; remove it or pick a new directory")
    check_new_save(out, "output")
    start = time.perf_counter()
    with local_group():
        ck = read_megatron(src)
        m = model_config_from_args(ck.args, str(ck.path))
        entries = tensor_map(m)
        if ck.fmt == "torch_dist":
            _check_dist(ck, entries, m)
        else:
            _check_legacy(ck, entries, m)
        kind = ck.optimizer_kind()
        with_optim = load_optim and kind is not None
        if with_optim and kind == "legacy":
            raise ConvertError(
                f"{ck.path}: the optimizer state is not the FP32 optimizer's per-parameter state (mixed precision's fp32 "
                "copies, or param groups other than Megatron's default weight-decay grouping), which tricorn cannot map "
                "to parameters exactly; import without the optimizer state with --no-load-optim, or re-save in Megatron "
                "with --ckpt-format torch_dist"
            )
        if with_optim and kind in DISTOPT_KINDS:  # the buffers' layout, checked before anything is written
            ck.distopt().check_masters(entries, ck.tensor, str(ck.path))
        dtype = torch.bfloat16 if ck.args.get("bf16") else torch.float16 if ck.args.get("fp16") else torch.float32
        by_key: dict[str, tuple[Entry, Optional[str]]] = {}
        for e in entries:
            by_key[f"model.{e.name}"] = (e, None)
            if not with_optim:
                continue
            for f in MOMENTS:
                by_key[f"optim.{e.name}.{f}"] = (e, f"optimizer.state.{f}.{e.dist}")
            # fp32 master weights: the distributed optimizer's `param`; tricorn keeps fp32 weights as the
            # parameters and the masters of bf16/fp16 parameters apart.
            master = next((k for k in (f"optimizer.state.{f}.{e.dist}" for f in ("param", "fp32_param")) if ck.has(k)), None)
            if master is not None:
                by_key[f"model.{e.name}" if dtype == torch.float32 else f"optim.{e.name}.master"] = (e, master)
            elif dtype != torch.float32:
                raise ConvertError(
                    f"{ck.path}: {e.dist} has {dtype} parameters but no fp32 master weights in the optimizer state; "
                    "import without the optimizer state with --no-load-optim"
                )
        missing = [k for e, k in by_key.values() if k and not ck.has(k)]
        if missing:
            raise ConvertError(f"{ck.path}: optimizer tensor {missing[0]!r} is missing ({len(missing)} in all)")

        def build(key: str) -> torch.Tensor:
            e, mkey = by_key[key]
            return to_tricorn(e.kind, ck.tensor(e, mkey)).contiguous()

        state = {
            k: torch.empty(tricorn_shape(e, m), dtype=dtype if k.startswith("model.") else torch.float32, device="meta")
            for k, (e, _) in by_key.items()
        }
        params_dtype = {v: k for k, v in DTYPES.items()}[dtype]
        source = f"megatron:{ck.path.resolve()}"
        # The run's progress comes along with or without the optimizer state: without it (Megatron's
        # --no-load-optim), training goes on from Megatron's iteration and data position with fresh Adam moments.
        progress = {
            "consumed_train_samples": int(ck.args.get("consumed_train_samples") or 0),
            "consumed_valid_samples": int(ck.args.get("consumed_valid_samples") or 0),
            "lr": ck.lr(),
        }
        if with_optim:
            progress.update(optimizer_step=ck.optimizer_step(), optimizer_iteration=ck.iteration)
        else:
            progress[io.OPTIMIZER_STATE] = False
        schedule, schedule_note = _schedule(ck, load_optim)
        progress[io.SCHEDULER_STATE] = schedule
        meta = import_meta(ck.iteration, params_dtype, source, **progress)
        training = TrainingConfig(**training_fields(ck.args, ck.common.get("opt_param_scheduler") or {}))
        cfg = Config(model=m, training=training)
        final = write_checkpoint(out, state, build, meta, dump_yaml(cfg))
    carried = run_fields(ck.args)
    unsupported = unsupported_args(ck.args)
    note = ", ".join(unsupported) if unsupported else "none"
    header = f"# Megatron args tricorn does not reproduce: {note}\n"
    io.atomic_write_text(out / RUN_CONFIG, header + _run_yaml(cfg, carried))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    what = "model and optimizer state" if with_optim else "model and progress, no optimizer state"
    console(
        f"imported {ck.fmt} checkpoint {ck.path} (iteration {ck.iteration}, {what}, {len(state)} tensors, "
        f"{nbytes / 1e9:.3f} GB) into {final} in {time.perf_counter() - start:.1f}s"
    )
    if unsupported:
        console(f"Megatron args tricorn does not reproduce (listed in {out / RUN_CONFIG}): {note}")
    if schedule_note:
        console(schedule_note)
    console(f"train from it with: --config {out / RUN_CONFIG} --load {out} ({' '.join(model_flags(m))})")
    return final


def _schedule(ck: MegatronCheckpoint, load_optim: bool) -> tuple[Optional[dict], str]:
    """The imported lr scheduler state (tricorn/lr_schedule.py; None: it starts at sample 0) and what to say about it.

    Megatron keeps its scheduler with its optimizer state and loads them together: with --no-load-optim its
    schedule starts again at sample 0 (warm-up included) while the iteration goes on, and so does the import's.
    A checkpoint saved with --no-save-optim holds neither: its schedule is rebuilt from its args at its consumed
    samples, Megatron's count unless a step was skipped (fp16 overflows, spike skips), as the line says."""
    scheduler = ck.common.get("opt_param_scheduler")
    if not load_optim:
        note = (
            f"--no-load-optim, as Megatron's: no optimizer or lr scheduler state; a run from it starts the lr schedule "
            f"again at sample 0 (warm-up included) after iteration {ck.iteration}"
        )
        return None, note if isinstance(scheduler, dict) and ck.iteration > 0 else ""
    if isinstance(scheduler, dict):
        return schedule_from_megatron(ck.args, scheduler).state_dict(), ""
    rebuilt = schedule_from_megatron(ck.args, None)
    assumed = (
        " (assumed: every optimizer step succeeded; Megatron's count leaves out failed ones, such as fp16 overflows)"
        if rebuilt.num_steps
        else ""
    )
    note = (
        f"{ck.path} holds no lr scheduler state (saved with --no-save-optim): the lr schedule is rebuilt from its args "
        f"at {rebuilt.num_steps} samples, its consumed samples{assumed}"
    )
    return rebuilt.state_dict(), note


def _run_yaml(cfg: Config, carried: dict[str, dict[str, Any]]) -> str:
    """A --config file: the model and training sections of `cfg` (fields that differ from tricorn's defaults, and the
    run's length), then what the run trained on (`carried`: Megatron's data and evaluation args, as they were)."""
    import dataclasses

    import yaml

    run: dict[str, dict[str, Any]] = {}
    always = ("num_layers", "hidden_size", "train_iters", "global_batch_size")
    for section, default in (("model", ModelConfig()), ("training", TrainingConfig())):
        ours = getattr(cfg, section)
        run[section] = {
            f.name: getattr(ours, f.name)
            for f in dataclasses.fields(ours)
            if getattr(ours, f.name) != getattr(default, f.name) or f.name in always
        }
    for section, fields in carried.items():
        run.setdefault(section, {}).update(fields)
    return yaml.safe_dump(run, sort_keys=False)


def _check_legacy(ck: MegatronCheckpoint, entries: list[Entry], m: ModelConfig) -> None:
    model0 = ck.ranks[(0, 0)]["model"]
    if not m.untie_embeddings_and_output_weights and "output_layer.weight" in model0:
        raise ConvertError(f"{ck.path}: args say tied embeddings, but the weights hold a separate output_layer.weight")
    for e in entries:
        stage, local = ck._stage(e)
        name = e.legacy if local is None else e.legacy.replace(f"layers.{e.layer}.", f"layers.{local}.", 1)
        if name not in ck.ranks[(0, stage)]["model"]:
            raise ConvertError(f"{ck.path}: tensor {name!r} is missing; the saved args describe a different model")
        shape = tuple(ck.tensor(e).shape)
        if shape != tricorn_shape(e, m):
            raise ConvertError(
                f"{ck.path}: {e.legacy} has shape {shape} (TP ranks merged), the saved args imply {tricorn_shape(e, m)}"
            )


# ---------------------------------------------------------------- command line


def import_main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tricorn import-megatron", description="Megatron-LM checkpoint (torch_dist or legacy torch) -> tricorn checkpoint."
    )
    parser.add_argument(
        "megatron_dir", type=Path, help="Megatron --save directory (its latest iteration) or an iter_N directory."
    )
    parser.add_argument("out", type=Path, help="New tricorn checkpoint directory; train with --load on it.")
    parser.add_argument(
        "--no-load-optim",
        action="store_true",
        help="Leave the optimizer state out: training goes on from Megatron's iteration and data position with fresh Adam moments.",
    )
    args = parser.parse_args(argv)
    return run_command(import_megatron, args.megatron_dir, args.out, not args.no_load_optim)
