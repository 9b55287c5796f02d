"""Profiler cost: step time with the profiler flags set but outside the window, against no flags; and inside it.

One single-process Trainer (bench/tiny_trainer.py); blocks of iterations run with each setting in turn, the
order shuffled every round, so drift and neighbours' load hit all settings alike:

- "no flags": the trainer's default Profiler (no window; every range is the shared no-op);
- "outside window": --profile --use-pytorch-profiler --profile-step-start far ahead: the window never opens, so
  this is what every iteration outside a window pays (begin/end per iteration, the ranges' global read);
- "inside window": a torch-profiler window of 3 iterations, the middle one timed (the profiler's start in the
  first and its stop and trace export in the last are reported apart: they happen once per window).

Reported: the median ms per iteration, and the median over rounds of (no flags / setting) in the same round:
the goal is >= 0.99 outside the window. The noise floor is the ratio of two halves of the "no flags" samples.
Then the same without the noise: ranges per iteration (counted) x the cost of one range outside a window.

    .venv/bin/python bench/profiling.py [--hidden 128 --layers 2 --seq 128 --rounds 30 --block 2]
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_trainer import parser, tiny_trainer  # noqa: E402

from tricorn import profiling  # noqa: E402
from tricorn.config_args import config_from_args  # noqa: E402
from tricorn.parallel.state import destroy_parallel  # noqa: E402
from tricorn.profiling import Profiler  # noqa: E402


def profiler_for(trace_dir: str, first: int, last: int) -> Profiler:
    """A torch-profiler window over iterations first..last (far in the future: never opens)."""
    argv = ["--mock-data", "--vocab-size", "8000", "--train-iters", str(last), "--tensorboard-dir", trace_dir]
    argv += ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(first - 1), "--profile-step-end", str(last)]
    cfg = config_from_args(argv, world_size=1)
    profiler = Profiler(cfg, 0, 1, None)
    profiler.announce = False  # its one line per window would flood the table
    return profiler


def iteration(trainer) -> float:
    """One iteration as Trainer.train runs it: the profiler's begin and end around it (both timed)."""
    start = time.perf_counter()
    trainer.profiler.begin(trainer.iteration + 1)
    trainer.run_iteration()
    trainer.profiler.end(trainer.iteration)
    return time.perf_counter() - start


def range_cost(n: int = 200_000) -> float:
    """Seconds per `with span("F stage%d mb%d", 0, 1): pass` outside a window, minus the bare loop."""

    def loop(body: bool) -> float:
        start = time.perf_counter()
        for _ in range(n):
            if body:
                with profiling.span("F stage%d mb%d", 0, 1):
                    pass
        return time.perf_counter() - start

    return max(min(loop(True) for _ in range(5)) - min(loop(False) for _ in range(5)), 0.0) / n


def main() -> None:
    args = parser(__doc__.split("\n")[0], rounds=30, block=2).parse_args()
    # per round: 2 settings x block iterations + 3 in the window (fits the 4 x block that tiny_trainer provides)
    state, trainer = tiny_trainer(args, settings=4, port=29519)
    traces = tempfile.mkdtemp(prefix="tricorn-bench-profile-")
    far = 10**9
    outside = profiler_for(traces, far, far + 1)
    counted = [0]
    real_span = profiling.span

    def counting_span(*a):
        counted[0] += 1
        return real_span(*a)

    for module in (profiling, sys.modules["tricorn.parallel.step"], sys.modules["tricorn.parallel.data_parallel"]):
        module.span = counting_span  # count the ranges one iteration enters (span_of's are counted below)
    iteration(trainer)  # warm-up
    per_iteration = counted[0] + 2  # + optimizer step (span_of) + the iteration's own begin/end
    for module in (profiling, sys.modules["tricorn.parallel.step"], sys.modules["tricorn.parallel.data_parallel"]):
        module.span = real_span
    samples: dict[str, list[float]] = {"no flags": [], "outside window": [], "inside window": []}
    paired: dict[str, list[float]] = {name: [] for name in samples}
    window_overhead: list[float] = []
    rng = random.Random(0)
    for _ in range(args.rounds):
        order = list(samples)
        rng.shuffle(order)
        this_round = {}
        for name in order:
            if name == "inside window":  # 3 iterations: the first starts the profiler, the last stops it and exports
                first = trainer.iteration + 1
                trainer.profiler = profiler_for(traces, first, first + 2)
                opened, times, closed = (iteration(trainer) for _ in range(3))
                times = [times]
                window_overhead.append(opened + closed - 2 * times[0])
            else:
                trainer.profiler = outside if name == "outside window" else Profiler.disabled()
                times = [iteration(trainer) for _ in range(args.block)]
            this_round[name] = times
        for name, values in this_round.items():
            samples[name] += values
            paired[name].append(statistics.median(this_round["no flags"]) / statistics.median(values))
    trainer.logger.close()
    destroy_parallel()

    base = samples["no flags"]
    half = len(base) // 2
    noise = abs(statistics.median(base[::2][:half]) / statistics.median(base[1::2][:half]) - 1) * 100
    print(f"model: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, global batch 8, 1 CPU process")
    print(f"{'setting':<16}{'median ms/iter':>16}{'min ms/iter':>14}{'no flags / setting':>20}")
    for name, values in samples.items():
        ratio = statistics.median(paired[name])
        print(f"{name:<16}{1000 * statistics.median(values):>16.2f}{1000 * min(values):>14.2f}{ratio:>20.4f}")
    print(f"noise floor (two halves of 'no flags'): {noise:.2f}%")
    cost = range_cost()
    step = statistics.median(base)
    print(
        f"outside the window: {per_iteration} ranges per iteration x {1e9 * cost:.0f} ns = "
        f"{100 * per_iteration * cost / step:.4f}% of the step (goal: ratio >= 0.99, i.e. < 1%)"
    )
    # the last iteration of a window also stops the profiler and writes its trace (gzip): once per window
    print(f"window stop and trace export: {1000 * statistics.median(window_overhead):.0f} ms per window (traces in {traces})")


if __name__ == "__main__":
    main()
