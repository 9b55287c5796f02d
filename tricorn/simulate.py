"""`tricorn simulate`: run the real trainer at real size without a GPU, measure each rank's peak, beside the estimate.

    tricorn simulate --model-preset llama2-70b --bf16 --tensor-model-parallel-size 4 \\
        --pipeline-model-parallel-size 8 --sequence-parallel --use-distributed-optimizer \\
        --micro-batch-size 1 --global-batch-size 16 --seq-length 4096 --world-size 64 [--json]

Same flags as pretrain_gpt.py, plus --world-size N, --ranks (a comma list of world ranks, or ``all``;
default: one rank of each pipeline stage class - the first, the middle and the last stage) and
--simulate-iters K (default 2). For each simulated rank, in turn, in this process: the fake process-group
backend (torch's ``fake``: every collective returns at once) is set up as that rank of a world of N, and the
code users run builds and trains under FakeTensorMode (tensors with shapes, dtypes and storage sizes but no
data, so 70B costs no memory): the process mesh, the model chunks (built hollow, only the local shards
materialised), parallel layers, recompute, optimizer and ZeRO, the pipeline schedule, and K training
iterations. Only what needs values is synthetic, from outside the trainer: the data loader yields
all-zero batches, and every value read on the host (``.item()``: the loss, the grad norm, the fp16
overflow flag) reads 0, so no step is skipped and the NaN check passes. A mixture of experts routes
balanced (moe.balanced_routing: T*k/E token copies per expert, at most the capacity), so each rank
builds only its E/EP experts and runs them, and the all_to_alls, at their expected sizes.

Measured during iteration 1 (training/peak.py): the peak bytes and the split by kind at the peak; after it:
the steady-state model-state bytes (memory_report.measure) and the bytes one transformer layer saves for
backward for one microbatch (training/activation_probe.py). Estimated: the memory estimator's numbers for
the same pipeline stage on the CPU (planning/memory.py: the CPU's activation profile, no CUDA context).
--json prints a list of records: rank, pp_rank, tp_rank, cp_rank, dp_rank and two dicts, measured and
estimated, with peak_bytes, params_bytes, grads_bytes, master_params_bytes, optimizer_state_bytes,
activations_bytes (all at the peak) and activation_bytes_per_layer, plus model_state_bytes (steady state)
and seconds (the simulation's wall time).

The fake backend is initialised here and nowhere else; each rank's group is destroyed before the next.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tricorn.config import Config, ConfigError
from tricorn.config_args import build_parser
from tricorn.data.base import Batch
from tricorn.planning.hardware import GiB
from tricorn.planning.layout import Layout
from tricorn.planning.memory import estimate

KEYS = (
    "peak_bytes",
    "params_bytes",
    "grads_bytes",
    "master_params_bytes",
    "optimizer_state_bytes",
    "activations_bytes",
    "activation_bytes_per_layer",
)


class SimulationMode(FakeTensorMode):
    """FakeTensorMode in which a value read on the host (``.item()``, ``bool(t)``) is 0: no real data exists
    (except in the small tensors FakeTensorMode tracks as constants)."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # A fake tensor made from a Python number (AdamW's step count) still knows its value: use it.
        if func is torch.ops.aten._local_scalar_dense.default and getattr(args[0], "constant", None) is None:
            return False if args[0].dtype == torch.bool else 0
        return super().__torch_dispatch__(func, types, args, kwargs)


class SyntheticLoader:
    """The loader contract (data/base.py) with all-zero tokens: the shapes of real data, none of its cost."""

    def __init__(self, cfg: Config, dp_size: int):
        self.seq_length = cfg.model.seq_length
        self.dp_size = dp_size
        self.consumed_samples = 0

    def next(self, global_batch_size: int) -> Batch:
        per_rank = global_batch_size // self.dp_size
        self.consumed_samples += global_batch_size
        ids = torch.zeros(per_rank, self.seq_length, dtype=torch.long)
        return Batch(ids, ids.clone(), torch.ones(per_rank, self.seq_length))


# ---------------------------------------------------------------- which ranks


def grid_coords(cfg: Config, rank: int) -> dict[str, int]:
    """pp/dp/cp/tp coordinates of world `rank` (the mesh is (pp, dp, cp, tp), TP innermost: parallel/state.py)."""
    p = cfg.parallel
    rest, tp = divmod(rank, p.tensor_model_parallel_size)
    rest, cp = divmod(rest, p.context_parallel_size)
    pp, dp = divmod(rest, cfg.data_parallel_size)
    return {"pp_rank": pp, "tp_rank": tp, "cp_rank": cp, "dp_rank": dp}


def default_ranks(cfg: Config) -> list[int]:
    """One rank per class: the first, middle and last pipeline stage (DP, CP and TP rank 0).

    Ranks that differ only in their TP, CP or DP coordinate hold the same shapes (vocabulary padding and DP
    bucket padding are equal by construction), so the pipeline stage is what tells classes apart.
    """
    pp = cfg.parallel.pipeline_model_parallel_size
    per_stage = cfg.world_size // pp
    return [stage * per_stage for stage in sorted({0, pp // 2, pp - 1})]


def parse_ranks(text: Optional[str], cfg: Config) -> list[int]:
    if text is None:
        return default_ranks(cfg)
    if text == "all":
        return list(range(cfg.world_size))
    try:
        ranks = sorted({int(r) for r in text.split(",")})
    except ValueError:
        raise ConfigError(f"--ranks {text}: give world ranks separated by commas (e.g. 0,7,63) or 'all'") from None
    bad = [r for r in ranks if not 0 <= r < cfg.world_size]
    if bad:
        raise ConfigError(f"--ranks {text}: rank {bad[0]} is outside the world of {cfg.world_size} ranks")
    return ranks


# ---------------------------------------------------------------- one rank


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """This process as `rank` of a fake process group (no peers; collectives return at once), torn down after."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure_rank(cfg: Config, rank: int, iters: int) -> dict:
    """Build and train `iters` iterations as world rank `rank` on fake tensors; what iteration 1 used."""
    from tricorn.model.moe import balanced_routing
    from tricorn.parallel.state import init_parallel
    from tricorn.training.activation_probe import trainer_report_entry
    from tricorn.training.loop import Trainer
    from tricorn.training.main import build
    from tricorn.training.memory_report import iteration_peak, measure

    with fake_world(rank, cfg.world_size):
        state = init_parallel(cfg)
        with SimulationMode(), balanced_routing():
            chunks, optimizer, forward_backward = build(cfg, state)
            loader = SyntheticLoader(cfg, state.dp_size)
            trainer = Trainer(cfg, state, chunks, optimizer, loader, None, None, forward_backward)
            with iteration_peak(optimizer, chunks, state.device) as peak:
                trainer.run_iteration()
            steady = measure(optimizer.memory_tensors(), state.device)
            saved = trainer_report_entry()
            for _ in range(iters - 1):
                trainer.run_iteration()
    out = {key: peak[key if key == "peak_bytes" else f"peak_{key}"] for key in KEYS if key != "activation_bytes_per_layer"}
    out |= {"activation_bytes_per_layer": saved.get("activation_bytes_per_layer", 0.0), "iterations": iters}
    out["model_state_bytes"] = sum(v for k, v in steady.items() if k != "host_bytes")
    return out


def estimated(cfg: Config, pp_rank: int) -> dict:
    """The estimator's numbers for pipeline stage `pp_rank`, on the CPU as the simulation runs."""
    layout = Layout.from_config(cfg)
    est = estimate(cfg.model, Layout(**{**layout.__dict__, "device": "cpu"}), stages=(pp_rank,))
    out = est.peak_by_kind() | {"activation_bytes_per_layer": est.activation_bytes_per_layer}
    out["model_state_bytes"] = est.model_state_bytes
    return out


def simulate(cfg: Config, ranks: list[int], iters: int = 2) -> list[dict]:
    """One record per rank (module docstring), in rank order."""
    records = []
    for rank in ranks:
        start = time.perf_counter()
        measured = measure_rank(cfg, rank, iters)
        coords = grid_coords(cfg, rank)
        measured["seconds"] = round(time.perf_counter() - start, 2)
        records.append({"rank": rank, **coords, "measured": measured, "estimated": estimated(cfg, coords["pp_rank"])})
    return records


# ---------------------------------------------------------------- command line


def _extra_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--world-size", type=int, help="Ranks of the simulated job (default: TP x PP x CP, i.e. DP = 1).")
    p.add_argument("--ranks", help="World ranks to simulate, comma-separated, or 'all' (default: one per class).")
    p.add_argument("--simulate-iters", type=int, default=2, help="Training iterations per rank (default 2).")
    p.add_argument("--json", action="store_true", help="Print a JSON list of records.")
    return p


def config_for_simulation(argv: list[str], world_size: Optional[int]) -> Config:
    """pretrain_gpt.py's flags for a simulation: validated like an estimate (no data needed), run on the CPU."""
    from tricorn.planning.estimate import config_for_estimate

    cfg = config_for_estimate(argv, world_size)
    cfg.device = "cpu"
    return cfg


def ratio(est: float, meas: float) -> float:
    """estimated / measured; 1.0 when both are 0."""
    if meas == 0:
        return 1.0 if est == 0 else float("inf")
    return est / meas


def format_table(records: list[dict]) -> str:
    rows = [f"{'rank':>5} {'pp':>3} {'tp':>3} {'cp':>3} {'dp':>3}  {'kind':<22}{'measured':>14}{'estimated':>14}{'est/meas':>10}"]
    labels = {k: k.removesuffix("_bytes") for k in (*KEYS, "model_state_bytes")}
    for r in records:
        head = f"{r['rank']:5d} {r['pp_rank']:3d} {r['tp_rank']:3d} {r['cp_rank']:3d} {r['dp_rank']:3d}  "
        for i, key in enumerate((*KEYS, "model_state_bytes")):
            m, e = r["measured"][key], r["estimated"][key]
            rows.append(
                f"{head if i == 0 else ' ' * len(head)}{labels[key]:<22}{m / GiB:10.3f} GiB{e / GiB:10.3f} GiB{ratio(e, m):10.3f}"
            )
        rows.append(f"{'':{len(head)}}simulated in {r['measured']['seconds']:.1f} s")
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        extra = _extra_parser().format_help().split("\n", 2)[-1]
        print(build_parser("tricorn simulate").format_help() + "\nsimulate:\n" + extra)
        return 0
    extra, rest = _extra_parser().parse_known_args(argv)
    try:
        if extra.simulate_iters < 1:
            raise ConfigError("--simulate-iters must be at least 1")
        cfg = config_for_simulation(rest, extra.world_size)
        ranks = parse_ranks(extra.ranks, cfg)
    except (ConfigError, ValueError) as e:
        print(f"tricorn simulate: error: {e}", file=sys.stderr)
        return 2
    if cfg.megatron_notice:  # a Megatron command line: its no-ops, in one line
        print(f"tricorn simulate: {cfg.megatron_notice}", file=sys.stderr)
    records = simulate(cfg, ranks, extra.simulate_iters)
    print(json.dumps(records, indent=1) if extra.json else format_table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
