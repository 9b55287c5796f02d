"""Benchmark: step time and measured activation bytes of no / selective / full recompute, side by side.

One process trains the same model (same init, same tokens) under each recompute mode; the modes take
turns round by round so machine noise hits them alike, and the median step (forward + backward + AdamW)
of each is printed with its ratio to no recompute (goal for full: <= 1.40, nominally 4/3: one extra
forward on top of forward + backward), and the probe's activation bytes per layer with their ratio to
Megatron's count sb(12h + 4h_kv + 6f) (scaled to fp32): at most 1 plus the statistics without recompute. The default model is sized so the transformer layers' matmuls
dominate the step on a CPU (small vocabulary: the head is not recomputed and would flatter the ratio).

Steps are timed in process CPU time (one intra-op thread), so other processes on a shared machine do not
skew one mode more than another; wall time is printed too. The script re-executes itself with glibc's
mmap/trim thresholds raised: otherwise every step hands its large activation blocks back to the OS and
page-faults them in again, a CPU-only cost (a GPU caching allocator has none) that grows with the bytes
kept and so penalises no-recompute. Not a test: CI never times anything.

    .venv/bin/python bench/recompute.py [--hidden 512] [--layers 4] [--seq 512] [--micro-batch 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from tricorn.config import ModelConfig
from tricorn.model.transformer import GPTModel
from tricorn.parallel.recompute import apply_recompute
from tricorn.planning.activations import layer_activation_bytes
from tricorn.training.activation_probe import ActivationProbe

MODES = {
    "none": {},
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "selective+mlp+norm": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp", "norm"]),
    "selective norm+act": dict(recompute_granularity="selective", recompute_modules=["norm", "mlp_act"]),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


def build(args: argparse.Namespace, mode: str) -> tuple[ModelConfig, GPTModel, torch.optim.Optimizer]:
    cfg = ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        group_query_attention=True,
        num_query_groups=args.heads // 2,
        swiglu=True,
        seq_length=args.seq,
        vocab_size=args.vocab,
        disable_bias_linear=True,
        untie_embeddings_and_output_weights=True,
    )
    for key, value in MODES[mode].items():
        setattr(cfg, key, value)
    model = GPTModel(cfg, padded_vocab_size=args.vocab)
    model.init_weights(1234)
    apply_recompute([model], cfg)
    return cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def step(model: GPTModel, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one training step."""
    cpu, wall = time.process_time(), time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = model(tokens, tokens).mean()
    loss.backward()
    opt.step()
    return time.process_time() - cpu, time.perf_counter() - wall


def megatron_target(cfg: ModelConfig, args: argparse.Namespace) -> float:
    """Megatron's bytes per layer, sb(12h + 4h_kv + 6f) at 2 bytes per element, here at 4 (fp32), TP 1."""
    h_kv = cfg.kv_heads * cfg.head_dim
    return args.seq * args.micro_batch * (12 * cfg.hidden_size + 4 * h_kv + 6 * cfg.ffn_size) * 4 / 2


_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2**34), "MALLOC_TRIM_THRESHOLD_": str(2**34)}


def raise_malloc_thresholds() -> None:
    """Re-execute this script with glibc's mmap/trim thresholds raised (see the module docstring)."""
    if any(k not in os.environ for k in _MALLOC):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_MALLOC})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least noise on a shared machine)")
    args = ap.parse_args()
    raise_malloc_thresholds()
    torch.set_num_threads(args.threads)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=torch.Generator().manual_seed(0))
    runs = {mode: build(args, mode) for mode in MODES}
    memory = {}
    for mode, (cfg, model, opt) in runs.items():  # one warm-up step each, measured by the probe
        with ActivationProbe([model]) as probe:
            step(model, opt, tokens)
        memory[mode] = (probe.summary().activation_bytes_per_layer, cfg)
    cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
    wall: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode, (_cfg, model, opt) in runs.items():
            c, w = step(model, opt, tokens)
            cpu[mode].append(c)
            wall[mode].append(w)
    base = statistics.median(cpu["none"])
    print(
        f"recompute bench: {args.layers} layers, h {args.hidden}, {args.heads} heads (GQA {args.heads // 2}), SwiGLU, "
        f"s {args.seq}, b {args.micro_batch}, fp32, {args.threads} thread(s), median of {args.rounds} steps"
    )
    print(f"{'mode':<20}{'step cpu s':>12}{'vs none':>10}{'wall s':>9}{'act MiB/layer':>16}{'formula MiB':>14}{'/ target':>12}")
    for mode in MODES:
        median = statistics.median(cpu[mode])
        measured, cfg = memory[mode]
        m = MODES[mode]
        predicted = layer_activation_bytes(
            cfg,
            seq=args.seq,
            micro_batch=args.micro_batch,
            recompute=m.get("recompute_granularity"),
            recompute_modules=m.get("recompute_modules", ()),
            precision="fp32",
            device="cpu",
        )
        print(
            f"{mode:<20}{median:>12.3f}{median / base:>10.3f}{statistics.median(wall[mode]):>9.3f}"
            f"{measured / 2**20:>16.2f}{predicted / 2**20:>14.2f}{measured / megatron_target(cfg, args):>12.3f}"
        )


if __name__ == "__main__":
    main()
