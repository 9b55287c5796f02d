"""Benchmark: bytes each process group moves in one training iteration, beside the theoretical minimum.

Each layout runs as N gloo processes on CPU (tiny model). After a warm-up
iteration, every torch.distributed collective of the next iteration is counted
per process group as *bus bytes per rank* - what a ring algorithm moves:

    all-reduce of n bytes        2 (p-1)/p n
    reduce-scatter (input n)     (p-1)/p n
    all-gather (output n)        (p-1)/p n

so a reduce-scatter plus an all-gather of the same buffer equals one all-reduce.
Theoretical minimum per layout:

    DP (DDP)                   one all-reduce of the gradients
    DP (distributed optimizer) reduce-scatter of the gradients + all-gather of the parameters
                               (also the yardstick for ZeRO-2/3, which trade volume for memory); with
                               --fp8-param-gather the linears' weights gather 1 byte an element, plus the
                               all-reduce of their amaxes (one fp32 per weight) over TP x DP x CP
    TP (Megatron, no SP)       per microbatch 4L+2 all-reduces of [b, s, h] activations (2 per layer
                               forward and backward, the embedding output, the head input's gradient)
                               plus the vocab-parallel loss's 3 fp32 [b, s] all-reduces
    TP with SP                 the same volume as reduce-scatters/all-gathers (+ the SP norm grads)
    EP (MoE all_to_all)        hidden-state bytes sent to other ranks: each token once per other rank
                               holding one of its experts, there and back, forward and backward (the
                               routing decides it, so each dispatch adds up its own minimum:
                               tricorn.parallel.expert.A2A_COUNTER). all_to_all counts the bytes a rank
                               sends off-rank (no ring factor); the EP rows sum the whole ep group (a
                               rank's combine returns other ranks' tokens). Row "ep": the hidden
                               states; row "ep+routing": also the routing weights riding along (E/EP
                               fp32 per row, and their gradients), the [EP, 1 + E/EP] count exchange
                               and the grad norm's scalar all-reduce.
    CP (attention, per layer   --cp-comm-type's minimum (tricorn/planning/context_comm.py): p2p and
    and microbatch)            allgather 2(CP-1)N forward and 4(CP-1)N backward elements (N = b s/CP h_kv d;
                               the ring's isends counted as sent), a2a (CP-1)/CP (2Q + 2N) each way

The data-parallel rows sum the DP and DP x CP groups (the trainer's token-count
and loss scalars ride on them too). Goal: ratio 1.00.

    .venv/bin/python bench/comm_volume.py [--json] [--only EP]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGS = (
    "--device cpu --mock-data --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 4 --train-iters 3 --lr 1e-3 "
    "--vocab-size 500 --log-interval 1000"
).split()
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "DP=4 DDP": (4, []),
    "DP=4 distributed optimizer": (4, ["--use-distributed-optimizer"]),
    # ZeRO-2 reduce-scatters every microbatch (2 here) and ZeRO-3 gathers parameters for forward and
    # backward: their ratios against the ZeRO-1 minimum show what the memory saving costs.
    "DP=4 ZeRO-2, 2 microbatches": (4, ["--zero-stage", "2", "--global-batch-size", "8"]),
    "DP=4 ZeRO-3": (4, ["--zero-stage", "3"]),
    # FP8 GEMMs with bf16 weights against FP8 primary weights: the parameter all-gather moves the linears' weights
    # in FP8, half of bf16's bytes (the per-step amax all-reduce, one fp32 per weight, rides on the dp row).
    "DP=4 dist-opt FP8 GEMMs": (4, ["--use-distributed-optimizer", "--bf16", "--fp8-format", "e4m3"]),
    "DP=4 dist-opt FP8 weights": (4, ["--use-distributed-optimizer", "--bf16", "--fp8-format", "e4m3", "--fp8-param-gather"]),
    "TP=2": (2, ["--tensor-model-parallel-size", "2"]),
    "TP=2 SP": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "CP=2 p2p": (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    "CP=2 a2a": (2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
    "CP=2 allgather": (2, ["--context-parallel-size", "2", "--cp-comm-type", "allgather"]),
    "DP=4 EP=4 MoE 8 experts top-2": (
        4,
        "--num-experts 8 --moe-router-topk 2 --disable-bias-linear --expert-model-parallel-size 4".split(),
    ),
}
# factor of the payload a ring moves per rank, in units of (p-1)/p
RING = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1, "all_to_all": 1}
# function -> (kind, position of its `group` argument)
COLLECTIVES = {
    "all_reduce": ("all_reduce", 2),
    "reduce_scatter_single": ("reduce_scatter", 3),
    "all_gather_single": ("all_gather", 2),
    "all_gather": ("all_gather", 2),
    "broadcast": ("broadcast", 2),
    "all_to_all_single": ("all_to_all", 4),  # MoE dispatch; the TP/SP reduce-scatter on gloo (parallel/tensor.py)
}


# ---------------------------------------------------------------- worker side


@dataclass
class Counter:
    names: dict[int, str]
    hidden: int = 0  # all_to_alls of rows this wide on the ep group are hidden states, the rest routing data
    bus_bytes: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    originals: dict = field(default_factory=dict)
    local: threading.local = field(default_factory=threading.local)

    def install(self) -> None:
        import torch.distributed as dist

        for fn_name, (kind, group_at) in COLLECTIVES.items():
            original = getattr(dist, fn_name)
            self.originals[fn_name] = original
            setattr(dist, fn_name, self._wrap(original, kind, group_at))
        self.originals["batch_isend_irecv"] = original = dist.batch_isend_irecv
        dist.batch_isend_irecv = self._point_to_point(original)

    def _point_to_point(self, original):
        """batch_isend_irecv (CP's ring): the bytes each isend sends, on its group."""
        import torch.distributed as dist

        def counted(ops):
            for op in ops:
                if op.op is dist.isend:
                    name = self.names.get(id(op.group if op.group is not None else dist.group.WORLD), "other")
                    self.calls[name] = self.calls.get(name, 0) + 1
                    self.bus_bytes[name] = self.bus_bytes.get(name, 0.0) + op.tensor.numel() * op.tensor.element_size()
            return original(ops)

        return counted

    def uninstall(self) -> None:
        import torch.distributed as dist

        for fn_name, original in self.originals.items():
            setattr(dist, fn_name, original)

    def _wrap(self, original, kind: str, group_at: int):
        def counted(*args, **kwargs):
            if getattr(self.local, "inside", False):  # a deprecated alias calling the new name: count once
                return original(*args, **kwargs)
            self.local.inside = True
            try:
                group = kwargs.get("group", args[group_at] if len(args) > group_at else None)
                self._count(kind, group, args, kwargs)
                return original(*args, **kwargs)
            finally:
                self.local.inside = False

        return counted

    def _count(self, kind: str, group, args: tuple, kwargs: dict) -> None:
        import torch
        import torch.distributed as dist

        p = dist.get_world_size(group)
        tensors = [a for a in (*args[:2], *kwargs.values()) if isinstance(a, torch.Tensor)]
        lists = [a for a in args[:2] if isinstance(a, list)]
        if kind == "all_to_all":  # all_to_all_single(out, in, out_splits, in_splits): what goes to other ranks
            source = args[1] if len(args) > 1 else kwargs["input"]
            splits = (args[3] if len(args) > 3 else kwargs.get("input_split_sizes")) or [source.shape[0] // p] * p
            row = source[0].numel() * source.element_size() if source.ndim and source.shape[0] else 0
            mine = splits[dist.get_rank(group)]
            name = self.names.get(id(group), "other")
            if name == "ep" and (source.ndim < 2 or source.shape[-1] != self.hidden):
                name = "ep_routing"  # routing weights and counts
            self.calls[name] = self.calls.get(name, 0) + 1
            self.bus_bytes[name] = self.bus_bytes.get(name, 0.0) + (sum(splits) - mine) * row
            return
        if kind == "all_gather" and lists:  # all_gather(list_of_outputs, tensor)
            payload = sum(t.numel() * t.element_size() for t in lists[0])
        elif kind in ("reduce_scatter", "all_gather", "all_to_all"):
            payload = max(t.numel() * t.element_size() for t in tensors)  # the full-size side
        else:
            payload = tensors[0].numel() * tensors[0].element_size()
        name = self.names.get(id(group if group is not None else dist.group.WORLD), "other")
        if name == "ep":  # the grad norm's scalar sum over the experts' ranks
            name = "ep_routing"
        if name == "cp" and kind == "all_reduce":  # at DP 1 the DP x CP group is the CP group: CP attention never all-reduces
            name = "dp_cp"
        self.calls[name] = self.calls.get(name, 0) + 1
        self.bus_bytes[name] = self.bus_bytes.get(name, 0.0) + RING[kind] * (p - 1) / p * payload


def group_names(state, optimizer=None) -> dict[int, str]:
    import torch.distributed as dist

    names: dict[int, str] = {}
    for name in ("tp", "pp", "dp", "cp", "dp_cp", "mp", "embedding", "ep", "expert_dp"):
        group = getattr(state, f"{name}_group")
        if group is not None:
            names.setdefault(id(group), name)
    stage = getattr(optimizer, "stage_group", None)  # TP x DP x CP: FP8 weights' and fp16 moments' amaxes
    if stage is not None:
        names.setdefault(id(stage), "stage")
    names.setdefault(id(dist.group.WORLD), "world")
    return names


def theory(cfg, state, optimizer, ep_minimum: float = 0.0) -> dict[str, float]:
    """Minimum bus bytes per rank for this layout, by row ('dp', 'tp' or 'ep'; `ep_minimum`: the dispatches' forward)."""
    import torch
    import torch.distributed as dist

    out: dict[str, float] = {}
    from tricorn.model.init import is_expert

    params = optimizer.params
    grad_bytes = torch.finfo(optimizer.opts.grad_dtype).bits // 8
    param_bytes = params[0].element_size()
    fp8 = [q for q in params if getattr(q, "fp8_primary", False)]  # FP8 primary weights gather 1 byte an element
    p = state.dp_size * state.cp_size
    # MoE experts are reduced over their expert-DP group only (DP x CP / EP ranks).
    ep = cfg.parallel.expert_model_parallel_size
    for size, numel in (
        (p, sum(q.numel() for q in params if not is_expert(q))),
        (p // ep, sum(q.numel() for q in params if is_expert(q))),
    ):
        if size > 1 and numel:
            grad_volume = numel * grad_bytes
            if optimizer.opts.distributed:
                fp8_saving = sum(q.numel() for q in fp8 if not is_expert(q)) * (param_bytes - 1) if size == p else 0
                out["dp"] = out.get("dp", 0.0) + (size - 1) / size * (grad_volume + numel * param_bytes - fp8_saving)
            else:
                out["dp"] = out.get("dp", 0.0) + 2 * (size - 1) / size * grad_volume
    stage = getattr(optimizer, "stage_group", None)
    if fp8 and stage is not None and dist.get_world_size(stage) > 1:  # the FP8 weights' amaxes, one fp32 each
        q = dist.get_world_size(stage)
        out["dp"] = out.get("dp", 0.0) + 2 * (q - 1) / q * 4 * len(fp8)
    if ep_minimum:  # dispatch and combine, forward and backward (the gradients of the same rows go back)
        out["ep"] = out["ep+routing"] = 4 * ep_minimum
    if state.cp_size > 1:  # CP attention per layer and microbatch (tricorn/planning/context_comm.py's minimum)
        from tricorn.planning.context_comm import cp_traffic
        from tricorn.planning.layout import Layout

        traffic = cp_traffic(cfg.model, Layout.from_config(cfg))
        out["cp"] = traffic.minimum_bytes(param_bytes) * cfg.model.num_layers * cfg.num_microbatches
    t = state.tp_size
    if t > 1:
        m, tr = cfg.model, cfg.training
        tokens = tr.micro_batch_size * m.seq_length
        activation = tokens * m.hidden_size * param_bytes
        per_microbatch = (4 * m.num_layers + 2) * activation + 3 * tokens * 4
        out["tp"] = 2 * (t - 1) / t * per_microbatch * cfg.num_microbatches
        if cfg.parallel.sequence_parallel:  # norm weights (and row biases) see a sequence shard: their grads are summed
            sp = sum(q.numel() for q in params if getattr(q, "sequence_parallel", False))
            out["tp"] += 2 * (t - 1) / t * sp * grad_bytes
    return out


def worker(layout: str) -> None:
    import torch.distributed as dist

    from tricorn.parallel.state import destroy_parallel, init_parallel
    from tricorn.training.logging import MetricsLogger
    from tricorn.training.main import build_trainer, resolve_config

    cfg = resolve_config(FLAGS + LAYOUTS[layout][1])
    state = init_parallel(cfg)
    trainer = build_trainer(cfg, state, MetricsLogger(cfg, rank=1), with_validation=False)
    trainer.run_iteration()  # warm-up: first-iteration-only work is not counted
    from tricorn.parallel import expert

    counter = Counter(group_names(state, trainer.optimizer), hidden=cfg.model.hidden_size)
    counter.install()
    expert.A2A_COUNTER[0] = {"minimum": 0}
    try:
        trainer.run_iteration()
    finally:
        counter.uninstall()
    ep_minimum = expert.A2A_COUNTER[0]["minimum"]
    rows = [None] * state.world_size
    mine = {"bus_bytes": counter.bus_bytes, "calls": counter.calls, "theory": theory(cfg, state, trainer.optimizer, ep_minimum)}
    dist.all_gather_object(rows, mine)
    if state.rank == 0:
        print("RESULT " + json.dumps({"ranks": rows, "theory": rows[0]["theory"]}), flush=True)
    destroy_parallel()


# ---------------------------------------------------------------- driver side


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(layout: str) -> dict:
    nproc = LAYOUTS[layout][0]
    port = _free_port()
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank)}
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
        cmd = [sys.executable, __file__, "--worker", layout]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"comm_volume: layout '{layout}' failed:\n{err[-2000:]}")
    line = next(x for x in outs[0][0].splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def summarize(layout: str, result: dict) -> list[dict]:
    """One row per parallel dimension: the busiest rank's bytes beside the minimum."""
    rows = []
    groups = {
        "dp": ("dp", "dp_cp", "expert_dp", "stage"),
        "tp": ("tp", "mp"),
        "cp": ("cp",),
        "ep": ("ep",),
        "ep+routing": ("ep", "ep_routing"),
    }
    for row, minimum in result["theory"].items():
        if row.startswith("ep"):  # routing differs per rank: the whole group's bytes against the whole group's minimum
            moved = sum(r["bus_bytes"].get(g, 0.0) for r in result["ranks"] for g in groups[row])
            minimum = sum(r["theory"][row] for r in result["ranks"])
        else:
            moved = max(sum(r["bus_bytes"].get(g, 0.0) for g in groups[row]) for r in result["ranks"])
        calls = max(sum(r["calls"].get(g, 0) for g in groups[row]) for r in result["ranks"])
        rows.append(
            {"layout": layout, "group": row, "calls": calls, "bytes": moved, "minimum": minimum, "ratio": moved / minimum}
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--only", default="", help="run only the layouts whose name contains this (e.g. EP)")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    rows = [row for layout in LAYOUTS if args.only in layout for row in summarize(layout, run_layout(layout))]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'layout':<30} {'group':<10} {'calls':>6} {'bus bytes/rank':>15} {'minimum':>12} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['layout']:<30} {r['group']:<10} {r['calls']:>6} {r['bytes']:>15,.0f} {r['minimum']:>12,.0f} {r['ratio']:>6.3f}"
        )


if __name__ == "__main__":
    main()
