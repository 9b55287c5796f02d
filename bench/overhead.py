"""Benchmark: the trainer's step overhead, against a bare PyTorch loop and against forward+backward alone.

One process (default), the same model (Llama: 4 layers, hidden 256, 8 heads, 2 key/value heads, SwiGLU,
seq 256, fp32, micro batch 4, 2 microbatches) and the same tokens on three sides, which take turns
iteration by iteration so that a busy machine hits them alike:

    trainer   Trainer.run_iteration (and its log line when due) at TP=PP=DP=1
    bare      the same math with nothing around it: model, AdamW (the trainer's implementation: fused
              where torch has it), clip, LR schedule
    fwd+bwd   forward and backward of the same microbatches alone (gradients set to None before each)

It prints tokens/s of each (median and best), the trainer's tokens/s over the bare loop's, and the
trainer's step time over forward+backward (goal <= 1.03), both as medians of the per-round ratios
(each round's three iterations ran within a few seconds of each other). Then the AdamW step alone on this
model's parameters, foreach against fused, and the trainer's whole Optimizer.step() (norm, clip, AdamW);
then, per iteration after the first and with the CPU standing in for CUDA (tricorn.host_reads), the
device-to-host reads and the host-to-device copies (and how many of those are blocking or from pageable
memory) of the bare loop (which reads its loss every iteration and copies its microbatches as a plain
PyTorch loop does) and of the trainer (reads once per --log-interval (10), copies non-blocking from pinned).

    .venv/bin/python bench/overhead.py [--iters 20] [--hidden 256] [--layers 4] [--seq 256]
    .venv/bin/python bench/overhead.py --tp 2 --sp    # 2 ranks: TP2+SP tokens/s over TP2 (goal >= 0.95)

With --tp N the script starts N ranks of itself (gloo, one thread each); each rank builds a TP=N trainer
and, with --sp, a TP=N sequence-parallel one beside it, and the two alternate iteration by iteration.
Times are wall clock (a 2-core machine shared with others is noisy: read the min and median together).
Not a test: CI never times anything.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from recompute import raise_malloc_thresholds  # noqa: E402

from tricorn.config import Config  # noqa: E402
from tricorn.config_args import config_from_args
from tricorn.host_reads import HostReadCounter  # noqa: E402
from tricorn.lr_schedule import schedule_from_config  # noqa: E402
from tricorn.model import GPTModel  # noqa: E402
from tricorn.parallel.optimizer import param_groups  # noqa: E402
from tricorn.parallel.shard_state import adamw_kind  # noqa: E402
from tricorn.parallel.state import destroy_parallel, init_parallel  # noqa: E402
from tricorn.pinned import stand_in  # noqa: E402
from tricorn.training.logging import MetricsLogger  # noqa: E402
from tricorn.training.main import build_trainer  # noqa: E402


def config(args: argparse.Namespace, world: int, extra: str = "") -> Config:
    argv = (
        f"--device cpu --mock-data --num-layers {args.layers} --hidden-size {args.hidden} --num-attention-heads 8 "
        f"--group-query-attention --num-query-groups 2 --seq-length {args.seq} --micro-batch-size 4 "
        f"--global-batch-size 8 --train-iters {10**6} --vocab-size 8000 --swiglu --disable-bias-linear "
        f"--lr 1e-4 --log-interval 10 {extra}"
    ).split()
    return config_from_args(argv, world_size=world)


def batches(cfg: Config, n: int, pin: bool = False) -> list:
    from tricorn.data.base import GlobalBatchLoader, MockSamples

    loader = GlobalBatchLoader(MockSamples(cfg.model.vocab_size, cfg.model.seq_length, cfg.training.seed), 0, 1)
    loader.pin_memory = pin
    return [loader.next(cfg.training.global_batch_size) for _ in range(n)]


def _microbatches(cfg: Config, batch) -> list:
    mbs = cfg.training.micro_batch_size
    return [batch.slice(i * mbs, (i + 1) * mbs) for i in range(len(batch) // mbs)]


def _model(cfg: Config) -> GPTModel:
    model = GPTModel(cfg.model)
    model.init_weights(cfg.training.seed)
    return model


def _adamw(params, cfg: Config, kind: dict) -> torch.optim.AdamW:
    t = cfg.training
    return torch.optim.AdamW(params, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, **kind)


class Bare:
    """The same math with nothing around it: model, AdamW, clip, LR schedule; reads its loss every iteration."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.model = _model(cfg)
        self.opt = _adamw(param_groups([self.model], cfg.training.weight_decay), cfg, adamw_kind(torch.device("cpu")))
        self.iteration = 0
        self.device = torch.device("cpu")
        self.schedule = schedule_from_config(cfg.training)

    def step(self, batch) -> None:
        t = self.cfg.training
        self.iteration += 1
        for group in self.opt.param_groups:
            group["lr"] = self.schedule.lr()
        self.opt.zero_grad(set_to_none=True)
        n = batch.loss_mask.sum()
        for mb in _microbatches(self.cfg, batch):
            mb = mb.to(self.device)  # what a plain loop does on CUDA (pageable, blocking); nothing on CPU
            loss = (self.model(mb.tokens, mb.labels) * mb.loss_mask).sum() / n
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.clip_grad, foreach=True)
        self.opt.step()
        self.schedule.step(t.global_batch_size)
        loss.item()

    def host_scalars(self) -> list[torch.Tensor]:
        return [s["step"] for s in self.opt.state.values()]


class ForwardBackward:
    """Forward and backward of the microbatches alone: the floor a step's time is compared with."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.model = _model(cfg)

    def step(self, batch) -> None:
        for p in self.model.parameters():
            p.grad = None
        n = batch.loss_mask.sum()
        for mb in _microbatches(self.cfg, batch):
            ((self.model(mb.tokens, mb.labels) * mb.loss_mask).sum() / n).backward()


class TrainerSide:
    """Trainer.train()'s iteration and its log line (logger silent: rank 1); Optimizer.step() timed apart."""

    def __init__(self, cfg: Config):
        self.state = init_parallel(cfg)
        self.trainer = build_trainer(cfg, self.state, MetricsLogger(cfg, rank=1), with_validation=False)
        self.optimizer_seconds: list[float] = []
        opt = self.trainer.optimizer
        inner = opt.step

        def timed_step():
            start = time.perf_counter()
            out = inner()
            self.optimizer_seconds.append(time.perf_counter() - start)
            return out

        opt.step = timed_step

    def step(self, _batch=None) -> None:
        t = self.trainer
        t.unlogged.append(t.run_iteration())
        if t.logs_at(t.iteration):
            t.log(t.unlogged[-1])

    def host_scalars(self) -> list[torch.Tensor]:
        return self.trainer.optimizer.host_scalars()


def interleave(sides: dict[str, Callable], batches: list, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per iteration of each side; the sides take turns iteration by iteration (first `warmup` dropped)."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i, batch in enumerate(batches):
        order = list(sides.items())
        if i % 2:  # alternate who goes first: a side never always follows the same one
            order.reverse()
        for name, step in order:
            start = time.perf_counter()
            step(batch)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def paired_ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of a[i] / b[i]: each pair ran in the same round."""
    ratios = [x / y for x, y in zip(a, b)]
    return statistics.median(ratios), min(ratios), max(ratios)


def print_sides(times: dict[str, list[float]], tokens: int) -> None:
    print(f"{'side':<14}{'tokens/s med':>14}{'tokens/s best':>15}{'ms/iter med':>13}{'ms/iter min':>13}")
    for name, t in times.items():
        med, best = statistics.median(t), min(t)
        print(f"{name:<14}{tokens / med:>14.0f}{tokens / best:>15.0f}{1000 * med:>13.1f}{1000 * best:>13.1f}")


def optimizer_step_times(cfg: Config, rounds: int = 15) -> dict[str, list[float]]:
    """AdamW.step() alone on this model's parameters with random gradients: foreach vs fused, interleaved."""
    opts = {}
    for name, kind in (("foreach", {"foreach": True}), ("fused", {"fused": True})):
        params = [p.detach().clone().requires_grad_() for p in _model(cfg).parameters()]
        for p in params:
            p.grad = torch.randn_like(p)
        opts[name] = _adamw(params, cfg, kind)
    return interleave({name: (lambda _b, o=o: o.step()) for name, o in opts.items()}, [None] * (rounds + 1))


def host_contract(side, cfg: Config, n: int) -> list[tuple[int, int, int]]:
    """(device-to-host reads, host-to-device copies, blocking or pageable ones) per iteration after the first,
    with the CPU standing in for CUDA (tricorn.pinned.stand_in: the trainer's batches come pinned, as on CUDA)."""
    with stand_in():
        with HostReadCounter():  # built as a loader builds them: in host memory (pageable for the bare loop)
            data = batches(cfg, n)
        if isinstance(side, TrainerSide):  # the trainer reads its own loader
            side.trainer.train_loader.pin_memory = True  # what build_loaders sets on CUDA
        out = []
        for i, batch in enumerate(data):
            counter = HostReadCounter(side.host_scalars())
            with counter:
                side.step(batch)
            if i:
                out.append((counter.count, len(counter.copies), len(counter.blocking_copies())))
        if isinstance(side, TrainerSide):
            side.trainer.train_loader.pin_memory = False
    return out


def _per_iteration(counts: list[tuple[int, int, int]]) -> str:
    reads, copies, blocking = (sum(c[k] for c in counts) / len(counts) for k in range(3))
    return f"{reads:.2f} device-to-host reads, {copies:.2f} host-to-device copies ({blocking:.2f} blocking or pageable)"


def single_process(args: argparse.Namespace) -> None:
    cfg = config(args, world=1)
    data = batches(cfg, args.iters + 1)
    tokens = cfg.training.global_batch_size * cfg.model.seq_length
    trainer, bare, alone = TrainerSide(cfg), Bare(cfg), ForwardBackward(cfg)
    times = interleave({"trainer": trainer.step, "bare": bare.step, "fwd+bwd": alone.step}, data)
    print(
        f"overhead bench: {args.layers} layers, h {args.hidden}, 8 heads (2 kv), seq {args.seq}, fp32, "
        f"mbs 4 x 2 microbatches, 1 thread, {args.iters} rounds"
    )
    print_sides(times, tokens)
    med, lo, hi = paired_ratio(times["bare"], times["trainer"])
    print(f"tokens/s trainer / bare       = {med:.3f} median of rounds (min {lo:.3f}, max {hi:.3f})")
    med, lo, hi = paired_ratio(times["trainer"], times["fwd+bwd"])
    best = min(times["trainer"]) / min(times["fwd+bwd"])
    print(
        f"step trainer / (fwd+bwd)      = {med:.3f} median of rounds (min {lo:.3f}, max {hi:.3f}; best/best {best:.3f}; goal <= 1.03)"
    )
    opt = optimizer_step_times(cfg)
    n = sum(p.numel() for p in alone.model.parameters())
    line = ", ".join(f"{k} {1000 * statistics.median(v):.2f} (min {1000 * min(v):.2f})" for k, v in opt.items())
    print(f"AdamW step alone, {n / 1e6:.2f}M params, ms median: {line}")
    o = trainer.optimizer_seconds[1:]
    print(f"trainer Optimizer.step() (norm, clip, AdamW) ms: median {1000 * statistics.median(o):.2f}, min {1000 * min(o):.2f}")
    bare_counts, our_counts = host_contract(bare, cfg, 12), host_contract(trainer, cfg, 12)
    our_reads = [c[0] for c in our_counts]
    print(f"per iteration, bare loop: {_per_iteration(bare_counts)}")
    print(
        f"per iteration, trainer:   {_per_iteration(our_counts)}; "
        f"{sum(1 for n in our_reads if n == 0)} of {len(our_reads)} iterations without a read (it logs every 10th)"
    )
    destroy_parallel()


def tp_worker(args: argparse.Namespace) -> None:
    """One rank of --tp N: TP=N (and TP=N with SP) trainers in the same process groups, alternating."""
    tp = f"--tensor-model-parallel-size {args.tp}"
    layouts = {f"tp{args.tp}": tp} | ({f"tp{args.tp}+sp": tp + " --sequence-parallel"} if args.sp else {})
    sides = {name: TrainerSide(config(args, args.tp, flags)) for name, flags in layouts.items()}
    times = interleave({name: side.step for name, side in sides.items()}, [None] * (args.iters + 1))
    if int(os.environ["RANK"]) == 0:
        tokens = 8 * args.seq
        print(
            f"overhead bench, {args.tp} ranks: {args.layers} layers, h {args.hidden}, seq {args.seq}, fp32, {args.iters} rounds"
        )
        print_sides(times, tokens)
        if args.sp:
            med, lo, hi = paired_ratio(*times.values())
            print(
                f"tokens/s tp{args.tp}+sp / tp{args.tp} = {med:.3f} median of rounds (min {lo:.3f}, max {hi:.3f}; goal >= 0.95)"
            )
    destroy_parallel(clean_exit=True)


def launch_ranks(args: argparse.Namespace) -> int:
    with socket.socket() as s:  # a free rendezvous port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": str(args.tp), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, *sys.argv], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(args.tp)
    ]
    return max(p.wait() for p in procs)


def main() -> Optional[int]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20, help="rounds (each side runs one iteration per round)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (started by this script)")
    ap.add_argument("--sp", action="store_true", help="with --tp: also a sequence-parallel trainer, and the ratio")
    args = ap.parse_args()
    raise_malloc_thresholds()
    torch.set_num_threads(1)
    if args.tp == 1:
        single_process(args)
    elif "RANK" not in os.environ:
        return launch_ranks(args)
    else:
        tp_worker(args)
    return None


if __name__ == "__main__":
    sys.exit(main())
