"""Worker: the trainer with --transformer-impl transformer_engine on the TE stand-in (argv: layout flags).

Trains 3 iterations with the local layers, then 3 with TE's Linear (tests/te_standin.py, TE 2.x's
signatures) on the same tokens, in the same process group; rank 0 prints one JSON line: both loss lists,
the is_first_microbatch values TE's forwards got per iteration, the devices TE's Linear was built on, and
whether every TE parameter was built hollow (the DP buckets materialised only what this rank owns).
"""

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import te_standin  # noqa: E402
from harness import BASE_FLAGS  # noqa: E402

te_standin.install(None)

from tricorn.parallel.state import init_parallel  # noqa: E402
from tricorn.training.logging import MetricsLogger  # noqa: E402
from tricorn.training.main import build_trainer, resolve_config  # noqa: E402

ITERS = 3
cfg = resolve_config(BASE_FLAGS + ["--train-iters", str(ITERS)] + sys.argv[1:])
# Validation refuses TE on a CPU (rightly): the TE config is the validated local one with the backend swapped.
te_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, transformer_impl="transformer_engine"))
state = init_parallel(cfg)
out = {}
for name, c in (("local", cfg), ("te", te_cfg)):
    te_standin.CALLS.clear()
    trainer = build_trainer(c, state, MetricsLogger(c, rank=1), with_validation=False)
    out[f"{name}_devices"] = sorted({str(kw["device"]) for _, kw in te_standin.CALLS["Linear.__init__"]})
    losses, flags = [], []
    for _ in range(ITERS):
        te_standin.CALLS["Linear.forward"].clear()
        losses.append(float(trainer.run_iteration().loss))
        flags.append([kw["is_first_microbatch"] for _, kw in te_standin.CALLS["Linear.forward"]])
    trainer.optimizer.wait_all()
    out[f"{name}_losses"], out[f"{name}_first_microbatch"] = losses, flags
    modules = [m for chunk in trainer.chunks for m in chunk.modules() if isinstance(m, te_standin.Linear)]
    out[f"{name}_modules"] = len(modules)
if state.rank == 0:
    print(json.dumps(out))
