"""Benchmark: `tricorn import-hf` / `export-hf` throughput beside a plain safetensors save and load.

One process writes a random model of `--family` (default Qwen3: per-head q/k norms and head dim 128, its
attention 2x the hidden size; Qwen2 adds QKV biases; Llama none of these) as a Hugging Face directory
(config.json + one safetensors file), then, for `--rounds` rounds, times

- plain:  safetensors `save_file` of the same tensors (fsync'ed), then `load_file` of it into memory;
- import: HF directory -> tricorn checkpoint (safetensors read, QKV/gate-up fusing, DCP write, fsync'ed);
- export: tricorn checkpoint -> HF directory (DCP read one tensor at a time, splitting, safetensors shards, fsync'ed).

It prints GB/s of each (model bytes / seconds, median over rounds) and the ratios import/plain and
export/plain, where plain is the save + load time: both conversions read every byte once and write
it once, like the plain save + load. Files are in the page cache after the first round on most
machines, so this measures the conversion's own cost more than the disk.

Not a test: CI never times anything. The directory (default ./bench_hf_tmp) is deleted afterwards.

    .venv/bin/python bench/hf_convert.py [--family qwen3|qwen2|llama] [--layers 8] [--hidden 1024] [--ffn 2816]
        [--vocab 32000] [--bf16] [--dir DIR]
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from convert_model import model_config, parser, report, timed
from safetensors.torch import load_file, save_file

from tricorn.checkpoint.interop.hf import export_hf, fsync_file, import_hf
from tricorn.checkpoint.interop.hf_mapping import export_family, hf_config_from_model, tensor_map
from tricorn.config import ModelConfig

# --family: the model features of each (head dim 128 for Qwen3, as Qwen3's releases have at any width).
FAMILIES = {
    "qwen3": dict(qk_layernorm=True, kv_channels=128),
    "qwen2": dict(add_qkv_bias=True),
    "llama": {},
}


def hf_tensors(m: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    parts = [(p, shape) for mapped in tensor_map(m, export_family(m)) for p, shape in zip(mapped.parts, mapped.shapes)]
    return {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in parts}


def plain_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save, made durable like the conversions' writes (they fsync before renaming)."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    fsync_file(path)


def plain_load(path: Path) -> dict[str, torch.Tensor]:
    """safetensors' load into memory (load_file maps the file; the copy reads every byte, as a load must)."""
    return {k: v.clone() for k, v in load_file(str(path)).items()}


def main() -> None:
    ap = parser(__doc__.splitlines()[0], "bench_hf_tmp")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--family", choices=list(FAMILIES), default="qwen3")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    m = model_config(args)
    for key, value in FAMILIES[args.family].items():
        setattr(m, key, value)
    root = args.dir
    shutil.rmtree(root, ignore_errors=True)
    (root / "hf").mkdir(parents=True)
    tensors = hf_tensors(m, dtype)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    save_file(tensors, str(root / "hf" / "model.safetensors"), metadata={"format": "pt"})
    (root / "hf" / "config.json").write_text(json.dumps(hf_config_from_model(m, dtype)))
    quiet = lambda _: None  # noqa: E731
    plain, ckpt, out = root / "plain.safetensors", root / "ckpt", root / "out"
    times: dict[str, list[float]] = {"plain save": [], "plain load": [], "import": [], "export": []}
    try:
        for _ in range(args.rounds):
            times["plain save"].append(timed(lambda: plain_save(tensors, plain)))
            times["plain load"].append(timed(lambda: plain_load(plain)))
            plain.unlink()
            times["import"].append(timed(lambda: import_hf(root / "hf", ckpt, console=quiet)))
            times["export"].append(timed(lambda: export_hf(ckpt, out, console=quiet)))
            shutil.rmtree(ckpt)
            shutil.rmtree(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    arch = export_family(m).architecture
    header = f"model: {arch}, {len(tensors)} tensors, {nbytes / 1e9:.2f} GB ({'bf16' if args.bf16 else 'fp32'}), median of {args.rounds} rounds"
    report(times, nbytes, header)


if __name__ == "__main__":
    main()
