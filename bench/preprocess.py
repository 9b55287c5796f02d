"""Preprocessing throughput: vs a bare sentencepiece loop, and vs Megatron-LM's preprocess_data.py with GPT-2's BPE.

Builds its own corpus (the stdlib sample of scripts/demo_corpus.py) in a temporary directory, then:
1. SentencePiece (a --vocab-size BPE trained on the corpus), in this one process, one after the other:
     bare:        for text in texts: sp.encode(text)            (texts already in memory)
     preprocess:  tricorn's preprocess() on the jsonl file       (read, JSON, encode, append eod, write .bin/.idx)
   tokens/s of both and their ratio (goal >= 0.8).
2. A byte-level BPE (GPT-2's vocab.json + merges.txt, fetched as the tests fetch them): tricorn preprocess
   and Megatron-LM's tools/preprocess_data.py (GPT2BPETokenizer, --append-eod) on the same file at
   --workers 1 and 2, tokens/s and tricorn / Megatron (goal >= 1). Each side is timed around its main
   function in an interpreter that has already imported it (Megatron's in its own environment,
   --megatron-python, with the tool's workers forked from there): tokenizer loading, worker start, reading,
   encoding and writing count, interpreter start-up does not. Skipped, with the last measured figure in
   docs/data.md, where megatron does not import.
Each figure is the best of --repeats runs, so a noisy neighbour hurts neither side unfairly.

    python bench/preprocess.py [--max-bytes 4000000] [--vocab-size 4096] [--repeats 3]
        [--megatron-python /tmp/mcore/bin/python --megatron-lm /tmp/Megatron-LM --megatron-pythonpath DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

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


def _gpt2_argv(corpus: str, out_prefix: str, vocab: str, merges: str, workers: int) -> list[str]:
    """The flags both tools take (Megatron's names)."""
    return [
        "--input", corpus, "--output-prefix", out_prefix, "--workers", str(workers), "--append-eod", "--log-interval", "100000000",
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
    ]  # fmt: skip


def tricorn_bpe(argv: list[str]) -> float:
    from tricorn.data.preprocess import main as preprocess_main

    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        assert preprocess_main(argv) == 0
    return time.perf_counter() - start


def megatron_side(megatron_lm: str, runs: list[list[str]]) -> None:
    """Runs in Megatron's environment: time its tool's main() for each argv (imported once), print JSON seconds."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    sys.path.insert(0, f"{megatron_lm}/tools")
    import preprocess_data  # noqa: F401 - Megatron-LM's tools/preprocess_data.py (an importable module: its pool pickles by reference)

    seconds = []
    for argv in runs:
        sys.argv = ["preprocess_data.py", *argv]
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            preprocess_data.main()
        seconds.append(time.perf_counter() - start)
    print(json.dumps(seconds))


def bpe_comparison(args: argparse.Namespace, corpus: str, tmp: str) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import real_tokenizers

    vocab, merges = (str(p) for p in real_tokenizers.gpt2_vocab_merges())
    gpt2 = Path(tmp) / "gpt2"  # megatron-core loads AutoTokenizer.from_pretrained("gpt2", ...): offline, this directory
    gpt2.mkdir()
    for src, name in ((vocab, "vocab.json"), (merges, "merges.txt")):
        shutil.copyfile(src, gpt2 / name)
    (gpt2 / "config.json").write_text('{"model_type": "gpt2"}')
    from tricorn.data.indexed import IndexedDataset

    for workers in (1, 2):
        ours = min(tricorn_bpe(_gpt2_argv(corpus, f"{tmp}/t{workers}", vocab, merges, workers)) for _ in range(args.repeats))
        ds = IndexedDataset(f"{tmp}/t{workers}_text_document")
        tokens = int(sum(int(n) for n in ds.sequence_lengths))
        line = f"GPT-2 BPE, --workers {workers}: tricorn {tokens / ours:>10,.0f} tokens/s"
        theirs = _megatron_seconds(args, [_gpt2_argv(corpus, f"{tmp}/m{workers}", vocab, merges, workers)] * args.repeats, tmp)
        if theirs is None:
            print(f"{line}; Megatron not importable here (--megatron-python): see docs/data.md for the last figure")
            continue
        same = all(
            Path(f"{tmp}/t{workers}_text_document.{x}").read_bytes() == Path(f"{tmp}/m{workers}_text_document.{x}").read_bytes()
            for x in ("bin", "idx")
        )
        print(
            f"{line}, Megatron {tokens / theirs:>10,.0f} tokens/s, ratio {theirs / ours:.2f} (goal >= 1); identical output: {same}"
        )


def _megatron_seconds(args: argparse.Namespace, runs: list[list[str]], cwd: str) -> Optional[float]:
    if not os.path.exists(args.megatron_python):
        return None
    env = dict(os.environ, PYTHONPATH=args.megatron_pythonpath or "", OMP_NUM_THREADS="1")
    cmd = [args.megatron_python, str(Path(__file__).resolve()), "--megatron-side", args.megatron_lm, json.dumps(runs)]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"Megatron's run failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        return None
    return min(json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-bytes", type=int, default=4_000_000)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--megatron-python", default="/tmp/mcore/bin/python", help="an interpreter with megatron-core and transformers"
    )
    parser.add_argument("--megatron-lm", default="/tmp/Megatron-LM", help="Megatron-LM checkout (tools/preprocess_data.py)")
    parser.add_argument(
        "--megatron-pythonpath", default=None, help="PYTHONPATH for it (where transformers/tiktoken were installed)"
    )
    parser.add_argument("--skip-sentencepiece", action="store_true", help="only the GPT-2 BPE comparison")
    parser.add_argument("--megatron-side", nargs=2, metavar=("MEGATRON_LM", "RUNS_JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.megatron_side:
        megatron_side(args.megatron_side[0], json.loads(args.megatron_side[1]))
        return 0
    sys.path.insert(0, str(ROOT))
    from tricorn.data.tokenizer import train_sentencepiece

    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        info = _demo_corpus_module().build_corpus(corpus, max_bytes=args.max_bytes)
        if not args.skip_sentencepiece:
            model = train_sentencepiece([corpus], args.vocab_size, os.path.join(tmp, "tok"))
            with open(corpus, encoding="utf-8") as fh:
                texts = [json.loads(line)["text"] for line in fh]
            bare = min((bare_encode(model, texts) for _ in range(args.repeats)), key=lambda r: r[1])
            ours = min(
                (tricorn_preprocess(model, corpus, os.path.join(tmp, "out")) for _ in range(args.repeats)), key=lambda r: r[1]
            )
            bare_tps, ours_tps = bare[0] / bare[1], ours[0] / ours[1]
            print(f"corpus: {info.documents} documents, {info.bytes / 1e6:.1f} MB; tokenizer: {args.vocab_size} pieces")
            print(f"bare sentencepiece encode loop: {bare[0]:>10,} tokens in {bare[1]:.3f}s = {bare_tps:>12,.0f} tokens/s")
            print(f"tricorn preprocess, 1 worker:   {ours[0]:>10,} tokens in {ours[1]:.3f}s = {ours_tps:>12,.0f} tokens/s")
            print(f"ratio preprocess / bare: {ours_tps / bare_tps:.2f} (goal >= 0.8)")
        bpe_comparison(args, corpus, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
