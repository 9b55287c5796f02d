"""Cost of the spike guard (--check-for-spiky-loss) and of the straggler spans on the step: ratio against neither.

One single-process Trainer; each round runs a block of iterations with each setting, in a shuffled order
(drift and neighbours' load hit all settings alike): "off" (no guard, no monitor), "spikes" (the guard's
veto: a dozen 0-dim device ops per iteration, the loss all-reduce before the step), "stragglers" (the two
timed spans of own work per iteration; one process has no peer, so the monitor is attached by hand and its
all-gather, once per log interval, is not run) and "both". Reported: median ms per iteration and the median
over rounds of (setting / off) in the same round; the two halves of "off" give the noise floor. Also the
guard's device ops alone, timed over many calls. Print os.getloadavg() with the figures.

    .venv/bin/python bench/spikes_stragglers.py [--hidden 128 --layers 2 --seq 128 --rounds 30 --block 2]
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from tiny_trainer import parser, tiny_trainer  # noqa: E402

from tricorn.parallel.state import destroy_parallel  # noqa: E402
from tricorn.training.spikes import SpikeGuard  # noqa: E402
from tricorn.training.stragglers import StragglerMonitor  # noqa: E402


def veto_seconds(device: torch.device, n: int = 20_000) -> float:
    """Seconds per spike decision (the guard's device ops), its records dropped as the log line would."""
    guard = SpikeGuard(10.0, 10, device)
    loss, norm = torch.full((), 2.0, device=device), torch.full((), 1.0, device=device)
    start = time.perf_counter()
    for i in range(n):
        guard.veto(loss, i, range(4))(norm, None)
        if len(guard._pending) >= 100:
            guard._pending.clear()
    return (time.perf_counter() - start) / n


def main() -> None:
    args = parser(__doc__.split("\n")[0], rounds=30, block=2).parse_args()
    state, trainer = tiny_trainer(args, settings=4, port=29519)
    guard, monitor = SpikeGuard(10.0, 10, state.device), StragglerMonitor(1.2, state)
    settings = {"off": (None, None), "spikes": (guard, None), "stragglers": (None, monitor), "both": (guard, monitor)}
    trainer.run_iteration()  # warm-up
    samples: dict[str, list[float]] = {name: [] for name in settings}
    paired: dict[str, list[float]] = {name: [] for name in settings}
    rng = random.Random(0)
    for _ in range(args.rounds):
        order = list(settings)
        rng.shuffle(order)
        this_round = {}
        for name in order:
            trainer.spikes, trainer.stragglers = settings[name]
            this_round[name] = [trainer.run_iteration().seconds for _ in range(args.block)]
            guard._pending.clear()  # what the log line's read does
            monitor.timer.collect(reset=True)
        for name, values in this_round.items():
            samples[name] += values
            paired[name].append(statistics.median(values) / statistics.median(this_round["off"]))
    trainer.optimizer.wait_all()
    trainer.logger.close()
    destroy_parallel()

    half = len(samples["off"]) // 2
    a, b = samples["off"][::2][:half], samples["off"][1::2][:half]
    noise = abs(statistics.median(a) / statistics.median(b) - 1) * 100
    base = statistics.median(samples["off"])
    print(f"model: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, global batch 8, 1 CPU process")
    print(f"load average: {os.getloadavg()}")
    print(f"{'setting':<12}{'median ms/iter':>16}{'ratio vs off':>14}")
    for name, values in samples.items():
        print(f"{name:<12}{1000 * statistics.median(values):>16.2f}{statistics.median(paired[name]):>14.4f}")
    print(f"noise floor (two halves of 'off'): {noise:.2f}%")
    cost = veto_seconds(state.device)
    print(f"spike decision alone: {1e6 * cost:.1f} us per iteration = {100 * cost / base:.3f}% of the step")


if __name__ == "__main__":
    main()
