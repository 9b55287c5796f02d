"""Megatron-LM -> tricorn checkpoints: `tricorn import-megatron` (export-megatron: megatron_export.py).

import-megatron reads a Megatron-LM GPTModel checkpoint, torch_dist (`iter_N/.metadata`, `__*_*.distcp`,
`metadata.json`) or legacy torch (`iter_N/mp_rank_XX[_YYY]/model_optim_rng.pt`), the format detected from
the files, at any saved TP/PP/DP, and writes a tricorn checkpoint `OUT/iter_N` that `--load` resumes on
any tricorn layout: the model, the iteration, the consumed samples, the lr schedule and, where Megatron
stored it per parameter (the FP32 optimizer's or the distributed optimizer's `fully_reshardable` torch_dist
state; the legacy format's FP32 optimizer, whose state is indexed by Megatron's parameter order, derived
and checked in megatron_mapping.legacy_optimizer_order), the Adam moments. Optimizer state tricorn cannot
map to parameters exactly (`dp_reshardable` buckets, the legacy distributed optimizer's `distrib_optim.pt`)
is refused in one line unless --no-load-optim, which leaves the optimizer state out (training then goes on
from Megatron's iteration and data position with fresh Adam moments, as Megatron's own --no-load-optim does).
`OUT/megatron.yaml` holds the run's model and training flags, and on its first line the Megatron args
tricorn does not reproduce.

Reading is safe (megatron_pickle.py); mapping is exact (megatron_mapping.py). Memory: one tensor at a time
for torch_dist (one layer of a stacked tensor is read, through a one-process gloo group's ShardedTensor);
the legacy format reads its per-rank files whole. No collectives beyond that local group.
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
from tricorn.checkpoint.interop.megatron_mapping import (
    Entry,
    legacy_optimizer_order,
    merge_tp,
    model_config_from_args,
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

    @property
    def iteration(self) -> int:
        return int(self.common.get("iteration", 0))

    # ------------------------------------------------------------ tensors

    def has(self, key: str) -> bool:
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
        from tricorn.checkpoint.pieces import Piece, owned_tensor

        entry = self.md.state_dict_metadata[key]
        if layer is None:
            return read_one(self.path, key, tuple(entry.size), entry.properties.dtype)
        shape = tuple(entry.size)
        flat = torch.empty(int(torch.Size(shape[1:]).numel()), dtype=entry.properties.dtype)
        piece = Piece(0, flat.numel(), (layer,) + (0,) * (len(shape) - 1), (1, *shape[1:]))
        with local_group(), warnings.catch_warnings():  # ShardedTensor's deprecation: DCP reads one layer all the same
            warnings.simplefilter("ignore", FutureWarning)
            io.dcp_load({key: owned_tensor(flat, shape, [piece])}, self.path, no_dist=True)
        return flat.view(shape[1:])

    # ------------------------------------------------------------ optimizer state

    def optimizer_kind(self) -> Optional[str]:
        """'per_param' (moments stored under each parameter's name), or why the state cannot be imported."""
        if self.fmt == "torch":
            if not self.ranks[(0, 0)].get("optimizer"):
                return None
            if self._order is None:
                try:
                    self._order = {rank: legacy_optimizer_order(sd) for rank, sd in self.ranks.items()}
                except ValueError:
                    self._order = {}
            return "per_param" if self._order else "legacy"
        keys = self.md.state_dict_metadata
        if any(k.startswith("optimizer.distributed.") for k in keys):
            return "dp_reshardable"
        if any(k.startswith("optimizer.state.exp_avg.") for k in keys):
            return "per_param"
        return None

    def _optimizer_common(self) -> dict:
        """The optimizer's non-tensor state (the distributed optimizer nests torch's under 'optimizer')."""
        opt = self.common.get("optimizer") or {}
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


def _read_dist(path: Path) -> MegatronCheckpoint:
    md = io.read_dcp_metadata(path)
    io.check_files(path, md)  # a missing or truncated shard: one line, before anything is read
    info = md.storage_data.get(next((k for k in md.storage_data if k.fqn == COMMON_KEY), None))
    if info is None:
        raise ConvertError(f"{path}: the torch_dist checkpoint has no {COMMON_KEY} (Megatron's args and iteration)")
    with open(path / info.relative_path, "rb") as fh:
        fh.seek(info.offset)
        blob = fh.read(info.length)
    common = safe_load(blob, f"{path}: {COMMON_KEY}")
    common = common[0] if isinstance(common, list) and len(common) == 1 else common
    if not isinstance(common, dict) or "args" not in common:
        raise ConvertError(f"{path}: {COMMON_KEY} does not hold Megatron's common state (args, iteration)")
    args = namespace_dict(common["args"], str(path))
    return MegatronCheckpoint(path, "torch_dist", args, common, md=md)


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
        t, p = missing[0]
        name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if args.get("pipeline_model_parallel_size", 1) > 1 else "")
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
        if with_optim and kind != "per_param":
            why = {
                "dp_reshardable": "is dp_reshardable (flat per-bucket buffers in Megatron's parameter order)",
                "legacy": "is not the FP32 optimizer's per-parameter state (the distributed optimizer's distrib_optim.pt, "
                "or mixed precision's fp32 copies, in Megatron's parameter order)",
            }[kind]
            raise ConvertError(
                f"{ck.path}: the optimizer state {why}, which tricorn cannot map to parameters exactly; "
                "import without the optimizer state with --no-load-optim, or re-save in Megatron with --ckpt-format torch_dist "
                "--dist-ckpt-optim-fully-reshardable"
            )
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
        # Megatron's scheduler state travels with its optimizer state: without it the schedule starts again, as
        # Megatron's --no-load-optim does (lr_schedule.py).
        scheduler = ck.common.get("opt_param_scheduler")
        with_schedule = with_optim and isinstance(scheduler, dict)
        progress[io.SCHEDULER_STATE] = schedule_from_megatron(ck.args, scheduler).state_dict() if with_schedule else None
        meta = import_meta(ck.iteration, params_dtype, source, **progress)
        training = TrainingConfig(**training_fields(ck.args, ck.common.get("opt_param_scheduler") or {}))
        cfg = Config(model=m, training=training)
        final = write_checkpoint(out, state, build, meta, dump_yaml(cfg))
    unsupported = unsupported_args(ck.args)
    note = ", ".join(unsupported) if unsupported else "none"
    header = f"# Megatron args tricorn does not reproduce: {note}\n"
    io.atomic_write_text(out / RUN_CONFIG, header + _run_yaml(cfg))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    what = "model and optimizer state" if with_optim else "model and progress, no optimizer state"
    console(
        f"imported {ck.fmt} checkpoint {ck.path} (iteration {ck.iteration}, {what}, {len(state)} tensors, "
        f"{nbytes / 1e9:.3f} GB) into {final} in {time.perf_counter() - start:.1f}s"
    )
    if unsupported:
        console(f"Megatron args tricorn does not reproduce (listed in {out / RUN_CONFIG}): {note}")
    console(f"train from it with: --config {out / RUN_CONFIG} --load {out} ({' '.join(model_flags(m))})")
    return final


def _run_yaml(cfg: Config) -> str:
    """The model and training sections of `cfg`, fields that differ from tricorn's defaults only (a --config file)."""
    import dataclasses

    import yaml

    run = {}
    for section, default in (("model", ModelConfig()), ("training", TrainingConfig())):
        ours = getattr(cfg, section)
        run[section] = {
            f.name: getattr(ours, f.name)
            for f in dataclasses.fields(ours)
            if getattr(ours, f.name) != getattr(default, f.name) or f.name in ("num_layers", "hidden_size")
        }
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
