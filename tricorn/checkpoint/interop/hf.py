"""Hugging Face Llama <-> tricorn checkpoints: `tricorn import-hf` and `tricorn export-hf`.

import-hf reads a LlamaForCausalLM directory (config.json plus one or many
*.safetensors files; Llama 2, 3 and 3.1 with rope_scaling "llama3", tied or
untied, any float dtype) and writes a weights-only tricorn checkpoint,
`SAVE/iter_0000000`, with every tensor under its global name and shape, so it
loads at any TP/PP/DP layout through `--load`. Training from it starts at
iteration 0 with fresh optimizer state (Megatron's "release" checkpoints).
export-hf reads a checkpoint of any layout and writes safetensors shards with
their index, config.json and the tokenizer files (hf_tokenizer_files.py: import-hf keeps them
in SAVE/tokenizer/ and its printed command reads them).

The mapping of configs and tensors (exact, so a round trip is bit-exact) is
in hf_mapping.py.

Memory: both directions stream, one tensor at a time. The import writes through
DCP with a planner that builds each tricorn tensor when the writer asks for it;
the export reads one tensor from DCP at a time and holds at most one output
shard (--max-shard-size) plus that tensor. No process group, no collectives.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from tricorn.checkpoint import io
from tricorn.checkpoint.interop.convert import (  # noqa: F401 - read_model_config, fsync_file: re-exported for tests and bench
    DTYPES,
    check_new_save,
    find_checkpoint_dir,
    fsync_file,
    import_meta,
    read_model_config,
    read_one,
    run_command,
    write_checkpoint,
)
from tricorn.checkpoint.interop.hf_mapping import (
    ConvertError,
    Mapped,
    expected_shape,
    fuse,
    fused_shape,
    hf_config_from_model,
    model_config_from_hf,
    model_flags,
    split,
    tensor_map,
)
from tricorn.checkpoint.interop.hf_tokenizer_files import export_tokenizer_files, keep_tokenizer, tokenizer_flags
from tricorn.config import Config, DataConfig, ModelConfig, dump_yaml

_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
INDEX_FILE = "model.safetensors.index.json"


# ---------------------------------------------------------------- import


def read_hf_config(hf_dir: Path) -> dict:
    path = hf_dir / "config.json"
    if not hf_dir.is_dir():
        raise ConvertError(f"--input {hf_dir} is not a directory; pass a Hugging Face model directory")
    if not path.is_file():
        raise ConvertError(f"{path} is missing; --input must be a Hugging Face model directory with config.json")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ConvertError(f"{path} is not valid JSON ({e})") from None


@contextlib.contextmanager
def open_safetensors(hf_dir: Path) -> Iterator[dict[str, Any]]:
    """Hugging Face tensor name -> the open safetensors file holding it (headers only are read here)."""
    from safetensors import safe_open

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"no *.safetensors files in {hf_dir}; import-hf reads safetensors checkpoints only")
    with contextlib.ExitStack() as stack:
        where: dict[str, Any] = {}
        for path in files:
            try:
                handle = stack.enter_context(safe_open(str(path), framework="pt"))
            except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError for damaged headers
                raise ConvertError(f"{path} cannot be read as safetensors ({e})") from None
            where.update({k: handle for k in handle.keys()})
        yield where


def _check_tensors(where: dict[str, Any], plan: list[Mapped], m: ModelConfig, hf_dir: Path) -> dict[str, torch.dtype]:
    """Every expected tensor is present with its shape and a float dtype; returns each tricorn tensor's dtype."""
    wanted = {p for mapped in plan for p in mapped.parts}
    dtypes: dict[str, torch.dtype] = {}
    for mapped in plan:
        kinds = set()
        for part in mapped.parts:
            if part not in where:
                raise ConvertError(f"{hf_dir}: tensor {part!r} is missing from the safetensors files (config.json expects it)")
            info = where[part].get_slice(part)
            shape, dtype = tuple(info.get_shape()), info.get_dtype()
            if shape != expected_shape(part, m):
                raise ConvertError(f"{hf_dir}: tensor {part!r} has shape {shape}, config.json implies {expected_shape(part, m)}")
            if dtype not in _SAFETENSORS_DTYPES:
                raise ConvertError(f"{hf_dir}: tensor {part!r} has dtype {dtype}; import-hf reads F32, BF16 and F16")
            kinds.add(dtype)
        if len(kinds) > 1:
            raise ConvertError(f"{hf_dir}: tensors {', '.join(mapped.parts)} have different dtypes {sorted(kinds)}")
        dtypes[mapped.name] = _SAFETENSORS_DTYPES[kinds.pop()]
    ignorable = ("rotary_emb.inv_freq",) + (() if m.untie_embeddings_and_output_weights else ("lm_head.weight",))
    extra = sorted(k for k in where if k not in wanted and not k.endswith(ignorable))
    if extra:
        raise ConvertError(f"{hf_dir}: unexpected tensor {extra[0]!r} ({len(extra)} in all); config.json does not describe it")
    return dtypes


def import_hf(hf_dir: Path, save: Path, console=print) -> Path:
    """Write HF_DIR's Llama as SAVE/iter_0000000 (weights only); returns the checkpoint directory."""
    hf_dir, save = Path(hf_dir), Path(save)
    m = model_config_from_hf(read_hf_config(hf_dir), str(hf_dir / "config.json"))
    check_new_save(save)
    tokenizer = keep_tokenizer(hf_dir, save, m.vocab_size, console)  # SAVE/tokenizer/, and the flags that read it
    data = (
        DataConfig(tokenizer_type=tokenizer[0], tokenizer_model=str(Path(tokenizer[1]).resolve())) if tokenizer else DataConfig()
    )
    plan = tensor_map(m)
    start = time.perf_counter()
    with open_safetensors(hf_dir) as where:
        dtypes = _check_tensors(where, plan, m, hf_dir)
        by_key = {f"model.{mp.name}": mp for mp in plan}

        def build(key: str) -> torch.Tensor:
            mp = by_key[key]
            return fuse(mp.kind, [where[p].get_tensor(p) for p in mp.parts], m)

        # Meta tensors describe names, shapes and dtypes for DCP's plan; the data comes from build().
        state = {k: torch.empty(fused_shape(mp, m), dtype=dtypes[mp.name], device="meta") for k, mp in by_key.items()}
        params_dtype = {v: k for k, v in DTYPES.items()}[dtypes["tok_embeddings.weight"]]
        meta = import_meta(0, params_dtype, f"huggingface:{hf_dir.resolve()}")
        final = write_checkpoint(save, state, build, meta, dump_yaml(Config(model=m, data=data)))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    seconds = time.perf_counter() - start
    console(f"imported {len(state)} tensors ({nbytes / 1e9:.2f} GB, {params_dtype}) from {hf_dir} into {final} in {seconds:.1f}s")
    flags = model_flags(m) + tokenizer_flags(tokenizer)
    console(f"train from it with: --load {save} {' '.join(flags)} (and --seq-length up to {m.max_positions})")
    return final


# ---------------------------------------------------------------- export


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a byte count."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    upper = text.strip().upper()
    for unit, scale in units.items():
        if upper.endswith(unit) and upper[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(upper[: -len(unit)]) * scale)
    if upper.isdigit():
        return int(upper)
    raise ConvertError(f"--max-shard-size {text!r} is not a size; write e.g. 5GB, 500MB or a byte count")


@dataclass
class _Source:
    mapped: Mapped
    key: str  # the checkpoint tensor read
    shape: tuple[int, ...]
    dtype: torch.dtype  # as stored

    def out_bytes(self, dtype: torch.dtype) -> int:
        return int(torch.Size(self.shape).numel()) * dtype.itemsize


def _sources(ckpt: Path, md, m: ModelConfig, dtype: Optional[torch.dtype]) -> tuple[list[_Source], torch.dtype]:
    """What to read for each tensor, and the export dtype (default: the parameters' dtype)."""
    entries = md.state_dict_metadata
    out: list[_Source] = []
    for mp in tensor_map(m):
        key = f"model.{mp.name}"
        entry = entries.get(key)
        if entry is None or not hasattr(entry, "size"):
            raise io.CheckpointError(f"checkpoint {ckpt} lacks tensor {key!r}; its config.yaml describes another model")
        if tuple(entry.size) != fused_shape(mp, m):
            raise io.CheckpointError(
                f"checkpoint tensor {key!r} has shape {tuple(entry.size)}, config.yaml implies {fused_shape(mp, m)}"
            )
        master = entries.get(f"optim.{mp.name}.master")
        # fp32 export of a mixed-precision run: the exact fp32 master weights, not the rounded parameters.
        if dtype == torch.float32 and master is not None:
            key, entry = f"optim.{mp.name}.master", master
        out.append(_Source(mp, key, tuple(entry.size), entry.properties.dtype))
    param_dtype = entries[f"model.{out[0].mapped.name}"].properties.dtype
    return out, dtype or param_dtype


def _shard(sources: list[_Source], dtype: torch.dtype, max_bytes: int) -> list[list[_Source]]:
    """Consecutive tensors into shards of at most max_bytes (a bigger single tensor gets a shard of its own)."""
    shards: list[list[_Source]] = [[]]
    size = 0
    for src in sources:
        nbytes = src.out_bytes(dtype)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(src)
        size += nbytes
    return shards


def _special_token_ids(files: list[Path]) -> dict:
    """bos/eos/pad ids for config.json from a generation_config.json among the tokenizer files."""
    gen = next((f for f in files if f.name == "generation_config.json"), None)
    if gen is None:
        return {}
    try:
        data = json.loads(gen.read_text())
    except ValueError as e:
        raise ConvertError(f"{gen} is not valid JSON ({e})") from None
    return {k: data[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in data}


def export_hf(
    load: Path,
    output: Path,
    ckpt_step: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
    tokenizer: Optional[Path] = None,
    max_shard_bytes: int = 5 * 10**9,
    console=print,
) -> Path:
    """Write checkpoint `load` (any layout) as a LlamaForCausalLM directory `output`, streaming one tensor at a time."""
    from safetensors.torch import save_file

    load, output = Path(load), Path(output)
    ckpt = find_checkpoint_dir(load, ckpt_step)
    meta = io.read_meta(ckpt)
    m = read_model_config(ckpt)
    if m.num_experts is not None:
        raise ConvertError(
            f"{ckpt} is a mixture-of-experts model (--num-experts {m.num_experts}); export-hf writes dense Llama only"
        )
    md = io.read_dcp_metadata(ckpt)
    io.check_files(ckpt, md)
    sources, out_dtype = _sources(ckpt, md, m, dtype)
    token_files = export_tokenizer_files(load, ckpt, Path(tokenizer) if tokenizer else None)
    config = hf_config_from_model(m, out_dtype, _special_token_ids(token_files))
    if output.exists() and any(output.iterdir()):
        raise ConvertError(f"--output {output} exists and is not empty; remove it or pick a new directory")
    start = time.perf_counter()
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards = _shard(sources, out_dtype, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for src in shard:  # one checkpoint tensor in memory besides the shard being assembled
            parts = split(src.mapped.kind, read_one(ckpt, src.key, src.shape, src.dtype).to(out_dtype), m)
            tensors.update(zip(src.mapped.parts, parts))
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        fsync_file(tmp / name)  # durable before the directory is renamed into place, like a checkpoint
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    io.atomic_write_text(tmp / INDEX_FILE, json.dumps(index, indent=2))
    io.atomic_write_text(tmp / "config.json", json.dumps(config, indent=2))
    for f in token_files:
        shutil.copyfile(f, tmp / f.name)
    io.fsync_dir(tmp)
    if output.exists():
        output.rmdir()
    os.replace(tmp, output)
    seconds = time.perf_counter() - start
    console(
        f"exported {len(weight_map)} tensors ({total / 1e9:.2f} GB, {config['torch_dtype']}) of {ckpt} "
        f"(iteration {meta['iteration']}) to {output} in {len(shards)} shard(s), {seconds:.1f}s"
    )
    return output


# ---------------------------------------------------------------- command line


def import_main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tricorn import-hf", description="Hugging Face LlamaForCausalLM (safetensors) -> tricorn checkpoint."
    )
    parser.add_argument("--input", required=True, type=Path, help="Hugging Face model directory (config.json, *.safetensors).")
    parser.add_argument("--save", required=True, type=Path, help="New checkpoint directory; train with --load on it.")
    args = parser.parse_args(argv)
    return run_command(import_hf, args.input, args.save)


def export_main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tricorn export-hf", description="tricorn checkpoint (any layout) -> Hugging Face LlamaForCausalLM (safetensors)."
    )
    parser.add_argument(
        "--load", required=True, type=Path, help="A --save directory (its latest checkpoint) or an iter_N directory."
    )
    parser.add_argument("--output", required=True, type=Path, help="New Hugging Face model directory.")
    parser.add_argument("--ckpt-step", type=int, help="Export iteration N instead of the latest.")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), help="Tensor dtype (default: the parameters'; fp32 uses master weights)."
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="Directory of Hugging Face tokenizer files (or one file) to copy (default: the checkpoint's).",
    )
    parser.add_argument("--max-shard-size", default="5GB", help="Largest safetensors shard (default 5GB, like save_pretrained).")
    args = parser.parse_args(argv)
    try:
        max_bytes = parse_size(args.max_shard_size)
    except ConvertError as e:
        print(f"tricorn: error: {e}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype] if args.dtype else None
    return run_command(export_hf, args.load, args.output, args.ckpt_step, dtype, args.tokenizer, max_bytes)
