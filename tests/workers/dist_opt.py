"""Worker: the optimizer inside a real trainer on WORLD_SIZE gloo ranks (DP = WORLD_SIZE).

Modes (argv[1]):
  skip   fp16 with an inf injected into rank 1's gradient at iteration 2 (the optimizer's
         test hook): every rank skips that step, the loss scale backs off (hysteresis 1),
         and parameters, master weights and Adam state stay bit-identical; iteration 3 steps.
         Checked for DDP, the distributed optimizer and ZeRO-3.
  trace  the bucket event trace: with --overlap-grad-reduce the first reduction starts
         before the last gradient of the last microbatch; without, only after it; never
         during earlier microbatches (except ZeRO-2, which reduces every microbatch).
Every rank asserts; rank 0 prints "ok".
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from harness import BASE_FLAGS, with_flag  # noqa: E402

from tricorn.parallel.optimizer import INJECT_INF_AT_ITER, INJECT_INF_RANK  # noqa: E402
from tricorn.parallel.state import init_parallel  # noqa: E402
from tricorn.training.logging import MetricsLogger  # noqa: E402
from tricorn.training.loop import Trainer  # noqa: E402
from tricorn.training.main import build, build_loaders, resolve_config  # noqa: E402

STATE = None


def make_trainer(argv: list[str]) -> Trainer:
    global STATE
    cfg = resolve_config(argv)
    if STATE is None:
        STATE = init_parallel(cfg)
    chunks, optimizer, forward_backward, _ = build(cfg, STATE)
    train_loader, _ = build_loaders(cfg, STATE)
    return Trainer(
        cfg=cfg,
        state=STATE,
        chunks=chunks,
        optimizer=optimizer,
        train_loader=train_loader,
        valid_loader=None,
        logger=MetricsLogger(cfg, rank=1),  # silent
        forward_backward=forward_backward,
    )


def snapshot(trainer: Trainer) -> list[torch.Tensor]:
    opt = trainer.optimizer
    with opt.gathered_params():  # ZeRO-3 parameters are only resident inside forward/backward
        tensors = [p.detach().clone() for c in trainer.chunks for p in c.parameters()]
    tensors += [b.param_shard.clone() for dp in opt.data_parallel for b in dp.buckets if b.param_shard is not None]
    for s in opt.shards:
        tensors += [s.master.clone(), s.exp_avg.clone(), s.exp_avg_sq.clone()]
        tensors += [step.clone() for step in s._steps()]
    return tensors


def bit_identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def check_skip(extra: list[str]) -> None:
    os.environ[INJECT_INF_AT_ITER] = "2"
    os.environ[INJECT_INF_RANK] = "1"
    flags = with_flag(BASE_FLAGS, "--train-iters", "3") + ["--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1"]
    trainer = make_trainer(flags + extra)
    first = trainer.run_iteration()
    before = snapshot(trainer)
    second = trainer.run_iteration()
    after = snapshot(trainer)
    third = trainer.run_iteration()
    where = f"{extra} rank {STATE.rank}"
    assert not first.skipped and not third.skipped, f"{where}: a clean iteration was skipped"
    assert second.skipped, f"{where}: the iteration with an inf gradient on rank 1 was not skipped"
    assert bit_identical(before, after), f"{where}: the skipped step changed parameters or optimizer state"
    assert (first.loss_scale, second.loss_scale, third.loss_scale) == (1024.0, 1024.0, 512.0), f"{where}: loss scale"
    assert not bit_identical(after, snapshot(trainer)), f"{where}: iteration 3 did not step"


def check_trace(extra: list[str], overlap: bool) -> None:
    flags = with_flag(BASE_FLAGS, "--global-batch-size", "8") + ["--ddp-bucket-size", "20000"]
    trainer = make_trainer(flags + extra + (["--overlap-grad-reduce"] if overlap else []))
    dp = trainer.optimizer.data_parallel[0]
    dp.trace = []
    trainer.run_iteration()
    kinds = [kind for kind, _ in dp.trace]
    per_microbatch = len(trainer.optimizer.params)
    launches = [i for i, k in enumerate(kinds) if k == "launch"]
    grads = [i for i, k in enumerate(kinds) if k == "grad"]
    assert len(grads) == 2 * per_microbatch, f"{extra}: {len(grads)} gradient events for 2 microbatches"
    last_of_first = grads[per_microbatch - 1]
    every_microbatch = dp.opts.sharded_grads
    buckets = len(dp.buckets)
    assert buckets > 1, "the test needs several buckets"
    assert len(launches) == buckets * (2 if every_microbatch else 1), f"{extra}: {len(launches)} launches"
    early = [i for i in launches if i < last_of_first]
    if every_microbatch:
        assert early if overlap else not early, f"{extra} overlap={overlap}: launches in microbatch 1 {early}"
    else:
        assert not early, f"{extra}: a reduction started during an earlier microbatch"
    last_launches = [i for i in launches if i > grads[per_microbatch]]  # during or after the last backward
    if overlap:
        assert last_launches[0] < grads[-1], f"{extra}: first reduction {last_launches[0]} not before last grad {grads[-1]}"
    else:
        assert last_launches[0] > grads[-1], f"{extra}: reduction started during backward without overlap"


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "skip":
        for extra in ([], ["--use-distributed-optimizer"], ["--zero-stage", "3"]):
            check_skip(extra)
    elif mode == "trace":
        for extra in ([], ["--use-distributed-optimizer"], ["--zero-stage", "2"]):
            for overlap in (True, False):
                check_trace(extra, overlap)
    else:
        raise SystemExit(f"unknown mode {mode}")
    dist.barrier()  # exit together: a rank leaving mid-collective aborts gloo on its peers
    dist.destroy_process_group()
    if STATE.rank == 0:
        print("ok")
