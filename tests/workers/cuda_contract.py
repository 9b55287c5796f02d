"""Worker: the CUDA contract (tricorn.host_reads) of several layouts inside one launch of WORLD_SIZE gloo ranks.

argv[1] is a JSON spec written by tests/test_cuda_contract.py: {"runs": [{"name", "flags"}, ...], "out": path}.
For each run this worker builds the real trainer (build_trainer) on a mesh of that layout, with the CPU standing
in for CUDA (tricorn.pinned.stand_in: the pinned-memory branches CUDA takes), trains 3 iterations (the third
logs) and records per iteration, on every rank, what HostReadCounter saw from the start of the iteration to the
end of its log line: device-to-host reads, host-to-device copies (the blocking or pageable ones apart),
wrong-device tensors, and for each attention call the CUDA kernel torch 2.13 would choose on an H100
(tricorn.attention_kernels) and, when neither flash nor the efficient kernel would take it, why.
Rank 0 writes {name: {"ranks": [per rank: {"routers", "microbatches", "iterations": [...]}]}} to "out".
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from harness import BASE_FLAGS, with_flag  # noqa: E402

from tricorn.attention_kernels import cuda_sdpa_kernel  # noqa: E402
from tricorn.host_reads import HostReadCounter  # noqa: E402
from tricorn.model.moe import Router  # noqa: E402
from tricorn.parallel.state import init_parallel  # noqa: E402
from tricorn.pinned import stand_in  # noqa: E402
from tricorn.training.logging import MetricsLogger  # noqa: E402
from tricorn.training.main import build_trainer, resolve_config  # noqa: E402

ITERS = 3


def train(flags: list[str]) -> dict:
    cfg = resolve_config(with_flag(with_flag(BASE_FLAGS, "--train-iters", str(ITERS)), "--log-interval", str(ITERS)) + flags)
    state = init_parallel(cfg)
    trainer = build_trainer(cfg, state, MetricsLogger(cfg, rank=1), with_validation=False)
    counter = HostReadCounter(trainer.optimizer.host_scalars())
    iterations = []
    while trainer.iteration < cfg.training.train_iters:
        counter.clear()
        with counter:
            result = trainer.run_iteration()
            trainer.unlogged.append(result)
            logs = trainer.logs_at(trainer.iteration)
            if logs:
                trainer.log(result)
        iterations.append(
            {
                "logs": logs,
                "reads": list(counter.where),
                "copies": [str(c) for c in counter.copies],
                "blocking": [str(c) for c in counter.blocking_copies()],
                "wrong_device": list(counter.wrong_device),
                "kernels": [cuda_sdpa_kernel(c) for c in counter.attention],
                "unfused": counter.unfused_attention(),
            }
        )
    trainer.optimizer.wait_all()
    trainer.optimizer.close()
    routers = sum(isinstance(m, Router) for c in trainer.chunks for m in c.modules())
    return {"routers": routers, "microbatches": cfg.num_microbatches, "iterations": iterations}


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    results = {}
    with stand_in():
        for run in spec["runs"]:
            mine = train(run["flags"])
            ranks: list = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
            results[run["name"]] = {"ranks": ranks, "flags": run["flags"]}
    if dist.get_rank() == 0:
        with open(spec["out"], "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
