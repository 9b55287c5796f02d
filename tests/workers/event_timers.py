"""Worker: a real training run on CPU with the level-1 timers forced onto their CUDA path (argv: flags).

Timers get device cuda and tests/fake_cuda_event.FakeEvent for torch.cuda.Event; torch.cuda.synchronize raises,
so a device synchronisation anywhere in the run fails it. The logger's log_iteration is wrapped to mark the log
lines in the event journal. Prints one JSON line on rank 0: the journal and the logged phase times."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import torch  # noqa: E402
from fake_cuda_event import JOURNAL, FakeEvent  # noqa: E402
from harness import BASE_FLAGS  # noqa: E402

from tricorn.parallel.state import destroy_parallel, init_parallel  # noqa: E402
from tricorn.timers import Timers  # noqa: E402
from tricorn.training.logging import MetricsLogger  # noqa: E402
from tricorn.training.main import build_trainer, resolve_config  # noqa: E402


def no_sync(*_args, **_kwargs):
    raise AssertionError("torch.cuda.synchronize() called at --timing-log-level 1")


torch.cuda.synchronize = no_sync
cfg = resolve_config(BASE_FLAGS + sys.argv[1:])
state = init_parallel(cfg)
logger = MetricsLogger(cfg, rank=state.rank)
trainer = build_trainer(cfg, state, logger, with_validation=False)
trainer.timers = Timers(cfg.logging.timing_log_level, torch.device("cuda"), event_factory=FakeEvent)
assert trainer.timers.uses_events
phase_times: list[dict] = []
log_iteration = logger.log_iteration


def marked(tr) -> None:
    JOURNAL.append("log-start")
    read = tr.timers.read

    def recording_read(reset: bool = True) -> dict:
        phase_times.append(read(reset))
        return phase_times[-1]

    tr.timers.read = recording_read
    log_iteration(tr)
    tr.timers.read = read
    JOURNAL.append("log-end")


logger.log_iteration = marked
trainer.train()
if state.rank == 0:
    print(json.dumps({"journal": JOURNAL, "phase_times": phase_times}))
del trainer
destroy_parallel(clean_exit=True)
