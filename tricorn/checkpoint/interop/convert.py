"""What every checkpoint converter shares: writing a tricorn checkpoint tensor by tensor, and reading one back.

`write_checkpoint` publishes SAVE/iter_N the way a training save does (a temp directory, DCP files,
meta.json, config.yaml and checksums.json, then a rename and `latest`), building each tensor only when
DCP writes it, so an import holds one tensor at a time. `read_one` reads one tensor of any layout's
checkpoint at its global shape. Used by hf.py (Hugging Face) and megatron.py (Megatron-LM).
No process group, no collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from tricorn.checkpoint import io
from tricorn.checkpoint.checksums import file_checksums
from tricorn.checkpoint.interop.hf_mapping import ConvertError
from tricorn.config import ModelConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class LazySavePlanner(DefaultSavePlanner):
    """DCP's default save planner, except that each tensor is built (by `build(name)`) only when DCP writes it:
    the state dict DCP plans from holds meta tensors, so only the tensor being written is ever in memory."""

    def __init__(self, build: Callable[[str], torch.Tensor]):
        super().__init__()
        self.build = build

    def resolve_data(self, write_item):
        return self.build(write_item.index.fqn)


@contextlib.contextmanager
def quiet_no_dist() -> Iterator[None]:
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        yield


def check_new_save(save: Path, flag: str = "--save") -> None:
    if io.complete_checkpoints(save) or (save / io.LATEST_FILE).exists():
        raise ConvertError(f"{flag} {save} already holds checkpoints; import into a new directory")


def import_meta(iteration: int, params_dtype: str, source: str, **progress: Any) -> dict:
    """meta.json of an imported checkpoint. Without `progress` (consumed samples, optimizer step, lr) it is
    weights-only: a load starts training at iteration 0 with fresh optimizer state (checkpointer.py)."""
    layout = dict(tp=1, pp=1, vpp=1, cp=1, dp=1, world=1, distributed_optimizer=False, zero_stage=1, params_dtype=params_dtype)
    meta = {
        "format_version": io.FORMAT_VERSION,
        "iteration": iteration,
        "consumed_train_samples": 0,
        "consumed_valid_samples": 0,
        "optimizer_step": 0.0,
        "optimizer_iteration": 0,
        "loss_scaler": None,
        "lr": 0.0,
        "layout": layout,
        "saved_at": time.time(),
        "weights_only": not progress,
        "source": source,
    }
    meta.update(progress)
    return meta


def write_checkpoint(
    save: Path,
    state: dict[str, torch.Tensor],
    build: Callable[[str], torch.Tensor],
    meta: dict,
    config_yaml: str,
) -> Path:
    """Publish SAVE/iter_<meta iteration>: `state` holds meta tensors (names, shapes, dtypes), build(key) the data."""
    import torch.distributed.checkpoint as dcp

    iteration = int(meta["iteration"])
    save.mkdir(parents=True, exist_ok=True)
    io.remove_stale_tmp(save)
    tmp = io.tmp_dir(save, iteration, f"import{os.getpid()}")
    tmp.mkdir()
    writer = io.Writer(tmp, iteration, 0)
    with quiet_no_dist():
        dcp.save(state, storage_writer=writer, planner=LazySavePlanner(build), no_dist=True)
    io.atomic_write_text(tmp / io.META_FILE, json.dumps(meta, indent=1))
    io.atomic_write_text(tmp / io.CONFIG_FILE, config_yaml)
    # The writer hashed the shard and .metadata as they were written; a load verifies them like a training save's.
    io.write_manifest(tmp, {**writer.checksums, **file_checksums(tmp, [io.META_FILE, io.CONFIG_FILE])})
    io.fsync_dir(tmp)
    final = save / io.iter_name(iteration)
    os.replace(tmp, final)
    io.fsync_dir(save)
    io.atomic_write_text(save / io.LATEST_FILE, f"{iteration}\n")
    return final


# ---------------------------------------------------------------- reading a tricorn checkpoint


def find_checkpoint_dir(load: Path, ckpt_step: Optional[int]) -> Path:
    """An iter_N directory given directly, or the latest (or --ckpt-step) one under a save directory."""
    if io.is_complete(load):
        return load
    path, _ = io.find_checkpoint(load, ckpt_step)
    if path is None:
        raise ConvertError(f"--load {load} holds no checkpoint; pass a --save directory or one of its iter_N directories")
    return path


def read_model_config(ckpt: Path) -> ModelConfig:
    import yaml

    path = ckpt / io.CONFIG_FILE
    try:
        saved = (yaml.safe_load(path.read_text()) or {}).get("model", {})
    except (OSError, yaml.YAMLError, AttributeError) as e:
        raise io.CheckpointError(f"checkpoint damaged: {path} cannot be read ({e})") from None
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in saved.items() if k in known})


def read_one(ckpt: Path, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    buf = torch.empty(shape, dtype=dtype)
    io.dcp_load({key: buf}, ckpt, no_dist=True)
    return buf


def fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def run_command(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """A converter command's exit code: 0, or 2 with its one `tricorn: error:` line for a refused input."""
    try:
        fn(*args, **kwargs)
    except (ConvertError, io.CheckpointError) as e:
        print(f"tricorn: error: {e}", file=sys.stderr)
        return 2
    return 0
