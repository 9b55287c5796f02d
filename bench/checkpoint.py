"""Benchmark: checkpoint save peak memory and throughput beside a raw file write of the same bytes, and the stall.

One process (world of one, gloo, CPU) builds the real trainer (model, optimizer with Adam state, mock
data), takes a few steps, then

0. measures the peak memory a synchronous save allocates beyond the rank's state (torch's CPU allocator,
   through the profiler) against the largest DP bucket - a streaming save stays under one bucket;
1. saves synchronously `--saves` times (DCP files, fsync'ed, atomic rename, `latest`) and, after each,
   writes the very bytes that save produced as one sequential file in the same directory (fsync'ed):
   bytes/s of both and their ratio (median over the rounds);
   and the cost of the per-file XXH3-64 checksums (hashed by the writer as the bytes go by): each round
   also saves once with the hashing file system swapped for DCP's plain one, and the extra time of
   the checksummed save is reported as a fraction of the plain save (median over the rounds);
2. measures how long training stops for a save: a synchronous save blocks for the whole write; with
   --async-save the trainer only stops for the CPU copy, and the write on a background thread slows the
   iterations that run meanwhile (counted against the median iteration without saves).

Not a test: CI never times anything. The directory (default: ./bench_checkpoint_tmp, i.e. the disk you
run from; pass --dir for another disk) is deleted afterwards.

    .venv/bin/python bench/checkpoint.py [--hidden 384] [--layers 6] [--vocab 8000] [--saves 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def raw_write(src: Path, dst: Path) -> tuple[int, float]:
    """Write the bytes of every file under `src` into one file `dst` (sequential, fsync'ed): (bytes, seconds)."""
    blobs = [p.read_bytes() for p in sorted(src.rglob("*")) if p.is_file()]
    start = time.perf_counter()
    with open(dst, "wb") as fh:
        for blob in blobs:
            fh.write(blob)
        fh.flush()
        os.fsync(fh.fileno())
    seconds = time.perf_counter() - start
    dst.unlink()
    return sum(len(b) for b in blobs), seconds


def plain_save_seconds(trainer, ckpt) -> float:
    """One sync save without the writer's checksums (DCP's plain file system); the small files are still hashed."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    from tricorn.checkpoint import dcp_files

    class Plain(FileSystem):
        checksums: dict = {}

    hashing, dcp_files.HashingFileSystem = dcp_files.HashingFileSystem, Plain
    try:
        start = time.perf_counter()
        ckpt.save(trainer)
        return time.perf_counter() - start
    finally:
        dcp_files.HashingFileSystem = hashing


def build_trainer(args: argparse.Namespace, root: Path):
    from tricorn.checkpoint.checkpointer import Checkpointer
    from tricorn.config_args import config_from_args
    from tricorn.parallel.state import init_parallel
    from tricorn.training.logging import MetricsLogger
    from tricorn.training.main import build_trainer
    from tricorn.validation import validate

    flags = (
        f"--device cpu --mock-data --num-layers {args.layers} --hidden-size {args.hidden} --num-attention-heads 8 "
        f"--seq-length {args.seq} --max-position-embeddings {args.seq} --micro-batch-size 1 --global-batch-size 1 "
        f"--vocab-size {args.vocab} --train-iters 100000 --lr 1e-4 --log-interval 100000 --swiglu --save {root}"
    ).split()
    cfg = config_from_args(flags, world_size=1)
    errors = validate(cfg)
    assert not errors, errors
    state = init_parallel(cfg)
    trainer = build_trainer(cfg, state, MetricsLogger(cfg, state.rank, state.device), with_validation=False)
    return cfg, trainer, Checkpointer(cfg, state, console=lambda line: None)


def timed_iteration(trainer) -> float:
    start = time.perf_counter()
    trainer.run_iteration()
    return time.perf_counter() - start


def peak_extra(trainer, ckpt) -> None:
    """The save's peak CPU allocations beyond the state (profiler), against the largest DP bucket."""
    from tricorn.training.measurements import cpu_peak_bytes

    trainer.run_iteration()
    _, peak = cpu_peak_bytes(lambda: ckpt.save(trainer))
    bucket = max(b.numel for dp in trainer.optimizer.data_parallel for b in dp.buckets) * 4
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for ts in trainer.optimizer.memory_tensors().values()
        for t in ts
    }
    state = sum(storages.values())  # each storage once (parameters and their bucket share one)
    print(
        f"save peak extra        {peak / 2**20:10.2f} MiB  ({peak / bucket:.3f} x the largest bucket of "
        f"{bucket / 2**20:.1f} MiB; the rank's state is {state / 2**20:.1f} MiB)"
    )


def throughput(trainer, ckpt, root: Path, saves: int) -> None:
    from tricorn.checkpoint.io import iter_name

    ckpt_rates, raw_rates, hash_shares = [], [], []
    for _ in range(saves):
        trainer.run_iteration()
        start = time.perf_counter()
        ckpt.save(trainer)
        seconds = time.perf_counter() - start
        path = root / iter_name(trainer.iteration)
        size = dir_bytes(path)
        raw_size, raw_seconds = raw_write(path, root / "raw_write.bin")
        assert raw_size == size
        ckpt_rates.append(size / seconds)
        trainer.run_iteration()
        plain = plain_save_seconds(trainer, ckpt)
        hash_shares.append((seconds - plain) / plain)
        raw_rates.append(raw_size / raw_seconds)
    c, r = statistics.median(ckpt_rates), statistics.median(raw_rates)
    print(f"checkpoint size        {size / 2**20:10.1f} MiB (model + Adam moments, DCP files + JSON/YAML)")
    print(f"sync save throughput   {c / 2**20:10.1f} MiB/s  (whole save: tensors, fsync, rename, latest)")
    print(f"raw sequential write   {r / 2**20:10.1f} MiB/s  (same bytes, one file, fsync)")
    print(f"save / raw             {c / r:10.2f}")
    print(
        f"checksum cost          {100 * statistics.median(hash_shares):10.1f} %  of a sync save without them "
        "(XXH3-64 as the bytes are written; off the training thread with --async-save)"
    )


def stall(cfg, trainer, ckpt, saves: int) -> None:
    baseline = statistics.median(timed_iteration(trainer) for _ in range(5))
    sync_stalls = []
    for _ in range(saves):
        trainer.run_iteration()
        start = time.perf_counter()
        ckpt.save(trainer)
        sync_stalls.append(time.perf_counter() - start)
    cfg.checkpoint.async_save = True
    staging, slowdown, overlapped = [], [], []
    for _ in range(saves):
        trainer.run_iteration()
        start = time.perf_counter()
        ckpt.save(trainer)
        staging.append(time.perf_counter() - start)
        extra, iterations = 0.0, 0
        while ckpt.pending is not None and not ckpt.pending.done():
            extra += timed_iteration(trainer) - baseline
            iterations += 1
        start = time.perf_counter()
        ckpt.wait()
        slowdown.append(extra + time.perf_counter() - start)
        overlapped.append(iterations)
    cfg.checkpoint.async_save = False
    print(f"iteration (no save)    {1000 * baseline:10.1f} ms")
    print(f"sync save stall        {1000 * statistics.median(sync_stalls):10.1f} ms")
    print(f"async save stall       {1000 * statistics.median(staging):10.1f} ms  (CPU copy; training then continues)")
    print(
        f"async write overhead   {1000 * statistics.median(slowdown):10.1f} ms  (extra time of the "
        f"{statistics.median(overlapped):g} iterations that ran during the background write)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("bench_checkpoint_tmp"))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = args.dir.resolve() / f"run-{os.getpid()}"
    try:
        cfg, trainer, ckpt = build_trainer(args, root)
        params = sum(p.numel() for c in trainer.chunks for p in c.parameters())
        print(f"model: {params / 1e6:.1f}M parameters (fp32), 1 process, directory {root}")
        for _ in range(2):  # Adam state exists, first-call costs paid
            trainer.run_iteration()
        ckpt.save(trainer)
        peak_extra(trainer, ckpt)
        throughput(trainer, ckpt, root, args.saves)
        stall(cfg, trainer, ckpt, args.saves)
        ckpt.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if args.dir.is_dir() and not any(args.dir.iterdir()):
            args.dir.rmdir()


if __name__ == "__main__":
    main()
