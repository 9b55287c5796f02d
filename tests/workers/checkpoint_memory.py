"""Worker: the peak memory a checkpoint save holds beyond the rank's own state, at DP = WORLD_SIZE.

For ZeRO-1 (the distributed optimizer) and ZeRO-3, fp32 and bf16: one training iteration, then a
synchronous save whose CPU allocations are followed by the profiler (measurements.cpu_peak_bytes). The
save writes each rank's owned pieces from its live buffers, so the only extra is DCP's staging copy of one
piece at a time: at most 1.1 x the largest bucket (in fp32 bytes). The same run then saves its parameter
norm (streamed over the owned ranges) and checks it against the gathered parameters.
Every rank asserts; rank 0 prints "ok".
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from harness import BASE_FLAGS, with_flag  # noqa: E402

from tricorn.checkpoint.checkpointer import Checkpointer  # noqa: E402
from tricorn.parallel.grads import counts_for_norm  # noqa: E402
from tricorn.parallel.state import init_parallel  # noqa: E402
from tricorn.training.logging import MetricsLogger  # noqa: E402
from tricorn.training.main import build_trainer, resolve_config  # noqa: E402
from tricorn.training.measurements import cpu_peak_bytes, params_norm  # noqa: E402

STATE = None


def check(extra: list[str], root: str) -> None:
    global STATE
    # Hidden 128, not the harness's 64: the save's collectives (DCP gathers every rank's plan, a few tens of KB
    # whatever the model) are measured too, and on gloo's threads at a time the profiler orders against the
    # main thread's frees as it happens to; at hidden 64 that noise alone is a third of the largest bucket.
    flags = with_flag(with_flag(with_flag(BASE_FLAGS, "--num-layers", "4"), "--micro-batch-size", "1"), "--hidden-size", "128")
    cfg = resolve_config(flags + ["--ddp-bucket-size", "200000", "--save", root] + extra)
    STATE = STATE or init_parallel(cfg)
    trainer = build_trainer(cfg, STATE, MetricsLogger(cfg, rank=1), with_validation=False)
    trainer.run_iteration()
    ckpt = Checkpointer(cfg, STATE, console=lambda line: None)
    _, peak = cpu_peak_bytes(lambda: ckpt.save(trainer))
    buckets = [b for dp in trainer.optimizer.data_parallel for b in dp.buckets]
    largest = max(b.numel for b in buckets) * 4
    where = f"{extra} rank {STATE.rank}"
    assert peak <= 1.1 * largest, f"{where}: the save held {peak} bytes beyond the state; largest bucket {largest}"
    streamed = params_norm(trainer.chunks, STATE, trainer.optimizer)
    with trainer.optimizer.gathered_params():
        squares = sum(
            float(p.detach().double().pow(2).sum()) for p in trainer.chunks[0].parameters() if counts_for_norm(p, STATE)
        )
    # fp32 sums of squares in another order: relative 1e-5 covers the rounding of ~1e5 terms
    assert abs(streamed - squares**0.5) <= 1e-5 * squares**0.5, f"{where}: params norm {streamed} vs {squares**0.5}"
    trainer.optimizer.close()
    if STATE.rank == 0:
        print(f"save peak {extra}: {peak} bytes beyond the state, largest bucket {largest}")


if __name__ == "__main__":
    cases = (["--use-distributed-optimizer"], ["--zero-stage", "3"], ["--zero-stage", "3", "--bf16"], ["--bf16"])
    with tempfile.TemporaryDirectory() as tmp:
        for i, extra in enumerate(cases):
            check(extra, os.path.join(tmp, str(i)))  # rank 0 creates the directories; the others only write into them
    dist.barrier()
    dist.destroy_process_group()
    if STATE.rank == 0:
        print("ok")
