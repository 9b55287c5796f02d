"""Benchmark: the zero-bubble schedules' predicted iteration time from measured F, B and W, and P2P overlap.

1. Builds one real transformer layer (the trainer's tensor-parallel spec on a world of one, gloo, CPU) and
   times its forward (F), its input-gradient backward (B, the weight gradients queued by wgrad.py) and
   the deferred weight gradients (W), median over `--repeats`.
2. Feeds those times to the pipeline simulator (tricorn/parallel/pipeline/simulator.py, sends lazy as in
   the executor) for p = 4 stages of one layer each (zbv and dualpipev: two chunks of one layer per
   rank, so each chunk costs the measured times) and prints each schedule's predicted iteration time
   divided by 1F1B's, at m = 8 and m = 16 microbatches.
3. Runs the trainer at PP2 over 2 processes (gloo, CPU) with each schedule, once with P2P overlap (the
   executor: lazy sends, a rank waits only for its receives, and the next step's receives posted one
   compute early) and once with every batched step posted when reached and waited for as a whole (the
   executor before P2P overlap; here by patching p2p.PipelineP2P), and prints tokens/s (median over
   the iterations after the first). zbv and dualpipev run only with lazy sends: waiting for every send
   deadlocks them (the simulator shows where, tests/test_pipeline_zero_bubble.py). On a 2-core CPU shared
   with other work this is information only.

Not a test: CI never times anything.

    .venv/bin/python bench/pipeline.py [--hidden 256] [--seq 256] [--micro 2] [--repeats 5] [--iters 6]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_fbw(hidden: int, seq: int, micro: int, repeats: int) -> tuple[float, float, float]:
    """Median seconds of F, B and W of one transformer layer."""
    import torch
    import torch.distributed as dist

    from tricorn.config_args import config_from_args
    from tricorn.model.transformer import GPTModel
    from tricorn.parallel import wgrad
    from tricorn.parallel.tensor import tensor_parallel_spec

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    heads = max(1, hidden // 64)
    argv = (
        f"--device cpu --mock-data --vocab-size 512 --num-layers 1 --hidden-size {hidden} --num-attention-heads {heads} "
        f"--seq-length {seq} --max-position-embeddings {seq} --micro-batch-size {micro}"
    ).split()
    cfg = config_from_args(argv, world_size=1)
    spec = tensor_parallel_spec(cfg, dist.group.WORLD)
    model = GPTModel(cfg.model, spec, layer_ids=range(1), pre_process=False, post_process=False, padded_vocab_size=512)
    model.init_weights(0)
    x = torch.randn(seq, micro, hidden)
    grad = torch.randn(seq, micro, hidden)
    times: dict[str, list[float]] = {"F": [], "B": [], "W": []}
    for _ in range(repeats + 1):  # the first round warms up
        store = wgrad.WeightGradStore()
        inp = x.clone().requires_grad_()
        with store.collecting():
            t0 = time.perf_counter()
            out = model(inp)
            t1 = time.perf_counter()
            with store.backward_input((0, 0)):
                torch.autograd.backward(out, grad)
            t2 = time.perf_counter()
            store.run((0, 0))
            t3 = time.perf_counter()
        for k, v in zip("FBW", (t1 - t0, t2 - t1, t3 - t2)):
            times[k].append(v)
    dist.destroy_process_group()
    return tuple(statistics.median(times[k][1:]) for k in "FBW")


def predicted_ratios(f: float, b: float, w: float, pp: int = 4) -> dict[int, dict[str, float]]:
    from tricorn.parallel.pipeline.schedules import placement_of, schedule_for
    from tricorn.parallel.pipeline.simulator import Costs, simulate

    costs = Costs(
        Fraction(f).limit_denominator(10**9), Fraction(b + w).limit_denominator(10**9), 0, Fraction(w).limit_denominator(10**9)
    )
    out = {}
    for m in (8, 16):
        spans = {}
        for kind, v in (("1f1b", 1), ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2)):
            # The V's ranks hold 2 chunks of one layer each: twice the work of a 1F1B rank of one layer.
            result = simulate(schedule_for(pp, v, m, kind), pp, v, costs, placement_of(kind), lazy_sends=True)
            spans[kind] = float(result.makespan) / v
        out[m] = {k: s / spans["1f1b"] for k, s in spans.items()}
    return out


_BLOCKING = """
import sys, runpy
import tricorn.parallel.pipeline.p2p as p2p
_exchange = p2p.PipelineP2P.exchange
def exchange(self, step, outgoing, ahead=(), release=None):
    # The executor before P2P overlap: no receive posted early, every step waited for as a whole.
    received = _exchange(self, step, outgoing, (), release)
    self.complete_sends()
    return received
p2p.PipelineP2P.exchange = exchange
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_pp2(kind: str, lazy: bool, hidden: int, seq: int, micro: int, iters: int) -> float:
    """Median tokens/s of the trainer at PP2 over 2 processes (iterations after the first)."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        flags = (
            f"--device cpu --mock-data --vocab-size 512 --num-layers 4 --hidden-size {hidden} --num-attention-heads "
            f"{max(1, hidden // 64)} --seq-length {seq} --max-position-embeddings {seq} --micro-batch-size {micro} "
            f"--global-batch-size {micro * 8} --train-iters {iters} --lr 1e-4 --log-interval 1 "
            f"--pipeline-model-parallel-size 2 --pipeline-schedule {kind} --untie-embeddings-and-output-weights "
            f"--metrics-file {metrics}"
        ).split()
        entry = [str(ROOT / "pretrain_gpt.py"), *flags]
        cmd = [sys.executable, *entry] if lazy else [sys.executable, "-c", _BLOCKING, *entry]
        port = _free_port()
        procs = []
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
            env.update(MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
            procs.append(subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        errs = [p.communicate()[1] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{kind} lazy={lazy} failed:\n{errs[0][-2000:]}{errs[1][-2000:]}")
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        return statistics.median(r["tokens_per_sec"] for r in records[1:] if "tokens_per_sec" in r)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=6)
    args = ap.parse_args()
    print(f"load average at the start (1, 5, 15 min): {os.getloadavg()}", flush=True)
    f, b, w = measure_fbw(args.hidden, args.seq, args.micro, args.repeats)
    print(
        f"one layer (hidden {args.hidden}, seq {args.seq}, micro {args.micro}) on CPU: F {f * 1e3:.2f} ms, B {b * 1e3:.2f} ms, W {w * 1e3:.2f} ms",
        flush=True,
    )
    for m, ratios in predicted_ratios(f, b, w).items():
        print(
            f"p=4 m={m}: predicted iteration time / 1F1B's: " + ", ".join(f"{k} {r:.3f}" for k, r in ratios.items()), flush=True
        )
    for kind in ("1f1b", "zb-h1", "zbv", "dualpipev"):
        lazy = run_pp2(kind, True, args.hidden, args.seq, args.micro, args.iters)
        if kind in ("zbv", "dualpipev"):
            print(f"PP2 {kind}: tokens/s with P2P overlap {lazy:.0f}; without it the schedule deadlocks", flush=True)
            continue
        blocking = run_pp2(kind, False, args.hidden, args.seq, args.micro, args.iters)
        print(
            f"PP2 {kind}: tokens/s with P2P overlap {lazy:.0f}, without {blocking:.0f}, ratio {lazy / blocking:.3f}",
            flush=True,
        )
    print(f"load average at the end (1, 5, 15 min): {os.getloadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
