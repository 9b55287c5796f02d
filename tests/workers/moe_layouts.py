"""Worker: MoE training in many layouts inside one launch of WORLD_SIZE (4) gloo ranks.

argv[1] is a JSON spec written by tests/test_moe_parallel.py: {"runs": [run, ...], "out": path}. Each run is
{"name", "flags"} plus optional "save" (a directory: save after iteration "save_at"), "load" (a
directory and "ckpt_step": resume from it), "record_router_calls", "count_host_reads" and "coalesce_bytes" (grads.py's
COALESCE_BYTES for this run: small, so the TP gradient reduction also takes its in-place path). For every run this worker builds the real
trainer (build_trainer) on a mesh of that layout, trains, and records per iteration the loss, the grad norm
and the logged MoE values (MoEMonitor, as TensorBoard gets them); with record_router_calls, per router call the
copies routed to each expert, the dropped copies and the tokens; with count_host_reads the host reads of each
iteration (tricorn.host_reads) with where they were made, on every rank; rank 0's CPU peak beyond its state
while it saves and loads (measurements.cpu_peak_bytes) beside its largest DP bucket, and its routed experts'
parameter count. Iterations log at --log-interval. Rank 0 writes {name: record} to "out" (the host reads of
every rank). The test compares the records with single-process runs.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from tricorn.checkpoint.checkpointer import Checkpointer  # noqa: E402
from tricorn.host_reads import HostReadCounter  # noqa: E402
from tricorn.model.init import is_expert  # noqa: E402
from tricorn.model.moe import Router  # noqa: E402
from tricorn.parallel import grads  # noqa: E402
from tricorn.parallel.state import init_parallel  # noqa: E402
from tricorn.training.logging import MetricsLogger  # noqa: E402
from tricorn.training.main import build_trainer, resolve_config  # noqa: E402
from tricorn.training.measurements import cpu_peak_bytes  # noqa: E402

COALESCE_BYTES = grads.COALESCE_BYTES


def record_router_calls(chunks, calls: list) -> None:
    """Every training forward of every router appends (copies routed per expert, dropped copies, tokens)."""
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, Router):
                forward = module.forward

                def recorded(x, forward=forward, module=module):
                    routing = forward(x)
                    if module.training and torch.is_grad_enabled():
                        calls.append([routing.tokens_per_expert.tolist(), int((~routing.kept).sum()), x.shape[0]])
                    return routing

                module.forward = recorded


def train(run: dict) -> dict:
    flags = list(run["flags"])
    if "save" in run:
        flags += ["--save", run["save"]]
    if "load" in run:
        flags += ["--load", run["load"], "--ckpt-step", str(run["ckpt_step"])]
    grads.COALESCE_BYTES = run.get("coalesce_bytes", COALESCE_BYTES)
    cfg = resolve_config(flags)
    state = init_parallel(cfg)
    logger = MetricsLogger(cfg, rank=1)  # silent; its records are caught below
    trainer = build_trainer(cfg, state, logger, with_validation=False)
    moe_values: list[dict] = []
    logger.record = lambda iteration, values: moe_values.append(values["moe"]) if "moe" in values else None
    ckpt = Checkpointer(cfg, state, console=lambda line: None)
    # The peak of the checkpoint's reads; the distributed optimizer's all-gather that follows is left out (gloo
    # frees its staging on its own thread, which the profiler of this thread never sees).
    gather, trainer.optimizer.params_from_masters = trainer.optimizer.params_from_masters, lambda: None
    _, load_peak = cpu_peak_bytes(lambda: ckpt.load(trainer))
    trainer.optimizer.params_from_masters = gather
    if "load" in run:
        gather()
    calls: list = []
    if run.get("record_router_calls"):  # its own host reads: not with count_host_reads
        record_router_calls(trainer.chunks, calls)
    out: dict = {"losses": [], "grad_norms": [], "moe": moe_values, "router_calls": calls, "host_reads": []}
    counter = HostReadCounter(trainer.optimizer.host_scalars())
    while trainer.iteration < cfg.training.train_iters:
        if run.get("count_host_reads"):
            with counter:
                result = trainer.run_iteration()
            out["host_reads"].append(list(counter.where))
            counter.where.clear()
        else:
            result = trainer.run_iteration()
        trainer.unlogged.append(result)
        if trainer.logs_at(trainer.iteration):
            trainer.log(result)
        out["losses"].append(float(result.loss))  # read after the counted iteration
        out["grad_norms"].append(float(result.grad_norm))
        if trainer.iteration == run.get("save_at"):
            _, out["save_peak"] = cpu_peak_bytes(lambda: ckpt.save(trainer))
    ckpt.close()
    trainer.optimizer.wait_all()
    trainer.optimizer.close()
    routers = sum(isinstance(m, Router) for c in trainer.chunks for m in c.modules())
    out["expert_params"] = sum(p.numel() for c in trainer.chunks for p in c.parameters() if is_expert(p))  # rank 0's
    reads: list = [None] * dist.get_world_size()
    dist.all_gather_object(reads, {"reads": out["host_reads"], "routers": routers})
    out["host_reads"] = reads  # per rank: the reads of each iteration, and the MoE layers it holds
    out["microbatches"] = cfg.num_microbatches  # per DP rank
    out["load_peak"] = load_peak
    out["largest_bucket_bytes"] = max(b.numel for dp in trainer.optimizer.data_parallel for b in dp.buckets) * 4
    return out


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    results = {run["name"]: train(run) for run in spec["runs"]}
    if dist.get_rank() == 0:
        with open(spec["out"], "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
