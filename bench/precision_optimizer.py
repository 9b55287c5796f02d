"""Benchmark: the precision-aware optimizer and FP8 primary weights against the fp32 optimizer, in one process.

The `tiny` preset trained on the demo corpus (scripts/demo.py builds it) for 50 iterations, same init and tokens
(bench/fp8.py's recipe), in pairs that differ only in what the optimizer stores:

    fp32 parameters:  fp32 moments  |  bf16 moments (nearest)  |  fp16 moments (per-parameter scale)
    bf16 parameters:  fp32 master + fp32 moments  |  bf16 master (stochastic rounding) + bf16 moments + bf16 grads
    FP8 (e4m3):       bf16 weights cast per GEMM  |  FP8 primary weights (--fp8-param-gather)

For each it prints the validation loss after the last iteration and its difference from the pair's baseline,
against the argued bound: every stored moment is rounded to nearest with relative error at most 2^-9 (bf16) or
2^-11 (fp16, scaled into range), so each AdamW update m / sqrt(v) moves by at most 1.5 x that, relative; to first
order the loss a run reaches changes by at most that fraction of how far it fell, (L_0 - L_T) x 1.5 x 2^-9 for bf16
moments, and we allow twice it for the second-order effects (moments that depend on the perturbed path). The
16-bit master's stochastic rounding adds zero-mean noise of half a bf16 unit per weight and step, which the same
bound is checked against (no first-order argument covers it: the figure is the measurement).

Not a test: tests/test_precision_optimizer.py checks a 20-iteration version in CI.

It also times one optimizer step over 4M owned elements: fp32 states against the precision-aware path (widen,
step, round back), for the cost of the rounding.

    .venv/bin/python bench/precision_optimizer.py [--iters 50] [--data demo_out] [--no-train]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
_spec = importlib.util.spec_from_file_location("bench_fp8", ROOT / "bench" / "fp8.py")
bench_fp8 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_fp8)

PA = ["--use-precision-aware-optimizer"]
BF16_MOMENTS = PA + ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
# name: (parameter dtype flags, extra flags, baseline name, relative rounding of a stored moment)
RUNS = {
    "fp32 optimizer": ((), [], None, 0.0),
    "bf16 moments": ((), BF16_MOMENTS, "fp32 optimizer", 2.0**-9),
    "fp16 moments": ((), PA + ["--exp-avg-dtype", "fp16", "--exp-avg-sq-dtype", "fp16"], "fp32 optimizer", 2.0**-11),
    "bf16, fp32 master": (("--bf16",), [], None, 0.0),
    "bf16 master + moments + grads": (
        ("--bf16",),
        BF16_MOMENTS + ["--main-params-dtype", "bf16", "--main-grads-dtype", "bf16"],
        "bf16, fp32 master",
        2.0**-9,
    ),
    "fp8 e4m3": (("--bf16",), ["--fp8-format", "e4m3"], None, 0.0),
    "fp8 primary weights": (
        ("--bf16",),
        ["--fp8-format", "e4m3", "--use-distributed-optimizer", "--fp8-param-gather"],
        "fp8 e4m3",
        0.0,
    ),
}


def time_step(numel: int, rounds: int) -> dict[str, float]:
    """Median seconds of one AdamW step over `numel` owned elements of one parameter: fp32 states on the storage
    itself, against the precision-aware path's widen, step and round back (bf16 moments; and a bf16 master with
    stochastic rounding), as shard_state.py runs them."""
    import statistics
    import time

    from torch.optim.adamw import adamw

    from tricorn.parallel.precision import from_storage, keyed_ranges, stochastic_store, to_storage

    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(numel, generator=gen) * 1e-3
    states = {"master": torch.randn(numel, generator=gen) * 0.02, "m": torch.zeros(numel), "v": torch.zeros(numel)}
    low = {
        "master": states["master"].bfloat16(),
        "m": torch.zeros(numel, dtype=torch.bfloat16),
        "v": torch.zeros(numel, dtype=torch.bfloat16),
    }
    ranges = keyed_ranges("w", torch.zeros(numel), 0, numel, 0)
    step = torch.tensor(0.0)

    def fp32() -> None:
        adamw([states["master"]], [grad], [states["m"]], [states["v"]], [], [step], fused=True, amsgrad=False,
              beta1=0.9, beta2=0.999, lr=1e-4, weight_decay=0.1, eps=1e-8, maximize=False)  # fmt: skip

    def aware(sr_master: bool) -> None:
        work = {k: torch.empty(numel) for k in ("m", "v")}
        for k in work:
            from_storage(low[k], work[k])
        master = low["master"].float() if sr_master else states["master"]
        adamw([master], [grad], [work["m"]], [work["v"]], [], [step], fused=True, amsgrad=False,
              beta1=0.9, beta2=0.999, lr=1e-4, weight_decay=0.1, eps=1e-8, maximize=False)  # fmt: skip
        for k in work:
            to_storage(work[k], low[k])
        if sr_master:
            stochastic_store(master, low["master"], ranges, seed=1, step=int(step))

    runs = {"fp32 states": fp32, "bf16 moments": lambda: aware(False), "bf16 moments + bf16 master": lambda: aware(True)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):  # the variants take turns, so machine noise hits them alike
        for name, run in runs.items():
            start = time.process_time()
            run()
            times[name].append(time.process_time() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def first_loss(workdir: Path) -> float:
    import json

    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in records if "loss" in r][0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--data", default="demo_out", help="scripts/demo.py's output directory (built if missing)")
    ap.add_argument("--only", nargs="*", help="names of RUNS to train (default: all)")
    ap.add_argument("--step-elements", type=int, default=1 << 22, help="owned elements of the timed optimizer step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-train", action="store_true", help="only time the step")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t = time_step(args.step_elements, args.rounds)
    print(f"one AdamW step over {args.step_elements:,} owned elements (CPU process time, median of {args.rounds}):")
    for name, seconds in t.items():
        print(f"  {name:28s} {seconds * 1e3:8.1f} ms  x{seconds / t['fp32 states']:.2f}")
    if args.no_train:
        return 0
    out = (ROOT / args.data).resolve()
    prefix = bench_fp8.demo_data(out)
    results: dict[str, tuple[float, float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (precision, extra, _base, _eps) in RUNS.items():
            if args.only and name not in args.only:
                continue
            loss, valid = bench_fp8.train_losses(prefix, out / "tokenizer.model", args.iters, extra, Path(tmp), precision)
            results[name] = (loss, valid, first_loss(Path(tmp)))
            print(f"  {name}: train {loss:.4f} validation {valid:.4f}", flush=True)
    print(f"\nvalidation loss after {args.iters} iterations on the demo corpus (tiny preset, one process):")
    for name, (_loss, valid, _first) in results.items():
        _precision, _extra, base, eps = RUNS[name]
        if base is None or base not in results:
            print(f"  {name:32s} {valid:.4f}")
            continue
        _b_loss, b_valid, b_first = results[base]
        bound = 2 * 1.5 * eps * (b_first - b_valid) if eps else None
        diff = valid - b_valid
        verdict = f"  bound {bound:.4f}: {'within' if abs(diff) <= bound else 'OUTSIDE'}" if bound else ""
        print(f"  {name:32s} {valid:.4f}  {diff:+.4f} against {base} ({valid / b_valid:.4f}x){verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
