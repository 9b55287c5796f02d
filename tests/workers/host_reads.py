"""Worker: host reads (device synchronisations) per training iteration, on WORLD_SIZE gloo ranks.

argv[1:] are extra trainer flags (the layout). Runs 6 iterations through Trainer.train() with
--log-interval 3 and counts, per iteration, every host read (tricorn.host_reads) from the start
of the iteration to the end of its log line. Iteration 1 (the memory report; with --torch-compile the compilation) is not counted.
Every rank asserts 0 reads in iterations that do not log and at most MAX_LOGGING in those that do;
rank 0 prints the counts and "ok".
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from harness import BASE_FLAGS, with_flag  # noqa: E402

from tricorn.host_reads import HostReadCounter  # noqa: E402
from tricorn.parallel.state import init_parallel  # noqa: E402
from tricorn.training.logging import MetricsLogger  # noqa: E402
from tricorn.training.main import build_trainer, resolve_config  # noqa: E402

# A logging iteration reads: the NaN record, the interval's metrics, the memory/timer maximum over ranks.
MAX_LOGGING = 3


def main() -> None:
    flags = with_flag(with_flag(BASE_FLAGS, "--train-iters", "6"), "--log-interval", "3") + sys.argv[1:]
    cfg = resolve_config(flags)
    state = init_parallel(cfg)
    trainer = build_trainer(cfg, state, MetricsLogger(cfg, rank=1), with_validation=False)
    counts: dict[int, list[str]] = {}
    counter = HostReadCounter(trainer.optimizer.host_scalars())
    run_iteration = trainer.run_iteration

    def counted_iteration():  # the count of iteration N runs until iteration N+1 starts (its log line included)
        if trainer.iteration >= 2:
            counter.__exit__(None, None, None)
            counts[trainer.iteration] = list(counter.where)
        if trainer.iteration >= 1:
            counter.where.clear()
            counter.__enter__()
        # Iteration 1 (not counted) runs without the counter: dynamo never compiles code first run under a
        # TorchDispatchMode, so with --torch-compile the counted iterations run the compiled layers.
        return run_iteration()

    trainer.run_iteration = counted_iteration
    trainer.train()
    counter.__exit__(None, None, None)
    counts[trainer.iteration] = list(counter.where)
    where = f"rank {state.rank} {sys.argv[1:]}"
    for it, reads in counts.items():
        if it == 1:
            continue
        if trainer.logs_at(it):
            assert 0 < len(reads) <= MAX_LOGGING, f"{where}: logging iteration {it} made {len(reads)} host reads: {reads}"
        else:
            assert not reads, f"{where}: iteration {it} (no log line) made {len(reads)} host reads: {reads}"
    if cfg.model.torch_compile:  # the counted iterations ran compiled layers, compiled once
        from tricorn.parallel.compile import STATS, recompiled_in_training

        assert STATS.training_graphs > 0 and recompiled_in_training() == 0, f"{where}: {STATS}"
    trainer.optimizer.wait_all()
    if state.rank == 0:
        print({it: len(r) for it, r in counts.items()})
        print("ok")


if __name__ == "__main__":
    main()
