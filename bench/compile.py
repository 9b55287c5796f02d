"""Benchmark: --torch-compile against eager on the peer model, one process (issue 27's Benchmark).

The peer model: Llama (RMSNorm, RoPE, SwiGLU, no biases, untied head), 4 layers, h 256, 8 heads, 2 KV heads,
ffn 688, seq 256, micro-batch 4, fp32, one process. The same model (same init, same tokens) is built twice,
eager and with every layer compiled (tricorn.parallel.compile, as the trainer does it); the first step of
each is the warm-up (the compiled one compiles then, and the probe measures what each saves for backward).
Then the two take turns step by step, so machine noise hits them alike, and the median training step
(forward + backward + AdamW) of each is compared in process CPU time (one intra-op thread: other processes
on a shared machine do not skew one more than the other); wall time is printed too.

Printed: tokens/s compiled / eager (goal >= 1.25 on a CPU), the compile seconds (dynamo's traces and the
backward compiled at the first backward), the probe's saved activation bytes per layer in both modes beside
the estimate (planning/activations.py, eager and compile mode), and dynamo's graph-break count per layer.
Not a test: CI never times anything.

    .venv/bin/python bench/compile.py [--rounds 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from recompute import raise_malloc_thresholds, step

from tricorn.config import ModelConfig
from tricorn.model.transformer import GPTModel
from tricorn.parallel.compile import STATS, apply_compile
from tricorn.planning.activations import layer_activation_bytes
from tricorn.training.activation_probe import ActivationProbe


def peer_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        num_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        group_query_attention=True,
        num_query_groups=2,
        ffn_hidden_size=688,
        swiglu=True,
        seq_length=256,
        vocab_size=args.vocab,
        disable_bias_linear=True,
        untie_embeddings_and_output_weights=True,
    )


def build(cfg: ModelConfig, compiled: bool) -> tuple[GPTModel, torch.optim.Optimizer]:
    model = GPTModel(cfg, padded_vocab_size=cfg.vocab_size)
    model.init_weights(1234)
    apply_compile([model], compiled)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def graph_breaks_per_layer(model: GPTModel, tokens: torch.Tensor) -> list[int]:
    """dynamo's graph-break count of each layer's forward (torch._dynamo.explain: traced, not compiled)."""
    x = model.tok_embeddings(tokens.t().contiguous()).detach()
    position_ids = torch.arange(tokens.shape[1])
    counts = []
    for block in model.layers.values():
        forward = type(block).forward.__get__(block)  # the layer's own forward, not the compiled wrapper
        counts.append(torch._dynamo.explain(forward)(x, model.rotary, position_ids).graph_break_count)
    return counts


KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product")  # the GEMMs and attention: not fused


def kernel_seconds(model: GPTModel, opt: torch.optim.Optimizer, tokens: torch.Tensor, steps: int = 3) -> tuple[float, float]:
    """(seconds in GEMMs and attention, all seconds) per training step, by torch.profiler over `steps` steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step(model, opt, tokens)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    kernels = sum(e.self_cpu_time_total for e in events if e.key.startswith(KERNELS))
    return kernels / 1e6 / steps, total / 1e6 / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least noise on a shared machine)")
    args = ap.parse_args()
    raise_malloc_thresholds()
    torch.set_num_threads(args.threads)
    cfg = peer_config(args)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    runs = {"eager": build(cfg, False), "compiled": build(cfg, True)}
    saved, first_step = {}, {}
    for mode, (model, opt) in runs.items():  # warm-up: compiles, and the probe measures the saved bytes
        with ActivationProbe([model]) as probe:
            first_step[mode] = step(model, opt, tokens)[1]
        saved[mode] = probe.summary().activation_bytes_per_layer
    cpu: dict[str, list[float]] = {mode: [] for mode in runs}
    wall: dict[str, list[float]] = {mode: [] for mode in runs}
    for _ in range(args.rounds):
        for mode, (model, opt) in runs.items():
            c, w = step(model, opt, tokens)
            cpu[mode].append(c)
            wall[mode].append(w)
    tokens_per_step = args.micro_batch * cfg.seq_length
    kw = dict(seq=cfg.seq_length, micro_batch=args.micro_batch, precision="fp32", device="cpu")
    formula = {"eager": layer_activation_bytes(cfg, **kw), "compiled": layer_activation_bytes(cfg, **kw, compiled=True)}
    print(
        f"compile bench: Llama {cfg.num_layers} layers, h {cfg.hidden_size}, {cfg.num_attention_heads} heads, "
        f"{cfg.kv_heads} KV heads, ffn {cfg.ffn_size}, s {cfg.seq_length}, b {args.micro_batch}, fp32, one process, "
        f"{args.threads} thread(s), median of {args.rounds} steps"
    )
    print(f"{'mode':<10}{'step cpu s':>12}{'tokens/s':>10}{'wall s':>9}{'first step s':>14}{'saved B/layer':>15}{'estimate':>11}")
    rate = {}
    for mode in runs:
        median = statistics.median(cpu[mode])
        rate[mode] = tokens_per_step / median
        print(
            f"{mode:<10}{median:>12.4f}{rate[mode]:>10.0f}{statistics.median(wall[mode]):>9.4f}"
            f"{first_step[mode]:>14.1f}{saved[mode]:>15.0f}{formula[mode]:>11.0f}"
        )
    print(f"tokens/s compiled / eager: {rate['compiled'] / rate['eager']:.3f} (goal >= 1.25)")
    print(f"{STATS.summary()} (wall, in the warm-up step)")
    # Compile fuses what is not a GEMM or attention; those run the same aten kernels in both modes. So eager's
    # step time over (eager's kernel time + compiled's other time) bounds what compile can give at this shape.
    (k_eager, t_eager), (k_comp, t_comp) = (kernel_seconds(*runs[mode], tokens) for mode in ("eager", "compiled"))
    print(
        f"GEMMs + attention: {k_eager / t_eager:.0%} of the eager step (profiler); the rest {t_eager - k_eager:.3f} s eager, "
        f"{t_comp - k_comp:.3f} s compiled ({(t_eager - k_eager) / (t_comp - k_comp):.2f}x); "
        f"the ceiling of compiled / eager at this shape: {t_eager / (k_eager + t_comp - k_comp):.3f}"
    )
    start = time.perf_counter()
    breaks = graph_breaks_per_layer(runs["eager"][0], tokens)
    print(f"graph breaks per layer: {breaks} (torch._dynamo.explain, {time.perf_counter() - start:.1f} s)")
    print(
        "saved bytes per layer, compiled - eager: "
        f"{saved['compiled'] - saved['eager']:+.0f} (the RoPE rows 2esd = {-2 * 4 * cfg.seq_length * cfg.head_dim:+d}, "
        f"plus the int64 position ids 8s = {8 * cfg.seq_length} on the first layer, / {cfg.num_layers} layers)"
    )


if __name__ == "__main__":
    main()
