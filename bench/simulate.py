"""Benchmark: the memory estimator against the real code at real size, for the planner's top layouts.

For each preset and GPU count, `tricorn plan` ranks the layouts; the top k (and the best-ranked ZeRO-3 layout,
so both ZeRO-2 and ZeRO-3 are covered when the planner has them) are simulated (tricorn/simulate.py: the real
build and one training iteration on fake tensors, one rank per pipeline-stage class), and the script prints
estimated / measured for the peak and each kind per rank, with the seconds each simulation took. The bound
the estimator is held to is 0.95-1.05. Not a test: CI never runs it (it takes minutes per 70B layout).

    .venv/bin/python bench/simulate.py [--top-k 3] [--only llama3-8b]
"""

from __future__ import annotations

import argparse
import time

from tricorn.config_args import config_from_args
from tricorn.plan_cli import verify
from tricorn.planning.hardware import get_gpu
from tricorn.planning.planner import plan
from tricorn.planning.step_time import Cluster
from tricorn.simulate import ratio

CASES = [("llama3-8b", 8), ("llama2-13b", 16), ("llama3-70b", 64)]  # the presets on 8, 16 and 64 H100s
GBS, SEQ = 64, 4096
KINDS = ("peak_bytes", "params_bytes", "grads_bytes", "master_params_bytes", "optimizer_state_bytes", "activations_bytes")


def model_of(name: str, gpus: int):
    return config_from_args(["--model-preset", name, "--seq-length", str(SEQ)], world_size=gpus).model


def layouts(name: str, gpus: int, top_k: int) -> list:
    gpu = get_gpu("h100-80gb")
    result = plan(model_of(name, gpus), Cluster(gpus, 8, gpu, gpu.peak_tflops("bf16"), 0.10), GBS, "bf16", top_k=10_000)
    chosen = result.plans[:top_k]
    zero3 = [p for p in result.plans if p.layout.zero_stage == 3]
    if zero3 and zero3[0] not in chosen:
        chosen.append(zero3[0])
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--top-k", type=int, default=3)
    ap.add_argument("--only", help="One preset of the list.")
    args = ap.parse_args()
    head = f"{'preset':<11}{'gpus':>5} {'#':>2} {'TP':>3}{'PP':>3}{'DP':>4}{'mb':>3} {'rec':<9}{'ZeRO':>5}{'rank':>5}{'pp':>3}"
    print(head + "".join(f"{k.removesuffix('_bytes')[:10]:>11}" for k in KINDS) + f"{'seconds':>9}")
    worst = 0.0  # largest |estimated / measured - 1| of a peak
    for name, gpus in CASES:
        if args.only and name != args.only:
            continue
        for i, p in enumerate(layouts(name, gpus, args.top_k), 1):
            lay = p.layout
            start = time.perf_counter()
            _, records = verify(name, model_of(name, gpus), p, gpus, GBS, "bf16")
            elapsed = time.perf_counter() - start
            for r in records:
                q = [ratio(r["estimated"][k], r["measured"][k]) for k in KINDS]
                worst = max(worst, abs(q[0] - 1))
                print(
                    f"{name:<11}{gpus:>5} {i:>2} {lay.tp:>3}{lay.pp:>3}{lay.dp:>4}{lay.micro_batch:>3} {lay.recompute or 'none':<9}"
                    f"{lay.zero_stage:>5}{r['rank']:>5}{r['pp_rank']:>3}"
                    + "".join(f"{x:11.3f}" for x in q)
                    + f"{r['measured']['seconds']:9.1f}"
                )
            print(f"{'':<11}{'':>5} {i:>2} layout simulated in {elapsed:.1f} s", flush=True)
    print(f"worst estimated/measured peak off by {worst:.1%} (bound 5%)")


if __name__ == "__main__":
    main()
