"""What the checkpoint-converter benchmarks share (bench/hf_convert.py, bench/megatron_convert.py): the flags of
their Llama-shaped model (SwiGLU, GQA, untied, no biases), its ModelConfig, and a timer."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from tricorn.config import ModelConfig


def parser(description: str, scratch: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path(scratch))
    return ap


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads,
        num_query_groups=args.kv_heads,
        group_query_attention=args.kv_heads != args.heads,
        swiglu=True,
        disable_bias_linear=True,
        untie_embeddings_and_output_weights=True,
        vocab_size=args.vocab,
    )


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def report(times: dict[str, list[float]], nbytes: int, header: str) -> None:
    """Median GB/s of each phase over the rounds, and import / export against a plain save + load."""
    median = {k: statistics.median(v) for k, v in times.items()}
    print(header)
    for k, s in median.items():
        print(f"  {k:<11} {nbytes / s / 1e9:7.2f} GB/s  ({s:.2f} s)")
    plain_copy = median["plain save"] + median["plain load"]
    print(f"  plain save+load {nbytes / plain_copy / 1e9:.2f} GB/s")
    for k in ("import", "export"):
        print(f"ratio {k} / plain save+load throughput: {plain_copy / median[k]:.2f}")
