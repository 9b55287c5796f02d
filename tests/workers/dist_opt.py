"""Worker: the optimizer inside a real trainer on WORLD_SIZE gloo ranks (DP = WORLD_SIZE).

Modes (argv[1]):
  skip   fp16 with an inf injected into rank 1's gradient at iteration 2 (the optimizer's
         test hook): every rank skips that step, the loss scale backs off (hysteresis 1),
         and parameters, master weights and Adam state stay bit-identical; iteration 3 steps.
         Checked for DDP, the distributed optimizer and ZeRO-3.
  trace  the bucket event trace: with --overlap-grad-reduce the first reduction starts
         before the last gradient of the last microbatch; without, only after it; never
         during earlier microbatches. ZeRO-2 reduces every microbatch, each bucket as soon
         as it is complete, with or without the flag.
  peak   ZeRO-2 and ZeRO-3 at DP = WORLD_SIZE: the PEAK of live gradient storage during backward
         (the persistent owned shards plus every transient bucket buffer still referenced, tracked
         from allocation to the buffer's release by the garbage collector) is at most
         full/DP + 2 buckets; ZeRO-3 also holds at most 3 gathered layers' parameters at once
         (plus the tied embedding, which the head reads again).
Every rank asserts; rank 0 prints "ok".
"""

from __future__ import annotations

import os
import sys
import weakref

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
    chunks, optimizer, forward_backward = build(cfg, STATE)
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
    eager = overlap or every_microbatch  # ZeRO-2/3 reduce each bucket once complete: its buffer is transient
    if every_microbatch:
        assert early, f"{extra} overlap={overlap}: no launch during microbatch 1"
    else:
        assert not early, f"{extra}: a reduction started during an earlier microbatch"
    last_launches = [i for i in launches if i > grads[per_microbatch]]  # during or after the last backward
    if eager:
        assert last_launches[0] < grads[-1], f"{extra}: first reduction {last_launches[0]} not before last grad {grads[-1]}"
    else:
        assert last_launches[0] > grads[-1], f"{extra}: reduction started during backward without overlap"


class PeakMeter:
    """Live bytes of tracked tensors, and their peak; a tensor counts until Python frees it."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def track(self, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._free, nbytes)

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


def check_peak(extra: list[str]) -> None:
    from tricorn.parallel import data_parallel, zero3

    flags = with_flag(with_flag(BASE_FLAGS, "--micro-batch-size", "1"), "--global-batch-size", "8")
    trainer = make_trainer(with_flag(flags, "--num-layers", "6") + ["--ddp-bucket-size", "6000"] + extra)
    opt = trainer.optimizer
    (dp,) = opt.data_parallel
    world = dist.get_world_size(dp.group)
    grads, params = PeakMeter(), PeakMeter()
    allocate = data_parallel.Bucket.grad_accumulator

    def tracked_accumulator(bucket):
        fresh = bucket.grad_flat is None
        out = allocate(bucket)
        if fresh:
            grads.track(out)
        return out

    gather = zero3.ParamSharder._gather

    def tracked_gather(sharder, unit, wait=True):
        was = unit.gathered
        gather(sharder, unit, wait)
        if not was:
            params.peak = max(params.peak, sum(b.param_flat.untyped_storage().nbytes() for u in sharder.units for b in u.buckets))

    data_parallel.Bucket.grad_accumulator = tracked_accumulator
    zero3.ParamSharder._gather = tracked_gather
    try:
        for _ in range(2):
            trainer.run_iteration()
    finally:
        data_parallel.Bucket.grad_accumulator = allocate
        zero3.ParamSharder._gather = gather
    element = torch.empty((), dtype=dp.opts.grad_dtype).element_size()
    full = sum(b.numel for b in dp.buckets) * element
    bucket = max(b.numel for b in dp.buckets) * element
    shards = sum(b.grad_shard.numel() for b in dp.buckets) * element
    assert len(dp.buckets) >= 4, f"{extra}: the test needs several buckets, got {len(dp.buckets)}"
    assert shards * world == full
    peak = shards + grads.peak
    where = f"{extra} rank {STATE.rank}"
    assert peak <= full / world + 2 * bucket, f"{where}: peak gradient bytes {peak} > full/DP {full / world} + 2 x {bucket}"
    assert grads.live == 0, f"{where}: {grads.live} bytes of bucket buffers outlive the step"
    if opt.sharders[0] is not None:
        units = opt.sharders[0].units
        size = dp.buckets[0].param_flat.element_size()
        kept = sum(b.numel for u in units if u.kept for b in u.buckets) * size  # the tied embedding, read again by the head
        unit = max(sum(b.numel for b in u.buckets) for u in units if not u.kept) * size
        bound = kept + 3 * unit  # the unit in use, the one prefetched, and one whose gradients are still arriving
        assert 0 < params.peak <= bound, f"{where}: {params.peak} bytes of gathered parameters > {bound}"
        assert params.peak < sum(b.numel for u in units for b in u.buckets) * size / 2, (
            f"{where}: half the model gathered at once"
        )
    if STATE.rank == 0:
        print(f"peak {extra}: grads {peak} <= {full / world + 2 * bucket} (full {full}, bucket {bucket}); params {params.peak}")


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "skip":
        for extra in ([], ["--use-distributed-optimizer"], ["--zero-stage", "3"]):
            check_skip(extra)
    elif mode == "trace":
        for extra in ([], ["--use-distributed-optimizer"], ["--zero-stage", "2"]):
            for overlap in (True, False):
                check_trace(extra, overlap)
    elif mode == "peak":
        for extra in (["--zero-stage", "2"], ["--zero-stage", "3"]):
            check_peak(extra)
    else:
        raise SystemExit(f"unknown mode {mode}")
    dist.barrier()  # exit together: a rank leaving mid-collective aborts gloo on its peers
    dist.destroy_process_group()
    if STATE.rank == 0:
        print("ok")
