"""What the single-process step-cost benchmarks share (bench/timers.py, bench/spikes_stragglers.py): their
flags, and one Trainer of a small Llama-shaped model on mock data, built as pretrain_gpt.py builds it."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tricorn.config_args import config_from_args  # noqa: E402
from tricorn.parallel.state import init_parallel  # noqa: E402
from tricorn.training.logging import MetricsLogger  # noqa: E402
from tricorn.training.main import build_trainer  # noqa: E402


def parser(description: str, rounds: int, block: int) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--block", type=int, default=block, help="iterations per setting per round")
    return ap


def tiny_trainer(args: argparse.Namespace, settings: int, port: int):
    """(state, trainer) of one process, with iterations for a warm-up, `settings` x rounds x block, and one more."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        os.environ.setdefault(key, value)
    total = 1 + settings * args.rounds * args.block + 1
    argv = (
        f"--device cpu --mock-data --num-layers {args.layers} --hidden-size {args.hidden} --num-attention-heads 8 "
        f"--seq-length {args.seq} --micro-batch-size 4 --global-batch-size 8 --train-iters {total} "
        f"--vocab-size 8000 --swiglu --disable-bias-linear --lr 1e-4"
    ).split()
    cfg = config_from_args(argv, world_size=1)
    state = init_parallel(cfg)
    return state, build_trainer(cfg, state, MetricsLogger(cfg, rank=1), with_validation=False)  # logger writes nothing
