"""Benchmark: tricorn's trainer at TP=PP=DP=1 against a bare PyTorch loop of the same model math.

Both sides train the same model (same init) on the same tokens, one after the
other in this process, and the script prints tokens/s of each and the ratio
(goal >= 0.97). Each side's time is the median iteration over several
alternating repeats, on one thread, so that a busy machine hits both alike.
It also prints the host reads (device synchronisations, tricorn.host_reads) per
iteration of each side after the first: the bare loop reads its loss every
iteration; the trainer reads once per --log-interval (10 here).
Not a test: CI never times anything.

    .venv/bin/python bench/overhead.py [--iters 20] [--hidden 256] [--layers 4] [--seq 256]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

import torch

from tricorn.config import config_from_args
from tricorn.host_reads import HostReadCounter
from tricorn.model import GPTModel
from tricorn.parallel.optimizer import param_groups
from tricorn.parallel.state import destroy_parallel, init_parallel
from tricorn.training.logging import MetricsLogger
from tricorn.training.lr_schedule import learning_rate
from tricorn.training.main import build_trainer


def bare_loop(cfg, batches, reads: Optional[list] = None) -> list[float]:
    """The same math with nothing around it: model, AdamW, clip, LR schedule."""
    model = GPTModel(cfg.model)
    model.init_weights(cfg.training.seed)
    t = cfg.training
    opt = torch.optim.AdamW(
        param_groups([model], t.weight_decay), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, foreach=True
    )
    mbs = t.micro_batch_size
    times = []
    for it, batch in enumerate(batches, start=1):
        counter = HostReadCounter([s["step"] for s in opt.state.values()])  # CPU step counters by design
        start = time.perf_counter()
        if reads is not None and it > 1:
            counter.__enter__()
        for group in opt.param_groups:
            group["lr"] = learning_rate(t, it)
        opt.zero_grad(set_to_none=True)
        n = batch.loss_mask.sum()
        for i in range(len(batch) // mbs):
            mb = batch.slice(i * mbs, (i + 1) * mbs)
            loss = (model(mb.tokens, mb.labels) * mb.loss_mask).sum() / n
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad, foreach=True)
        opt.step()
        loss.item()
        if reads is not None and it > 1:
            counter.__exit__(None, None, None)
            reads.append(counter.count)
        times.append(time.perf_counter() - start)
    return times[1:]  # the first iteration warms up allocators


def trainer_loop(cfg, reads: Optional[list] = None) -> list[float]:
    """Trainer.train()'s iteration and its log line (logger silent: rank 1), timed per iteration."""
    state = init_parallel(cfg)
    trainer, _ = build_trainer(cfg, state, MetricsLogger(cfg, rank=1), with_validation=False)
    times = []
    while trainer.iteration < cfg.training.train_iters:
        counter = HostReadCounter(trainer.optimizer.host_scalars())
        start = time.perf_counter()
        if reads is not None and trainer.iteration >= 1:
            counter.__enter__()
        trainer.unlogged.append(trainer.run_iteration())
        if trainer.logs_at(trainer.iteration):
            trainer.log(trainer.unlogged[-1])
        if reads is not None and trainer.iteration > 1:
            counter.__exit__(None, None, None)
            reads.append(counter.count)
        times.append(time.perf_counter() - start)
    destroy_parallel()
    return times[1:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    argv = (
        f"--device cpu --mock-data --num-layers {args.layers} --hidden-size {args.hidden} --num-attention-heads 8 "
        f"--seq-length {args.seq} --micro-batch-size 4 --global-batch-size 8 --train-iters {args.iters} "
        f"--vocab-size 8000 --swiglu --disable-bias-linear --lr 1e-4 --log-interval 10"
    ).split()
    cfg = config_from_args(argv, world_size=1)
    from tricorn.data.base import GlobalBatchLoader, MockSamples

    loader = GlobalBatchLoader(MockSamples(cfg.model.vocab_size, cfg.model.seq_length, cfg.training.seed), 0, 1)
    batches = [loader.next(cfg.training.global_batch_size) for _ in range(args.iters)]
    torch.set_num_threads(1)
    tokens = cfg.training.global_batch_size * cfg.model.seq_length
    bare, ours = [], []
    for _ in range(args.repeats):  # alternate so that machine noise hits both sides
        bare += bare_loop(cfg, batches)
        ours += trainer_loop(cfg)
    bare_s, ours_s = statistics.median(bare), statistics.median(ours)
    print(f"{'side':<10}{'tokens/s':>12}{'ms/iter':>10}")
    print(f"{'bare':<10}{tokens / bare_s:>12.0f}{1000 * bare_s:>10.1f}")
    print(f"{'tricorn':<10}{tokens / ours_s:>12.0f}{1000 * ours_s:>10.1f}")
    print(f"ratio tricorn/bare = {bare_s / ours_s:.3f} (goal >= 0.97)")
    bare_reads, our_reads = [], []
    bare_loop(cfg, batches, bare_reads)
    trainer_loop(cfg, our_reads)
    print(
        f"host reads per iteration: bare {sum(bare_reads) / len(bare_reads):.2f} (max {max(bare_reads)}), "
        f"tricorn {sum(our_reads) / len(our_reads):.2f} (max {max(our_reads)}, "
        f"{sum(1 for n in our_reads if n == 0)} of {len(our_reads)} iterations with none)"
    )


if __name__ == "__main__":
    main()
