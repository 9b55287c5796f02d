"""Worker: pretrain_gpt.py's main() with tricorn's CUDA calls on the stand-in (tests/cuda_standin.py).

argv: JOURNAL_DIR, then the trainer's flags. Each rank appends its calls to JOURNAL_DIR/rank<R>.jsonl, with the
worker's markers: "build" before the model is built, "iteration N" as iteration N starts (after the profiler's
begin, before the data). The exit code is main()'s.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import cuda_standin  # noqa: E402

from tricorn.training import loop  # noqa: E402
from tricorn.training import main as entry  # noqa: E402

cuda_standin.install(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.jsonl"))
_build, _run_iteration = entry.build, loop.Trainer.run_iteration


def build(cfg, state):
    cuda_standin.mark("build")
    return _build(cfg, state)


def run_iteration(self):
    cuda_standin.mark(f"iteration {self.iteration + 1}")
    return _run_iteration(self)


entry.build, loop.Trainer.run_iteration = build, run_iteration
sys.exit(entry.main(sys.argv[2:]))
