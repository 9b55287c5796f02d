"""Benchmark: context-parallel attention at CP2 per --cp-comm-type, against one process on the whole sequence.

Two gloo ranks on CPU. For each comm type one attention layer (GQA, like Llama: 8 query heads over 2 key/value
heads, head dim 64, one sample of SEQ tokens, fp32) runs forward and backward on each rank's load-balanced
chunks; before that rank 0 alone runs the same layer on the whole sequence (model/spec.py sdpa_causal, torch's
fused CPU kernel), which is the baseline. Printed per comm type:

- tokens/s: SEQ / (the slower rank's best time of REPEATS), and its ratio to the single process's tokens/s
  (on a machine whose 2 ranks have a core each, an ideal split of causal work gives 2.0);
- comm bytes: what a rank sent in one forward + backward (isend payloads; all-to-all: the part that leaves the
  rank; all-gather / reduce-scatter: a ring's (p-1)/p of the full tensor), against the minimum of
  tricorn/planning/context_comm.py (p2p: 2(CP-1)N forward, 2(CP-1)N K/V + 2(CP-1)N dK/dV backward);
- peak attention-buffer bytes: the most bytes alive above the inputs during the step (tricorn.training.peak's
  tracker), beside the single process's, and the s_local x s fp32 scores a masked math call would need.

    .venv/bin/python bench/context_parallel.py [--seq 2048] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tricorn.config import ModelConfig  # noqa: E402
from tricorn.model.spec import sdpa_causal  # noqa: E402
from tricorn.parallel import tensor as tensor_mod  # noqa: E402
from tricorn.parallel.context import COMM_TYPES, context_parallel_attention, local_positions  # noqa: E402
from tricorn.planning.context_comm import cp_traffic  # noqa: E402
from tricorn.planning.layout import Layout  # noqa: E402
from tricorn.training.peak import PeakTracker  # noqa: E402

HEADS, GROUPS, DIM, REPEATS, CP = 8, 2, 64, 3, 2


class SentBytes:
    """Bytes this rank sends through the CP collectives while installed (a call inside a counted one is not counted)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._inside = False
        self._originals: dict = {}

    def _wrap(self, owner, name: str, count):
        original = getattr(owner, name)
        self._originals[(owner, name)] = original

        def counted(*args, **kwargs):
            if self._inside:
                return original(*args, **kwargs)
            self._inside = True
            try:
                self.total += count(*args, **kwargs)
                return original(*args, **kwargs)
            finally:
                self._inside = False

        setattr(owner, name, counted)

    def install(self) -> None:
        p = dist.get_world_size()
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        self._wrap(dist, "batch_isend_irecv", lambda ops: sum(nbytes(op.tensor) for op in ops if op.op is dist.isend))
        self._wrap(dist, "all_to_all_single", lambda out, x, *a, **k: nbytes(x) * (p - 1) / p)
        self._wrap(dist, "all_gather_single", lambda out, x, *a, **k: nbytes(out) * (p - 1) / p)
        self._wrap(tensor_mod, "reduce_scatter_single", lambda out, x, *a, **k: nbytes(x) * (p - 1) / p)

    def uninstall(self) -> None:
        for (owner, name), original in self._originals.items():
            setattr(owner, name, original)


def _inputs(seq: int, rows: torch.Tensor):
    torch.manual_seed(0)
    q, k, v = (torch.randn(seq, 1, n, DIM)[rows].permute(1, 2, 0, 3).contiguous() for n in (HEADS, GROUPS, GROUPS))
    grad = torch.randn(1, HEADS, len(rows), DIM)
    return [t.requires_grad_() for t in (q, k, v)], grad


def _step(attention, seq: int, rows: torch.Tensor, together: bool = True) -> tuple[float, int]:
    """(best seconds of REPEATS forward + backward, peak bytes above the inputs); `together`: both ranks start each."""
    best, peak = float("inf"), 0
    for _ in range(REPEATS):
        (q, k, v), grad = _inputs(seq, rows)
        tracker = PeakTracker(lambda: {}, existing=(q, k, v, grad))
        start_bytes = tracker.total
        if together:
            dist.barrier()
        t0 = time.perf_counter()
        with tracker:
            attention(q, k, v, None).backward(grad)
        best = min(best, time.perf_counter() - t0)
        peak = max(peak, tracker.peak_bytes - start_bytes)
    return best, peak


def worker(rank: int, port: int, seq: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=CP)
    results: dict = {}
    if rank == 0:  # the baseline alone: rank 1 waits in the barrier
        seconds, peak = _step(sdpa_causal, seq, torch.arange(seq), together=False)
        results["single"] = {"seconds": seconds, "peak_bytes": peak}
    dist.barrier()
    model = ModelConfig(
        num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS, num_query_groups=GROUPS, group_query_attention=True,
        seq_length=seq, max_position_embeddings=seq,
    )  # fmt: skip
    rows = local_positions(seq, rank, CP)
    for comm_type in COMM_TYPES:
        attention = context_parallel_attention(dist.group.WORLD, comm_type)
        counter = SentBytes()
        counter.install()
        _step(attention, seq, rows)  # warm-up, counted: one forward + backward per repeat
        counter.uninstall()
        seconds, peak = _step(attention, seq, rows)
        times = [torch.zeros(1) for _ in range(CP)]
        dist.all_gather(times, torch.tensor([seconds]))
        traffic = cp_traffic(model, Layout(cp=CP, cp_comm_type=comm_type, precision="fp32"))
        results[comm_type] = {
            "seconds": max(float(t) for t in times),
            "sent_bytes": counter.total / REPEATS,
            "minimum_bytes": traffic.minimum_bytes(4),
            "peak_bytes": peak,
        }
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(f"/tmp/tricorn-bench-cp-{os.getpid()}.json")
    mp.spawn(worker, args=(port, args.seq, str(out)), nprocs=CP)
    results = json.loads(out.read_text())
    out.unlink()
    if args.json:
        print(json.dumps(results))
        return
    single = results["single"]
    base_tps = args.seq / single["seconds"]
    squared = 4 * HEADS * (args.seq // CP) * args.seq
    print(f"CP{CP}, 1 sample x {args.seq} tokens, {HEADS} query / {GROUPS} key-value heads of {DIM}, fp32, CPU")
    print(f"single process: {base_tps:,.0f} tokens/s, peak attention buffers {single['peak_bytes'] / 2**20:.1f} MiB")
    print(f"(a masked math call's fp32 scores alone: {squared / 2**20:.1f} MiB per rank)")
    header = f"{'comm type':<10} {'tokens/s':>10} {'vs 1 proc':>9} {'sent MiB':>9} {'min MiB':>8} {'ratio':>6} {'peak MiB':>9}"
    print(header)
    for comm_type in COMM_TYPES:
        r = results[comm_type]
        tps = args.seq / r["seconds"]
        print(
            f"{comm_type:<10} {tps:>10,.0f} {tps / base_tps:>9.2f} {r['sent_bytes'] / 2**20:>9.2f} "
            f"{r['minimum_bytes'] / 2**20:>8.2f} {r['sent_bytes'] / r['minimum_bytes']:>6.2f} {r['peak_bytes'] / 2**20:>9.1f}"
        )


if __name__ == "__main__":
    main()
