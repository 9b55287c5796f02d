"""Preprocessing throughput (1 worker) vs a bare sentencepiece encode loop over the same texts.

Builds its own corpus (the stdlib sample of scripts/demo_corpus.py) and
tokenizer in a temporary directory, then runs, in this one process and one
after the other:
  bare:        for text in texts: sp.encode(text)            (texts already in memory)
  preprocess:  tricorn's preprocess() on the jsonl file       (read, JSON, encode, append eod, write .bin/.idx)
and prints tokens/s of both and their ratio (goal >= 0.8). Each is timed as
the best of --repeats runs, so a noisy neighbour hurts neither side unfairly.

    python bench/preprocess.py [--max-bytes 4000000] [--vocab-size 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _demo_corpus_module():
    spec = importlib.util.spec_from_file_location("demo_corpus", ROOT / "scripts" / "demo_corpus.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["demo_corpus"] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def bare_encode(model_path: str, texts: list[str]) -> tuple[int, float]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model_path)
    start = time.perf_counter()
    tokens = 0
    for text in texts:
        tokens += len(sp.encode(text))
    return tokens, time.perf_counter() - start


def tricorn_preprocess(model_path: str, corpus: str, out_prefix: str) -> tuple[int, float]:
    from tricorn.data.preprocess import preprocess

    start = time.perf_counter()
    report = preprocess([corpus], out_prefix, "SentencePieceTokenizer", model_path, workers=1, progress=None)
    return report.tokens, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-bytes", type=int, default=4_000_000)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tricorn.data.tokenizer import train_sentencepiece

    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        info = _demo_corpus_module().build_corpus(corpus, max_bytes=args.max_bytes)
        model = train_sentencepiece([corpus], args.vocab_size, os.path.join(tmp, "tok"))
        with open(corpus, encoding="utf-8") as fh:
            texts = [json.loads(line)["text"] for line in fh]
        bare = min((bare_encode(model, texts) for _ in range(args.repeats)), key=lambda r: r[1])
        ours = min((tricorn_preprocess(model, corpus, os.path.join(tmp, "out")) for _ in range(args.repeats)), key=lambda r: r[1])
    bare_tps, ours_tps = bare[0] / bare[1], ours[0] / ours[1]
    print(f"corpus: {info.documents} documents, {info.bytes / 1e6:.1f} MB; tokenizer: {args.vocab_size} pieces")
    print(f"bare sentencepiece encode loop: {bare[0]:>10,} tokens in {bare[1]:.3f}s = {bare_tps:>12,.0f} tokens/s")
    print(f"tricorn preprocess, 1 worker:   {ours[0]:>10,} tokens in {ours[1]:.3f}s = {ours_tps:>12,.0f} tokens/s")
    print(f"ratio preprocess / bare: {ours_tps / bare_tps:.2f} (goal >= 0.8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
