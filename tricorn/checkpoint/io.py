"""Files of a checkpoint: names, atomic writes, safe reading, damage checks, retention.

A save directory holds

    latest_checkpointed_iteration.txt   the newest complete iteration (Megatron's name)
    iter_0000100/                        one complete checkpoint
        .metadata  __<rank>_0.distcp     torch.distributed.checkpoint (DCP) files: every tensor
                                         under its global name and global shape
        meta.json                        iteration, consumed samples, loss scaler, layout, ...
        config.yaml                      the resolved config of the run that saved it
        rng/<grid position>.json         RNG states of each rank, keyed by pp/dp/cp/tp position
        checksums.json                   size and XXH3-64 digest of every file above (older checkpoints lack it)
    iter_0000200.tmp-<token>/            a save in progress (never loaded)

Nothing here runs a collective; every check is a file check that each rank
can make on its own before any collective load starts, so a damaged
checkpoint is one clear error on every rank instead of a hang or a traceback.
Checksums (tricorn.checkpoint.checksums) are computed where each file is written: a shard by the
rank that writes it, as the bytes go by, on the save's writer thread (a background thread with
--async-save). Rank 0 gathers them into checksums.json before the checkpoint is published; a load
verifies them (each rank a share of the files) unless --no-verify-checkpoint.
Reading never unpickles arbitrary objects: DCP's `.metadata` pickle goes through an allowlist of DCP's own metadata classes, tensors are read with
`torch.load(weights_only=True)` (DCP's reader), and byte blobs are refused.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from tricorn.checkpoint.checksums import ALGORITHM, file_checksum
from tricorn.checkpoint.errors import CheckpointError  # noqa: F401 - re-exported: callers import it from here
from tricorn.config import ModelConfig

LATEST_FILE = "latest_checkpointed_iteration.txt"
META_FILE = "meta.json"
CONFIG_FILE = "config.yaml"
RNG_DIR = "rng"
DCP_METADATA = ".metadata"
CHECKSUM_FILE = "checksums.json"
FORMAT_VERSION = 1
_ITER_RE = re.compile(r"^iter_([0-9]{7,18})$")
_DIGITS_RE = re.compile(r"[0-9]{1,18}")  # an iteration number that fits int64
_TMP_MARK = ".tmp-"


_DCP_CLASSES = ("SafeReader", "SafeLoadPlanner", "Writer", "HashingFileSystem")


def __getattr__(name: str) -> Any:
    """DCP's reader, planner and writer subclasses (dcp_files.py), imported on first use: DCP takes a second of
    every process's start-up, and a run without checkpoints never needs it (bench/startup.py)."""
    if name in _DCP_CLASSES:
        from tricorn.checkpoint import dcp_files

        globals()[name] = value = getattr(dcp_files, name)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def atomic_write_text(path: Path, text: str) -> None:
    """Write next to `path`, flush to disk, then rename over it: readers see the old or the new file, never half."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- safe reading


@functools.lru_cache(maxsize=1)
def _allowed_globals() -> dict[tuple[str, str], Any]:
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata, planner

    allowed: dict[tuple[str, str], Any] = {}
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    ):
        allowed[("torch.distributed.checkpoint.metadata", name)] = getattr(metadata, name)
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    # Megatron-LM's torch_dist checkpoints keep DCP's own save plans in the metadata (plain dataclasses).
    for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"):
        allowed[("torch.distributed.checkpoint.planner", name)] = getattr(planner, name)
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = getattr(pathlib, name)
    return allowed


class _SafeUnpickler(pickle.Unpickler):
    """DCP's metadata classes, torch dtypes and paths; anything else is refused (no code runs)."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _allowed_globals()
        if (module, name) in allowed:
            return allowed[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def read_dcp_metadata(ckpt: Path):
    """DCP's Metadata of checkpoint directory `ckpt`, unpickled through the allowlist."""
    path = ckpt / DCP_METADATA
    if not path.is_file():
        raise CheckpointError(f"checkpoint damaged: {path} is missing; pick another iteration with --ckpt-step")
    try:
        with open(path, "rb") as fh:
            md = _SafeUnpickler(fh).load()
        files = {info.relative_path for info in md.storage_data.values()}
    except (pickle.UnpicklingError, EOFError, ValueError, AttributeError, TypeError, IndexError, KeyError) as e:
        raise CheckpointError(
            f"checkpoint damaged: {path} cannot be read ({e}); pick another iteration with --ckpt-step"
        ) from None
    for rel in sorted(files, key=str):
        if not _inside(rel):
            raise CheckpointError(
                f"checkpoint refused: {path} points at {str(rel)[:80]!r} outside the checkpoint directory; "
                "tricorn reads only files inside it"
            )
    return md


def _inside(rel: Any) -> bool:
    """A shard file name as DCP writes it: a plain name in the checkpoint directory (no '..', no '/', not absolute)."""
    return isinstance(rel, str) and rel not in ("", ".", "..") and os.path.basename(rel) == rel and "\\" not in rel


# ---------------------------------------------------------------- checksums


def write_manifest(ckpt: Path, checksums: dict[str, dict]) -> None:
    atomic_write_text(
        ckpt / CHECKSUM_FILE, json.dumps({"algorithm": ALGORITHM, "files": dict(sorted(checksums.items()))}, indent=1)
    )


def read_manifest(ckpt: Path) -> Optional[dict[str, dict]]:
    """file name -> {"size", "digest"} from checksums.json; None for a checkpoint saved before checksums existed."""
    path = ckpt / CHECKSUM_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(_read_text(path, limit=64 << 20))
        files = data["files"] if data.get("algorithm") == ALGORITHM else None
        valid = isinstance(files, dict) and all(
            _inside_tree(name) and isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("digest"), str)
            for name, v in files.items()
        )
    except (ValueError, AttributeError, KeyError, TypeError):
        valid = False
    if not valid:
        raise CheckpointError(f"checkpoint damaged: {path} is not a valid checksum list; pick another iteration with --ckpt-step")
    return files


def _inside_tree(name: Any) -> bool:
    """A manifest entry: a relative path below the checkpoint directory (rng/<name>.json or a plain name)."""
    parts = name.split("/") if isinstance(name, str) else []
    return bool(parts) and len(parts) <= 2 and all(_inside(p) for p in parts)


def checksum_errors(ckpt: Path, manifest: dict[str, dict], names: list[str]) -> list[str]:
    """One line per file among `names` whose size or digest differs from the manifest (or that is missing)."""
    errors = []
    for name in names:
        path = ckpt / name
        if not path.is_file():
            errors.append(f"checkpoint damaged: {path} is missing; pick another iteration with --ckpt-step")
            continue
        have, want = file_checksum(path), manifest[name]
        if have != {"size": want["size"], "digest": want["digest"]}:
            errors.append(
                f"checkpoint damaged: {path} does not match its checksum in {CHECKSUM_FILE} "
                f"(XXH3 {have['digest']}, {have['size']} bytes; saved {want['digest']}, {want['size']} bytes); "
                "pick another iteration with --ckpt-step, or --no-verify-checkpoint to load it anyway"
            )
    return errors


# ---------------------------------------------------------------- finding and checking


def is_complete(path: Path) -> bool:
    return _ITER_RE.match(path.name) is not None and (path / DCP_METADATA).is_file() and (path / META_FILE).is_file()


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _ITER_RE.match(p.name)) and is_complete(p)]
    return sorted(found)


def find_checkpoint(root: Path, ckpt_step: Optional[int]) -> tuple[Optional[Path], str]:
    """(checkpoint directory or None for a fresh start, a note for the log)."""
    if ckpt_step is not None:
        path = root / iter_name(ckpt_step)
        if not path.is_dir():
            raise CheckpointError(f"--ckpt-step {ckpt_step}: {path} does not exist")
        return path, f"loading {path} (--ckpt-step)"
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"--load {root} is a file; it needs the checkpoint directory (the one --save wrote)")
    latest = root / LATEST_FILE
    if latest.is_file():
        text = _read_text(latest, limit=1 << 16).strip()
        if not _DIGITS_RE.fullmatch(text):  # ASCII digits only: str.isdigit() also accepts '²'
            raise CheckpointError(f"checkpoint damaged: {latest} holds {text[:40]!r}, not an iteration number")
        path = root / iter_name(int(text))
        if not path.is_dir():
            raise CheckpointError(f"checkpoint damaged: {latest} points to iteration {int(text)} but {path} does not exist")
        return path, f"loading {path} ({LATEST_FILE})"
    done = complete_checkpoints(root)
    if done:  # a crash between the rename and the update of `latest`
        return done[-1][1], f"loading {done[-1][1]} (newest complete checkpoint; {latest} is missing)"
    return None, f"no checkpoint in {root}: starting from scratch"


SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_size",
    "num_attention_heads",
    "kv_heads",
    "vocab_size",
    "swiglu",
    "disable_bias_linear",
    "untie_embeddings_and_output_weights",
    "position_embedding_type",
    "normalization",
    "num_experts",
    "moe_ffn_size",
    "moe_layer_freq",
    "moe_shared_expert_intermediate_size",
)


def model_shape(m: ModelConfig) -> dict[str, Any]:
    shape = {k: getattr(m, k) for k in SHAPE_FIELDS}
    if m.position_embedding_type == "learned_absolute":
        shape["max_positions"] = m.max_positions
    return shape


def check_config(ckpt: Path, model: ModelConfig) -> None:
    import yaml

    path = ckpt / CONFIG_FILE
    try:
        saved = (yaml.safe_load(path.read_text()) or {}).get("model", {})
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        theirs = model_shape(ModelConfig(**{k: v for k, v in saved.items() if k in known}))
    except (OSError, yaml.YAMLError, TypeError, AttributeError) as e:
        raise unreadable(path, e) from None
    ours = model_shape(model)
    diff = [f"{k} {theirs.get(k)} (checkpoint) vs {v} (this run)" for k, v in ours.items() if theirs.get(k) != v]
    if diff:
        raise CheckpointError(f"{path} describes a different model: {'; '.join(diff)}; use the model flags it was saved with")


def checkpoint_vocab_size(load: str, ckpt_step: Optional[int]) -> Optional[tuple[Path, int]]:
    """(checkpoint directory, the vocabulary size its config.yaml records) of what --load would load, or None."""
    import yaml

    path, _ = find_checkpoint(Path(load), ckpt_step)
    if path is None or not (path / CONFIG_FILE).is_file():
        return None
    try:
        saved = (yaml.safe_load(_read_text(path / CONFIG_FILE)) or {}).get("model", {})
    except (yaml.YAMLError, AttributeError) as e:
        raise unreadable(path / CONFIG_FILE, e) from None
    vocab = saved.get("vocab_size") if isinstance(saved, dict) else None
    return (path, vocab) if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def unreadable(path: Path, e: Exception) -> CheckpointError:
    """The one line for a checkpoint file that cannot be parsed: what is wrong with it, and what to do."""
    why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else str(e)
    return CheckpointError(f"checkpoint damaged: {path} cannot be read ({why}); pick another iteration with --ckpt-step")


def _read_text(path: Path, limit: int = 1 << 20) -> str:
    """A small text file of the checkpoint; CheckpointError naming it when unreadable, oversized or not UTF-8."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(limit + 1)
        if len(data) > limit:
            raise ValueError(f"larger than {limit} bytes")
        return data.decode("utf-8")
    except (OSError, ValueError) as e:
        raise unreadable(path, e) from None


# meta.json: key -> (accepted types, smallest value). Checked before any tensor is read, so a damaged
# file is refused before the weights change.
META_SCHEMA: dict[str, tuple[tuple[type, ...], Optional[float]]] = {
    "iteration": ((int,), 0),
    "consumed_train_samples": ((int,), 0),
    "consumed_valid_samples": ((int,), 0),
    "optimizer_step": ((int, float), 0),
    "optimizer_iteration": ((int,), 0),
    "loss_scaler": ((dict, type(None)), None),
    "layout": ((dict,), None),
}
# meta.json's lr scheduler state: Megatron's OptimizerParamScheduler.state_dict() (lr_schedule.py).
# Checkpoints written before tricorn's schedule was Megatron's have none (their lr was a function of the iteration).
SCHEDULER_STATE = "opt_param_scheduler"
# Keys only some runs write (--skip-samples, --check-for-spiky-loss), or older checkpoints lack: checked when present.
OPTIONAL_META: dict[str, tuple[tuple[type, ...], Optional[float]]] = {
    "skipped_train_samples": ((int,), 0),
    "spiky_loss": ((dict,), None),
    "optimizer_dtypes": ((dict,), None),  # --use-precision-aware-optimizer: each optimizer state's stored dtype
    SCHEDULER_STATE: ((dict, type(None)), None),  # null: none saved on purpose (the schedule starts at sample 0)
}
LAYOUT_KEYS = ("tp", "pp", "vpp", "cp", "dp")
# meta.json of an import that carries the run's progress but no optimizer state (`import-megatron --no-load-optim`)
# holds this key as false: a load then goes on from its iteration with fresh optimizer state.
OPTIMIZER_STATE = "optimizer_state"


def read_meta(ckpt: Path) -> dict:
    path = ckpt / META_FILE
    try:
        meta = json.loads(_read_text(path))
    except ValueError as e:
        raise unreadable(path, e) from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint damaged: {path} holds {type(meta).__name__}, not an object")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format_version')} is not {FORMAT_VERSION}")
    for key, (types, lo) in META_SCHEMA.items():
        _check_meta_value(path, key, meta.get(key, _MISSING), types, lo)
    for key, (types, lo) in OPTIONAL_META.items():
        if key in meta:
            _check_meta_value(path, key, meta[key], types, lo)
    for key in LAYOUT_KEYS:
        _check_meta_value(path, f"layout.{key}", meta["layout"].get(key, _MISSING), (int,), 1)
    return meta


_MISSING = object()


def _check_meta_value(path: Path, key: str, value: Any, types: tuple[type, ...], lo: Optional[float]) -> None:
    if value is _MISSING:
        raise CheckpointError(f"checkpoint damaged: {path} lacks {key!r}; pick another iteration with --ckpt-step")
    typed = isinstance(value, types) and not isinstance(value, bool)
    if not typed or (lo is not None and not (value >= lo and value < 2**63)):  # NaN fails too
        raise CheckpointError(f"checkpoint damaged: {path} holds {key} = {value!r:.40}; pick another iteration with --ckpt-step")


def check_files(ckpt: Path, md) -> None:
    """Every shard file the metadata refers to exists and is long enough."""
    need: dict[str, int] = {}
    for info in md.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        path = ckpt / rel
        if not path.is_file():
            raise CheckpointError(f"checkpoint damaged: shard file {path} is missing; pick another iteration with --ckpt-step")
        have = path.stat().st_size
        if have < size:
            raise CheckpointError(
                f"checkpoint damaged: shard file {path} is truncated ({have} bytes, needs {size}); pick another iteration with --ckpt-step"
            )


def verify_checkpoint(ckpt: Path, model: ModelConfig) -> tuple[dict, Any]:
    """(meta, DCP metadata) of `ckpt` after the file checks; CheckpointError naming the file otherwise."""
    meta = read_meta(ckpt)
    check_config(ckpt, model)
    md = read_dcp_metadata(ckpt)
    check_files(ckpt, md)
    check_rng_files(ckpt)
    return meta, md


def check_rng_files(ckpt: Path) -> None:
    """Every rank's RNG file decodes to states of the right size, checked by every rank before any collective
    (so one rank's damaged file is the same one-line error everywhere, not a failure on that rank alone)."""
    cpu_bytes = torch.get_rng_state().numel()
    rng_dir = ckpt / RNG_DIR
    for path in sorted(rng_dir.glob("*.json")) if rng_dir.is_dir() else []:
        states = decode_rng(path)
        if states.get("cpu") is None or states["cpu"].numel() != cpu_bytes:
            raise CheckpointError(
                f"checkpoint damaged: {path} holds no valid CPU RNG state; pick another iteration with --ckpt-step"
            )


def load_errors(cfg: Any) -> list[str]:
    """The --load checkpoint's file checks before launch (no process group): [] or the one line naming the file."""
    c = cfg.checkpoint
    if not c.load:
        return []
    try:
        path, _ = find_checkpoint(Path(c.load), c.ckpt_step)
        if path is not None:
            meta, _ = verify_checkpoint(path, cfg.model)
            _check_schedule(path, meta, cfg)
    except CheckpointError as e:
        return [str(e)]
    return []


def _check_schedule(path: Path, meta: dict, cfg: Any) -> None:
    """The flags' lr schedule against the checkpoint's, as the load will take it (Megatron's rules, before launch)."""
    from tricorn.lr_schedule import schedule_from_config

    c, t = cfg.checkpoint, cfg.training
    state = meta.get(SCHEDULER_STATE)
    if state is None or c.no_load_optim or c.finetune or meta.get("weights_only"):
        return
    try:
        schedule_from_config(t).load_state_dict(
            state, override=t.override_opt_param_scheduler, use_checkpoint=t.use_checkpoint_opt_param_scheduler
        )
    except ValueError as e:  # ScheduleMismatch, or a state without its count
        raise CheckpointError(f"{path}: {e}") from None


# ---------------------------------------------------------------- RNG states as JSON


def encode_rng(states: dict[str, torch.Tensor]) -> str:
    return json.dumps({k: base64.b64encode(v.cpu().numpy().tobytes()).decode() for k, v in states.items()})


def decode_rng(path: Path) -> dict[str, torch.Tensor]:
    try:
        data = json.loads(_read_text(path))
        return {k: torch.frombuffer(bytearray(base64.b64decode(v, validate=True)), dtype=torch.uint8) for k, v in data.items()}
    except (ValueError, TypeError, AttributeError) as e:  # binascii.Error is a ValueError; a non-dict has no .items
        raise unreadable(path, e) from None


# ---------------------------------------------------------------- retention and inspection


def prune(root: Path, keep: int, newest: int) -> list[Path]:
    """Delete complete checkpoints older than the `keep` newest; `newest` (just completed) always stays."""
    done = [(it, p) for it, p in complete_checkpoints(root) if it != newest]
    doomed = [p for _, p in done[: max(len(done) - (keep - 1), 0)]]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def remove_stale_tmp(root: Path) -> None:
    """Leftovers of saves that never completed (a crash or a kill); only called while no save runs."""
    if root.is_dir():
        for p in root.iterdir():
            if _TMP_MARK in p.name and p.name.startswith("iter_") and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)


def tmp_dir(root: Path, iteration: int, token: str) -> Path:
    return root / f"{iter_name(iteration)}{_TMP_MARK}{token}"


def dcp_load(targets: dict[str, torch.Tensor], ckpt: Path, group=None, no_dist: bool = False) -> None:
    """DCP load through the safe reader and planner; a failure on any rank becomes one line naming `ckpt`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from tricorn.checkpoint.dcp_files import SafeLoadPlanner, SafeReader

    try:
        with warnings.catch_warnings():  # no_dist: "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(
                targets,
                storage_reader=SafeReader(str(ckpt), read_dcp_metadata),
                planner=SafeLoadPlanner(),
                process_group=group,
                no_dist=no_dist,
            )
    except CheckpointException as e:  # a BaseException holding (exception, traceback) per failed rank
        rank, (exc, _) = next(iter(e.failures.items()))
        if isinstance(exc, CheckpointError):
            raise exc from None
        raise CheckpointError(f"checkpoint damaged: reading {ckpt} failed on rank {rank}: {describe_read_error(exc)}") from None


def describe_read_error(exc: BaseException) -> str:
    """The first line of a read failure, never torch's advice to retry with weights_only=False (that runs code)."""
    text = str(exc).strip()
    if isinstance(exc, pickle.UnpicklingError) or "weights_only" in text or "Weights only" in text:
        return "a shard holds something other than plain tensor data (refused: tricorn reads tensors only)"
    return text.splitlines()[0] if text else type(exc).__name__


def read_tensors(ckpt: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint at its global shape, in this process (no process group): for tests and tools."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = read_dcp_metadata(ckpt)
    out = {
        k: torch.zeros(v.size, dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and k.startswith(prefix)
    }
    dcp_load(out, ckpt, no_dist=True)
    return out
