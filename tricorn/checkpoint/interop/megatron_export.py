"""`tricorn export-megatron`: a tricorn checkpoint of any layout -> a Megatron-LM checkpoint (model weights).

torch_dist is written as megatron-core 0.19 writes it: layers stacked on a leading dimension in one chunk
per layer, the `_extra_state` objects its loader asks for, and `common_state/shard_0_1` holding the args
Megatron checks and rebuilds the GPTModel from; Megatron reshards it to any TP/PP on load. Legacy torch is
one `mp_rank_XX/model_optim_rng.pt` per TP rank (--tensor-model-parallel-size; PP 1). Megatron loads either
with --no-load-optim --no-load-rng (or --finetune). The tensor mapping is megatron_mapping.py's (exact).
Memory: torch_dist holds one layer's tensor at a time; legacy torch the whole model (one pickle per rank).
No collectives (a one-process gloo group names the per-layer chunks for DCP).
"""

from __future__ import annotations

import argparse
import io as pyio
import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from tricorn.checkpoint import io
from tricorn.checkpoint.interop.convert import find_checkpoint_dir, quiet_no_dist, read_model_config, read_one, run_command
from tricorn.checkpoint.interop.hf_mapping import ConvertError
from tricorn.checkpoint.interop.megatron import COMMON_KEY, local_group
from tricorn.checkpoint.interop.megatron_mapping import Entry, split_tp, tensor_map, to_megatron, tricorn_shape
from tricorn.config import ModelConfig
from tricorn.lr_schedule import SCHEDULE_ARGS

# tricorn config fields that are Megatron args of the same name and meaning, carried into an export's args (the lr
# schedule's all: lr_schedule.py SCHEDULE_ARGS).
CARRIED = {
    "training": tuple(dict.fromkeys((
        "micro_batch_size", "global_batch_size", "train_iters", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps",
        "clip_grad", "seed", "bf16", "fp16", *SCHEDULE_ARGS,
    ))),
    "data": ("tokenizer_type", "tokenizer_model"),
}  # fmt: skip


def _saved_config(ckpt: Path) -> dict:
    import yaml

    try:
        return yaml.safe_load((ckpt / io.CONFIG_FILE).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise io.CheckpointError(f"checkpoint damaged: {ckpt / io.CONFIG_FILE} cannot be read ({e})") from None


def megatron_args(m: ModelConfig, saved: dict, fmt: str, iteration: int, tp: int) -> argparse.Namespace:
    """The saved args Megatron's loader reads to check and rebuild the GPTModel (TP `tp`, PP 1)."""
    carried = {k: saved.get(section, {}).get(k) for section, names in CARRIED.items() for k in names}
    return argparse.Namespace(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_size,
        num_attention_heads=m.num_attention_heads,
        group_query_attention=m.group_query_attention,
        num_query_groups=m.kv_heads,
        kv_channels=m.head_dim,
        seq_length=m.seq_length,
        max_position_embeddings=m.max_positions,
        position_embedding_type=m.position_embedding_type,
        add_position_embedding=True,  # Megatron's default; its GPTModel reads position_embedding_type
        rotary_base=int(m.rotary_base) if float(m.rotary_base).is_integer() else m.rotary_base,
        use_rope_scaling=m.use_rope_scaling,
        rope_scaling_factor=m.rope_scaling_factor,
        normalization=m.normalization,
        norm_epsilon=m.norm_epsilon,
        swiglu=m.swiglu,
        add_bias_linear=not m.disable_bias_linear,
        add_qkv_bias=not m.disable_bias_linear,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        padded_vocab_size=m.vocab_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        ckpt_format=fmt,
        use_dist_ckpt=fmt == "torch_dist",
        iteration=iteration,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        **{k: v for k, v in carried.items() if v is not None},
    )


def export_megatron(
    load: Path, out: Path, fmt: str = "torch_dist", ckpt_step: Optional[int] = None, tp: int = 1, console=print
) -> Path:
    """Write tricorn checkpoint `load` (any layout) as a Megatron checkpoint OUT (model weights; torch: TP `tp`)."""

    load, out = Path(load), Path(out)
    ckpt = find_checkpoint_dir(load, ckpt_step)
    meta = io.read_meta(ckpt)
    m = read_model_config(ckpt)
    if m.num_experts is not None:
        raise ConvertError(f"{ckpt} is a mixture-of-experts model; export-megatron writes dense GPT models only")
    md = io.read_dcp_metadata(ckpt)
    io.check_files(ckpt, md)
    if fmt == "torch_dist" and tp != 1:
        raise ConvertError("--tensor-model-parallel-size is for --format torch: Megatron reshards torch_dist itself")
    problems = _tp_problems(m, tp)
    if problems:
        raise ConvertError(f"--tensor-model-parallel-size {tp} does not divide {problems}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"output {out} exists and is not empty; remove it or pick a new directory")
    entries = tensor_map(m)
    keys = md.state_dict_metadata
    for e in entries:
        entry = keys.get(f"model.{e.name}")
        if entry is None or tuple(entry.size) != tricorn_shape(e, m):
            raise io.CheckpointError(
                f"checkpoint {ckpt} lacks tensor 'model.{e.name}' at {tricorn_shape(e, m)}; its config.yaml describes another model"
            )
    start = time.perf_counter()

    def megatron_tensor(e: Entry) -> torch.Tensor:
        # The parameters in the model's dtype, as Megatron saves its model (an --fp8-param-gather run saved its FP8
        # weights as their fp32 masters: cast to the dtype of the rest, which Megatron's parameters share).
        entry = keys[f"model.{e.name}"]
        value = read_one(ckpt, f"model.{e.name}", tuple(entry.size), entry.properties.dtype)
        return to_megatron(e.kind, value.to(keys[f"model.{entries[0].name}"].properties.dtype))

    iteration = int(meta["iteration"])
    args = megatron_args(m, _saved_config(ckpt), fmt, iteration, tp)
    common = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "num_floating_point_operations_so_far": 0}
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    it_dir = tmp / io.iter_name(iteration)
    it_dir.mkdir(parents=True)
    dtype = keys[f"model.{entries[0].name}"].properties.dtype
    nbytes = sum(int(torch.Size(tricorn_shape(e, m)).numel()) * dtype.itemsize for e in entries)
    if fmt == "torch":
        per_rank: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
        for e in entries:  # the whole model is in memory once: the legacy format is one pickle per rank
            for rank, piece in enumerate(split_tp(e, megatron_tensor(e), tp)):
                per_rank[rank][e.legacy] = piece
        for rank, state in enumerate(per_rank):
            rank_dir = it_dir / f"mp_rank_{rank:02d}"
            rank_dir.mkdir()
            torch.save({**common, "model": state}, rank_dir / "model_optim_rng.pt")
    else:
        _write_dist(it_dir, iteration, entries, m, megatron_tensor, common, dtype)
    io.atomic_write_text(tmp / io.LATEST_FILE, f"{iteration}")
    io.fsync_dir(it_dir)
    io.fsync_dir(tmp)
    if out.exists():
        out.rmdir()
    os.replace(tmp, out)
    console(
        f"exported {len(entries)} tensors ({nbytes / 1e9:.3f} GB) of {ckpt} (iteration {iteration}) as Megatron {fmt} "
        f"into {out} in {time.perf_counter() - start:.1f}s; load it in Megatron with --no-load-optim --no-load-rng"
    )
    return out


def _tp_problems(m: ModelConfig, tp: int) -> str:
    sizes = {"the query groups": m.kv_heads, "the MLP width": m.ffn_size, "the vocabulary": m.vocab_size}
    return ", ".join(f"{what} ({n})" for what, n in sizes.items() if n % tp)


def _write_dist(it_dir: Path, iteration: int, entries: list[Entry], m: ModelConfig, read, common: dict, dtype) -> None:
    """torch_dist: layers stacked per key in one chunk per layer (as Megatron writes them), each layer built when
    DCP writes it, so one layer is in memory; plus the common state and the `_extra_state` objects."""
    import torch.distributed.checkpoint as dcp

    from tricorn.checkpoint.interop.convert import LazySavePlanner
    from tricorn.checkpoint.pieces import Piece, owned_tensor

    class LayerPlanner(LazySavePlanner):
        def resolve_data(self, write_item):
            offset = write_item.index.offset
            return self.build(write_item.index.fqn, offset[0] if offset is not None else None)

    by_key: dict[str, list[Entry]] = {}
    for e in entries:
        by_key.setdefault(e.dist, []).append(e)
    objects = {COMMON_KEY: [common]}  # megatron-core 0.19 wraps each saved object in a one-element list
    # Each linear layer's `_extra_state` (None without Transformer Engine's FP8 state): Megatron's loader asks for them.
    for key in (k for k in by_key if by_key[k][0].layer is not None and k.endswith(".weight") and "layer_norm" not in k):
        for i in range(m.num_layers):
            objects[f"{key.removesuffix('.weight')}._extra_state/shard_{i}_{m.num_layers}"] = [None]
    blobs = {}
    for key, obj in objects.items():
        blobs[key] = pyio.BytesIO()
        torch.save(obj, blobs[key])

    def build(key: str, layer: Optional[int]):
        if key in blobs:
            return pyio.BytesIO(blobs[key].getvalue())
        group = by_key[key]
        return read(group[0]) if group[0].layer is None else read(group[layer]).unsqueeze(0)

    state: dict[str, Any] = {key: pyio.BytesIO() for key in blobs}
    with local_group(), quiet_no_dist(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # ShardedTensor's deprecation
        for key, group in by_key.items():
            shape = tricorn_shape(group[0], m)
            if group[0].layer is None:
                state[key] = torch.empty(shape, dtype=dtype, device="meta")
                continue
            n = int(torch.Size(shape).numel())
            pieces = [Piece(i * n, (i + 1) * n, (i,) + (0,) * len(shape), (1, *shape)) for i in range(len(group))]
            state[key] = owned_tensor(torch.empty(len(group) * n, dtype=dtype, device="meta"), (len(group), *shape), pieces)
        dcp.save(state, storage_writer=io.Writer(it_dir, iteration, 0), planner=LayerPlanner(build), no_dist=True)
    io.atomic_write_text(it_dir / "metadata.json", json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))


def export_main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tricorn export-megatron", description="tricorn checkpoint (any layout) -> Megatron-LM checkpoint (model)."
    )
    parser.add_argument("ckpt", type=Path, help="A --save directory (its latest checkpoint) or an iter_N directory.")
    parser.add_argument("out", type=Path, help="New Megatron checkpoint directory.")
    parser.add_argument("--format", choices=["torch_dist", "torch"], default="torch_dist", help="Megatron --ckpt-format.")
    parser.add_argument("--ckpt-step", type=int, help="Export iteration N instead of the latest.")
    parser.add_argument(
        "--tensor-model-parallel-size", type=int, default=1, help="--format torch: TP ranks to write (Megatron loads at that TP)."
    )
    args = parser.parse_args(argv)
    return run_command(export_megatron, args.ckpt, args.out, args.format, args.ckpt_step, args.tensor_model_parallel_size)
