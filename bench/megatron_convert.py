"""Benchmark: `tricorn import-megatron` / `export-megatron` throughput beside a plain DCP save and load.

One process writes a random Llama-shaped tricorn checkpoint (weights only), then, for `--rounds`
rounds, times

- plain:  DCP save of the same tensors (one file, fsync'ed), then a DCP load of them into memory;
- export: tricorn checkpoint -> Megatron torch_dist (one tensor read at a time, layers stacked, fsync'ed);
- import: that Megatron checkpoint -> tricorn checkpoint (one layer of a stacked tensor read at a time,
  gate/up interleaved, DCP write, fsync'ed).

It prints GB/s of each (model bytes / seconds, median over rounds), the ratios import/plain and
export/plain (plain = save + load: each conversion reads every byte once and writes it once), and
the load average, since the box is shared. Not a test. The directory (default ./bench_megatron_tmp)
is deleted afterwards.

    .venv/bin/python bench/megatron_convert.py [--layers 8] [--hidden 1024] [--ffn 2816] [--vocab 32000] [--format torch_dist]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from tricorn.checkpoint import io
from tricorn.checkpoint.interop.convert import import_meta, quiet_no_dist, write_checkpoint
from tricorn.checkpoint.interop.megatron import import_megatron
from tricorn.checkpoint.interop.megatron_export import export_megatron
from tricorn.checkpoint.interop.megatron_mapping import tensor_map, tricorn_shape
from tricorn.config import Config, ModelConfig, dump_yaml


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def plain_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    path.mkdir()
    with quiet_no_dist():
        dcp.save(tensors, storage_writer=io.Writer(path, 0, 0), no_dist=True)


def plain_load(tensors: dict[str, torch.Tensor], path: Path) -> None:
    io.dcp_load({k: torch.empty_like(v) for k, v in tensors.items()}, path, no_dist=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--format", choices=["torch_dist", "torch"], default="torch_dist")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("bench_megatron_tmp"))
    args = ap.parse_args()
    m = ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads,
        num_query_groups=args.kv_heads,
        group_query_attention=args.kv_heads != args.heads,
        swiglu=True,
        disable_bias_linear=True,
        untie_embeddings_and_output_weights=True,
        vocab_size=args.vocab,
    )
    gen = torch.Generator().manual_seed(0)
    tensors = {f"model.{e.name}": torch.randn(tricorn_shape(e, m), generator=gen) for e in tensor_map(m)}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    root = args.dir
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    quiet = lambda _: None  # noqa: E731
    source = write_checkpoint(
        root / "src", tensors, tensors.__getitem__, import_meta(0, "fp32", "bench"), dump_yaml(Config(model=m))
    )
    plain, exported, back = root / "plain", root / "megatron", root / "back"
    times: dict[str, list[float]] = {"plain save": [], "plain load": [], "export": [], "import": []}
    try:
        for _ in range(args.rounds):
            times["plain save"].append(timed(lambda: plain_save(tensors, plain)))
            times["plain load"].append(timed(lambda: plain_load(tensors, plain)))
            shutil.rmtree(plain)
            times["export"].append(timed(lambda: export_megatron(source, exported, args.format, console=quiet)))
            times["import"].append(timed(lambda: import_megatron(exported, back, load_optim=False, console=quiet)))
            shutil.rmtree(exported)
            shutil.rmtree(back)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"model: {len(tensors)} tensors, {nbytes / 1e9:.2f} GB fp32, Megatron {args.format}, median of {args.rounds} rounds")
    for k, s in median.items():
        print(f"  {k:<11} {nbytes / s / 1e9:7.2f} GB/s  ({s:.2f} s)")
    plain_copy = median["plain save"] + median["plain load"]
    print(f"  plain save+load {nbytes / plain_copy / 1e9:.2f} GB/s")
    for k in ("import", "export"):
        print(f"ratio {k} / plain save+load throughput: {plain_copy / median[k]:.2f}")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (shared machine)")


if __name__ == "__main__":
    main()
