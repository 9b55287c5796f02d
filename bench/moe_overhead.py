"""Benchmark: one mixture-of-experts layer (tricorn/model/moe.py at EP=1) against a bare PyTorch loop over its experts.

The bare loop is the one most MoE code starts from (Hugging Face Mixtral's sparse MoE block): softmax router,
top-k renormalised, then per expert the tokens routed to it found with a mask, run through its weights and
added back weighted by their probability. Both sides use the same weights and tokens (the loop reads the
layer's own parameters) and run forward + backward; the script prints each side's median time over
alternating repeats on one thread, so that a busy machine hits both alike, and the ratio bare/tricorn
(goal >= 0.97). Host reads (tricorn.host_reads) per forward + backward are printed for both: tricorn reads the
copy counts once per layer; the loop's torch.where per expert synchronises a GPU too, which a CPU count
cannot see.
Not a test: CI never times anything.

    .venv/bin/python bench/moe_overhead.py [--experts 8] [--topk 2] [--hidden 256] [--tokens 2048] [--iters 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from tricorn.config import ModelConfig
from tricorn.host_reads import HostReadCounter
from tricorn.model.moe import MoEMLP
from tricorn.model.spec import local_spec


def build(args) -> tuple[MoEMLP, torch.Tensor]:
    cfg = ModelConfig(
        hidden_size=args.hidden,
        ffn_hidden_size=2 * args.hidden,
        num_experts=args.experts,
        moe_router_topk=args.topk,
        swiglu=True,
        disable_bias_linear=True,
    )
    torch.manual_seed(0)
    layer = MoEMLP(cfg, local_spec())
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return layer, torch.randn(args.tokens // 256, 256, args.hidden, requires_grad=True)


def bare(layer: MoEMLP, x: torch.Tensor, topk: int) -> torch.Tensor:
    """Hugging Face Mixtral's loop, on the layer's weights (w1 rows interleave gate and up)."""
    tokens = x.flatten(0, 1)
    probs, chosen = F.linear(tokens, layer.router.weight).softmax(-1).topk(topk, dim=-1)
    probs = probs / probs.sum(-1, keepdim=True)
    out = torch.zeros_like(tokens)
    for e in range(layer.num_experts):
        rows, slot = torch.where(chosen == e)
        h = tokens[rows] @ layer.experts.w1[e].T
        h = F.silu(h[:, 0::2]) * h[:, 1::2]
        out = out.index_add(0, rows, (h @ layer.experts.w2[e].T) * probs[rows, slot, None])
    return out.view_as(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per forward (a multiple of 256)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    layer, x = build(args)
    # The same math: the outputs agree to fp32 rounding (summation order differs).
    torch.testing.assert_close(layer(x), bare(layer, x, args.topk), rtol=1e-4, atol=1e-5)
    sides = {"bare": lambda: bare(layer, x, args.topk), "tricorn": lambda: layer(x)}
    times: dict[str, list[float]] = {name: [] for name in sides}
    reads: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, fn in sides.items():
            for it in range(args.iters):
                start = time.perf_counter()
                fn().sum().backward()
                if it:  # the first call warms up
                    times[name].append(time.perf_counter() - start)
    for name, fn in sides.items():
        with HostReadCounter() as counter:
            fn().sum().backward()
        reads[name] = counter.count
    bare_t, ours_t = statistics.median(times["bare"]), statistics.median(times["tricorn"])
    print(f"MoE layer, {args.experts} experts, top-{args.topk}, hidden {args.hidden}, {args.tokens} tokens, forward + backward")
    print(f"bare loop {1000 * bare_t:.1f} ms ({reads['bare']} host reads), tricorn {1000 * ours_t:.1f} ms ({reads['tricorn']})")
    print(f"ratio bare/tricorn = {bare_t / ours_t:.3f} (goal >= 0.97)")


if __name__ == "__main__":
    main()
