"""Benchmark: native FP8 (tricorn/parallel/fp8.py) against bf16, in one process.

1. Loss: the `tiny` preset trained on the demo corpus (scripts/demo.py builds it: the standard library's
   .py files, a sentencepiece tokenizer, Megatron .bin/.idx) for 50 iterations in bf16 and in FP8
   (e4m3 tensorwise, and hybrid rowwise), same init and tokens; prints the mean training loss of the last 10
   iterations and the validation loss of each, and their ratio to bf16.
2. Time: forward + backward of one linear (tokens x in -> out) in bf16 and through the FP8 GEMMs; prints
   the median of each and the ratio. On a CPU the FP8 GEMM is a dequantised fp32 GEMM (fp8.dequantised_mm),
   so the ratio is information, not a goal; on an H100 FP8 runs at twice bf16's peak.

Not a test: CI never times anything.

    .venv/bin/python bench/fp8.py [--iters 50] [--data demo_out] [--tokens 4096 --in-features 1024 --out-features 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tricorn.parallel.fp8 import FP8Recipe  # noqa: E402
from tricorn.training.main import main as train  # noqa: E402

RUNS = {
    "bf16": [],
    "fp8 e4m3 tensorwise": ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"],
    "fp8 hybrid rowwise": ["--fp8-format", "hybrid", "--fp8-recipe", "rowwise"],
}


def demo_data(out: Path) -> Path:
    """The demo corpus's .bin/.idx prefix, built by scripts/demo.py (one training iteration) if missing."""
    if not (out / "stdlib_text_document.idx").exists():
        subprocess.run([sys.executable, "scripts/demo.py", "--out", str(out), "--train-iters", "1"], cwd=ROOT, check=True)
    return out / "stdlib_text_document"


def train_losses(
    prefix: Path, tokenizer: Path, iters: int, extra: list[str], workdir: Path, precision: tuple[str, ...] = ("--bf16",)
) -> tuple[float, float]:
    """(mean training loss of the last 10 iterations, validation loss after the last); ``precision``: the
    parameters' dtype flag (none: fp32). bench/precision_optimizer.py trains through this too."""
    metrics = workdir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    argv = [
        "--device", "cpu", "--model-preset", "tiny", *precision, "--data-path", str(prefix), "--split", "95,5,0",
        "--data-cache-path", str(workdir / "cache"), "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", str(tokenizer), "--seq-length", "256", "--micro-batch-size", "4",
        "--global-batch-size", "16", "--train-iters", str(iters), "--lr", "2e-3", "--min-lr", "2e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "10", "--weight-decay", "0.1",
        "--eval-interval", str(iters), "--eval-iters", "4", "--log-interval", "1", "--metrics-file", str(metrics),
    ] + extra  # fmt: skip
    code = train(argv)
    if code not in (0, None):
        raise SystemExit(f"training failed ({code}): {' '.join(argv)}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    loss = statistics.mean([r["loss"] for r in records if "loss" in r][-10:])  # one iteration's loss is noisy
    valid = [r["valid_loss"] for r in records if "valid_loss" in r][-1]
    return loss, valid


def time_linear(tokens: int, k: int, n: int, rounds: int) -> dict[str, float]:
    """Median seconds of forward + backward of x [tokens, k] @ W[n, k]^T, bf16 and FP8 (e4m3 tensorwise)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, k, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(n, k, generator=gen) * 0.02).bfloat16().requires_grad_()
    g = torch.randn(tokens, n, generator=gen).bfloat16()
    recipe = FP8Recipe.from_config("e4m3", "tensorwise", None, None, None)
    steps = {"bf16": lambda: torch.nn.functional.linear(x, w), "fp8": lambda: recipe.linear(x, w, None)}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):  # the two take turns, so machine noise hits them alike
        for name, step in steps.items():
            start = time.process_time()
            step().backward(g)
            times[name].append(time.process_time() - start)
            x.grad = w.grad = None
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--data", default="demo_out", help="scripts/demo.py's output directory (built if missing)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--in-features", type=int, default=1024)
    ap.add_argument("--out-features", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = (ROOT / args.data).resolve()
    prefix = demo_data(out)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in RUNS.items():
            results[name] = train_losses(prefix, out / "tokenizer.model", args.iters, extra, Path(tmp))
    base_loss, base_valid = results["bf16"]
    print(f"\nloss after {args.iters} iterations on the demo corpus (tiny preset, one process; train: mean of the last 10):")
    for name, (loss, valid) in results.items():
        print(
            f"  {name:22s} train {loss:.4f} (x{loss / base_loss:.4f} of bf16)   "
            f"validation {valid:.4f} (x{valid / base_valid:.4f} of bf16)"
        )
    t = time_linear(args.tokens, args.in_features, args.out_features, args.rounds)
    print(
        f"\none linear, forward + backward, {args.tokens} x {args.in_features} -> {args.out_features} (CPU: information only):\n"
        f"  bf16 {t['bf16'] * 1e3:.1f} ms   fp8 {t['fp8'] * 1e3:.1f} ms   fp8 / bf16 = {t['fp8'] / t['bf16']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
