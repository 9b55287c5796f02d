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

import os
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from convert_model import model_config, parser, report, timed

from tricorn.checkpoint import io
from tricorn.checkpoint.interop.convert import import_meta, quiet_no_dist, write_checkpoint
from tricorn.checkpoint.interop.megatron import import_megatron
from tricorn.checkpoint.interop.megatron_export import export_megatron
from tricorn.checkpoint.interop.megatron_mapping import tensor_map, tricorn_shape
from tricorn.config import Config, dump_yaml


def plain_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    path.mkdir()
    with quiet_no_dist():
        dcp.save(tensors, storage_writer=io.Writer(path, 0, 0), no_dist=True)


def plain_load(tensors: dict[str, torch.Tensor], path: Path) -> None:
    io.dcp_load({k: torch.empty_like(v) for k, v in tensors.items()}, path, no_dist=True)


def main() -> None:
    ap = parser(__doc__.splitlines()[0], "bench_megatron_tmp")
    ap.add_argument("--format", choices=["torch_dist", "torch"], default="torch_dist")
    args = ap.parse_args()
    m = model_config(args)
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
    header = f"model: {len(tensors)} tensors, {nbytes / 1e9:.2f} GB fp32, Megatron {args.format}, median of {args.rounds} rounds"
    report(times, nbytes, header)
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (shared machine)")


if __name__ == "__main__":
    main()
