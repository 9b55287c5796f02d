"""Timer overhead: step time with --timing-log-level 0 (and 1, 2) against timers disabled, and the cost per timer call.

Two measurements, because the first is limited by machine noise:

1. End to end. One single-process Trainer; blocks of iterations run with each timer setting in turn
   (the order shuffled every round, so drift and neighbours' load hit all settings alike). Reported:
   the median and minimum iteration time per setting, and the median over rounds of (setting / disabled)
   in the same round, in percent; the difference between two halves of the "disabled" samples is the
   noise floor.
2. Per call. The timer calls one iteration makes (counted) times the cost of one call (measured
   over many calls) over the median iteration time: the overhead without the noise.

Level 0 hands out a shared do-nothing timer (no clock read, no device synchronisation); level 1
reads the clock (on CUDA it records events instead, not measured here on CPU); level 2 adds one
small all-reduce per log interval, which this benchmark does not log (and on CUDA synchronises).

    .venv/bin/python bench/timers.py [--hidden 128 --layers 2 --seq 128 --rounds 40 --block 1]
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_trainer import parser, tiny_trainer  # noqa: E402

from tricorn.parallel.state import destroy_parallel  # noqa: E402
from tricorn.timers import OPTIMIZER_STEP, Timers  # noqa: E402


class CountingTimers(Timers):
    """Level-0 timers that count how often they are asked for a timer."""

    def __init__(self) -> None:
        super().__init__(level=0)
        self.calls = 0

    def __call__(self, name: str, level: int = 1):
        self.calls += 1
        return super().__call__(name, level)


def per_call_seconds(timers: Timers, n: int = 200_000) -> float:
    """Seconds per `with timers(name): pass`, minus the cost of the bare loop."""

    def loop(body: bool) -> float:
        start = time.perf_counter()
        for _ in range(n):
            if body:
                with timers(OPTIMIZER_STEP):
                    pass
        return time.perf_counter() - start

    best = min(loop(True) for _ in range(5)) - min(loop(False) for _ in range(5))
    return max(best, 0.0) / n


def main() -> None:
    args = parser(__doc__.split("\n")[0], rounds=40, block=1).parse_args()
    state, trainer = tiny_trainer(args, settings=4, port=29517)
    settings = {
        "disabled": Timers.disabled(),
        "level 0": Timers(0, state.device),
        "level 1": Timers(1, state.device),
        "level 2": Timers(2, state.device),
    }
    counter = CountingTimers()
    trainer.timers = counter
    trainer.run_iteration()  # warm-up, and count the timer calls of one iteration
    calls = counter.calls
    samples: dict[str, list[float]] = {name: [] for name in settings}
    paired: dict[str, list[float]] = {name: [] for name in settings}  # per round: setting / disabled
    rng = random.Random(0)
    for _ in range(args.rounds):
        order = list(settings)
        rng.shuffle(order)
        this_round = {}
        for name in order:
            trainer.timers = settings[name]
            this_round[name] = [trainer.run_iteration().seconds for _ in range(args.block)]
            settings[name].read()  # as the logger would, once per interval
        for name, values in this_round.items():
            samples[name] += values
            paired[name].append(statistics.median(values) / statistics.median(this_round["disabled"]))
    trainer.logger.close()
    destroy_parallel()

    base = statistics.median(samples["disabled"])
    half = len(samples["disabled"]) // 2
    a, b = sorted(samples["disabled"][::2][:half]), sorted(samples["disabled"][1::2][:half])
    noise = abs(statistics.median(a) / statistics.median(b) - 1) * 100
    print(f"model: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, global batch 8, 1 CPU process")
    print(f"{'setting':<10}{'median ms/iter':>16}{'min ms/iter':>14}{'paired vs disabled':>20}")
    for name, values in samples.items():
        med, low = statistics.median(values), min(values)
        print(f"{name:<10}{1000 * med:>16.2f}{1000 * low:>14.2f}{100 * (statistics.median(paired[name]) - 1):>+19.2f}%")
    print(f"noise floor (two halves of 'disabled'): {noise:.2f}%")
    print(f"timer calls per iteration: {calls}")
    for name in ("level 0", "level 1"):
        cost = per_call_seconds(Timers(int(name[-1])))
        print(f"{name}: {1e9 * cost:.0f} ns per call -> {100 * calls * cost / base:.4f}% of the step (goal < 1%)")


if __name__ == "__main__":
    main()
