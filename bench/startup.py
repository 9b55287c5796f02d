"""Start-up: seconds from launching a tiny run until rank 0 prints iteration 1's line, on 1 and 2 ranks.

Real processes (no fork server), as torchrun starts them: RANK/WORLD_SIZE/MASTER_* in the environment, one
thread each. Each setting runs --repeats times, interleaved; the median is reported. "as is" is pretrain_gpt.py;
"DCP imported first" imports torch.distributed.checkpoint before it, which is what every process paid when
tricorn/checkpoint/io.py imported DCP at module level: the difference is what importing it on first use saves a
run without checkpoints. The import of torch itself, and of dynamo (torch.optim's constructor imports it), are
the rest of the start-up; `python -X importtime pretrain_gpt.py ...` lists them.

    .venv/bin/python bench/startup.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = (
    "--device cpu --mock-data --vocab-size 500 --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --micro-batch-size 2 --train-iters 1 --log-interval 1 --lr 1e-3"
).split()
PRELOAD = (
    "import torch.distributed.checkpoint, runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_iteration_seconds(nproc: int, preload: bool) -> float:
    port = free_port()
    script = [str(ROOT / "pretrain_gpt.py"), *TINY, "--global-batch-size", str(2 * nproc)]
    cmd = [sys.executable, "-c", PRELOAD, *script] if preload else [sys.executable, *script]
    base = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            cmd,
            env={**base, "RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for r in range(nproc)
    ]
    seconds = float("nan")
    for line in procs[0].stdout:
        if line.startswith(" iteration        1/"):
            seconds = time.perf_counter() - start
    for p in procs:
        p.wait(timeout=300)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    results: dict[tuple[int, bool], list[float]] = {(n, pre): [] for n in (1, 2) for pre in (False, True)}
    for _ in range(args.repeats):
        for key in results:
            results[key].append(first_iteration_seconds(*key))
    print(f"seconds to iteration 1's line, median of {args.repeats} (tiny model, CPU, real processes)")
    for n in (1, 2):
        now, before = statistics.median(results[(n, False)]), statistics.median(results[(n, True)])
        print(
            f"{n} rank{'s' if n > 1 else ' '}: as is {now:.2f} s | DCP imported first {before:.2f} s | saved {before - now:+.2f} s"
        )


if __name__ == "__main__":
    main()
