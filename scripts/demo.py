"""`make demo`: pretrain the tiny preset on real text, on CPU, with 2 ranks (TP=2).

Steps (each skipped when its output already exists, so a rerun goes straight to training):
  1. corpus:     the running interpreter's standard-library .py files -> demo_out/corpus.jsonl (no download)
  2. tokenizer:  sentencepiece BPE on that corpus           -> demo_out/tokenizer.model
  3. preprocess: Megatron .bin/.idx                         -> demo_out/stdlib_text_document.{bin,idx}
  4. pretrain:   torchrun --nproc-per-node 2 pretrain_gpt.py --model-preset tiny --tensor-model-parallel-size 2

Then it prints where the TensorBoard logs are and how to open them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str], **kw) -> None:
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, **kw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="demo_out", help="working directory (default: demo_out)")
    ap.add_argument("--train-iters", type=int, default=300)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args(argv)
    out = ROOT / args.out
    out.mkdir(exist_ok=True)
    py = sys.executable
    corpus, tok_prefix, data_prefix = out / "corpus.jsonl", out / "tokenizer", out / "stdlib"
    if not corpus.exists():
        run([py, "scripts/demo_corpus.py", "--output", str(corpus)])
    if not Path(f"{tok_prefix}.model").exists():
        run(
            [
                py,
                "-m",
                "tricorn.cli",
                "tokenizer",
                "train",
                "--input",
                str(corpus),
                "--vocab-size",
                str(args.vocab_size),
                "--model-prefix",
                str(tok_prefix),
            ]
        )
    if not Path(f"{data_prefix}_text_document.idx").exists():
        run(
            [
                py,
                "-m",
                "tricorn.cli",
                "preprocess",
                "--input",
                str(corpus),
                "--output-prefix",
                str(data_prefix),
                "--tokenizer-type",
                "SentencePieceTokenizer",
                "--tokenizer-model",
                f"{tok_prefix}.model",
                "--append-eod",
                "--workers",
                "2",
            ]
        )
    tb = out / "tensorboard"
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run(
        [
            py,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(args.nproc),
            "pretrain_gpt.py",
            "--device",
            "cpu",
            "--model-preset",
            "tiny",
            "--tensor-model-parallel-size",
            "2",
            "--data-path",
            f"{data_prefix}_text_document",
            "--split",
            "95,5,0",
            "--data-cache-path",
            str(out / "cache"),
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            f"{tok_prefix}.model",
            "--seq-length",
            "256",
            "--micro-batch-size",
            "4",
            "--global-batch-size",
            "16",
            "--train-iters",
            str(args.train_iters),
            "--lr",
            "2e-3",
            "--min-lr",
            "2e-4",
            "--lr-decay-style",
            "cosine",
            "--lr-warmup-iters",
            "20",
            "--weight-decay",
            "0.1",
            "--clip-grad",
            "1.0",
            "--eval-interval",
            str(max(args.train_iters // 6, 1)),
            "--eval-iters",
            "4",
            "--log-interval",
            "10",
            "--tensorboard-dir",
            str(tb),
            "--metrics-file",
            str(metrics),
        ],
        env=env,
    )
    valid = [r["valid_loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "valid_loss" in r]
    if len(valid) >= 2:
        print(f"\nvalidation loss: {valid[0]:.3f} (first eval) -> {valid[-1]:.3f} (last eval)")
    print(f"TensorBoard logs: {tb}\n  open them with:  .venv/bin/tricorn tb {tb}   (or: .venv/bin/tensorboard --logdir {tb})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
