"""Benchmark: document-masked attention (--reset-attention-mask) against full causal attention, on this CPU.

One attention layer like Llama's (8 query heads over 2 key/value heads of 64, one sample, fp32) runs forward and
backward over SEQ tokens: full causal (model/spec.py sdpa_causal: one fused causal call) and with the sample cut
into 8 documents of random lengths (model/masking.py: one fused causal call per document, the
``aten._scaled_dot_product_flash_attention_for_cpu`` kernel the whole-sequence call also runs). Printed per sequence
length: the best of REPEATS times of each (the two take turns), their ratio (documents / causal: below 1 means the masking saves work),
and the ideal ratio, the (query, key) pairs the documents allow over causal attention's (flops.useful_pairs).
With --window W the documents run with a window of W keys too.

--flex also measures FlexAttention (torch.nn.attention.flex_attention, compiled by inductor on the CPU) on the same
documents: its compile seconds and forward time. torch 2.13 has no FlexAttention backward on the CPU, which is why
training runs the per-document fused calls here (docs/data.md).

    .venv/bin/python bench/documents.py [--seq 4096 8192] [--window 1023] [--flex] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tricorn.data.documents import bounds_rows  # noqa: E402
from tricorn.model.masking import AttentionMask, masked_attention, plan_for, whole  # noqa: E402
from tricorn.model.spec import sdpa_causal  # noqa: E402
from tricorn.planning.flops import causal_pairs, useful_pairs  # noqa: E402

HEADS, GROUPS, DIM, DOCUMENTS, REPEATS = 8, 2, 64, 8, 3


def documents_of(seq: int, seed: int = 0) -> torch.Tensor:
    """[1, seq + 1] int32 bounds of DOCUMENTS documents of random lengths (at least 1/4 of the mean each)."""
    gen = torch.Generator().manual_seed(seed)
    weights = 0.25 + torch.rand(DOCUMENTS, generator=gen)
    lengths = (weights / weights.sum() * seq).long()
    lengths[-1] += seq - int(lengths.sum())
    starts = [0, *torch.cumsum(lengths, 0)[:-1].tolist()]
    return torch.tensor([starts + [seq] * (seq + 1 - len(starts))], dtype=torch.int32)


def inputs(seq: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    q = torch.randn(seq, 1, HEADS, DIM).permute(1, 2, 0, 3).requires_grad_()  # the decoder's [b, h, s, d] views
    k, v = (torch.randn(seq, 1, GROUPS, DIM).permute(1, 2, 0, 3).requires_grad_() for _ in range(2))
    return q, k, v, torch.randn(1, HEADS, seq, DIM)


def best_time(step, repeats: int = REPEATS) -> float:
    return best_times([step], repeats)[0]


def best_times(steps, repeats: int = REPEATS) -> list[float]:
    """Each step's best of `repeats` timed runs, the steps taking turns (a loaded machine's drift hits them alike)."""
    for step in steps:
        step()  # warm-up
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for step, mine in zip(steps, times):
            start = time.perf_counter()
            step()
            mine.append(time.perf_counter() - start)
    return [min(t) for t in times]


def forward_backward(attend, q, k, v, grad):
    def step() -> None:
        for t in (q, k, v):
            t.grad = None
        attend(q, k, v).backward(grad)

    return step


def flex(seq: int, documents: torch.Tensor, q, k, v) -> dict:
    """FlexAttention forward on the CPU (compiled), the same documents: compile seconds, best forward seconds."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    starts = torch.tensor(bounds_rows(documents)[0][:-1])
    doc = torch.searchsorted(starts, torch.arange(seq), right=True) - 1  # document of each position

    def mask(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (ki <= qi)

    block_mask = create_block_mask(mask, 1, None, seq, seq, device="cpu")
    compiled = torch.compile(flex_attention, dynamic=False)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    start = time.perf_counter()
    compiled(qd, kd, vd, block_mask=block_mask, enable_gqa=True)
    compile_s = time.perf_counter() - start
    forward = best_time(lambda: compiled(qd, kd, vd, block_mask=block_mask, enable_gqa=True))
    try:
        compiled(*(t.detach().requires_grad_() for t in (q, k, v)), block_mask=block_mask, enable_gqa=True).sum().backward()
        backward = "ran"
    except Exception as e:  # torch 2.13: "FlexAttention does not support backward on CPU"
        backward = str(e).splitlines()[0]
    return {"flex_compile_s": compile_s, "flex_forward_s": forward, "flex_backward": backward}


def measure(seq: int, window, with_flex: bool) -> dict:
    q, k, v, grad = inputs(seq)
    documents = documents_of(seq)
    mask = AttentionMask(documents, window)
    causal, masked = best_times(
        [
            forward_backward(lambda *t: sdpa_causal(*t, None), q, k, v, grad),
            forward_backward(lambda *t: masked_attention(*t, mask), q, k, v, grad),
        ]
    )
    blocks = plan_for(q, documents, whole(seq), whole(seq), seq, -1 if window is None else window)
    lengths = [b - a for a, b in zip(bounds_rows(documents)[0], bounds_rows(documents)[0][1:])]
    out = {
        "seq": seq,
        "window": window,
        "document_lengths": lengths,
        "kernel": "aten._scaled_dot_product_flash_attention_for_cpu (fp32)",
        "kernel_calls": len(blocks),
        "causal_s": causal,
        "documents_s": masked,
        "ratio": masked / causal,
        "ideal_ratio": useful_pairs(bounds_rows(documents), 1, seq, window) / causal_pairs(seq),
    }
    if with_flex:
        out |= flex(seq, documents, q, k, v)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--window", type=int, default=None, help="also limit each query to the previous W keys")
    parser.add_argument("--flex", action="store_true", help="also FlexAttention on the CPU (compiles: ~30 s and more)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core: the ratio, not the machine's parallelism
    rows = [measure(seq, args.window, args.flex) for seq in args.seq]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for r in rows:
        window = "" if r["window"] is None else f", window {r['window']}"
        print(
            f"seq {r['seq']}: {DOCUMENTS} documents {r['document_lengths']}{window} | "
            f"forward+backward causal {r['causal_s'] * 1e3:.0f} ms, documents {r['documents_s'] * 1e3:.0f} ms "
            f"({r['kernel_calls']} calls of {r['kernel']}) | ratio {r['ratio']:.3f} (ideal {r['ideal_ratio']:.3f})"
        )
        if "flex_compile_s" in r:
            print(
                f"  FlexAttention on CPU: compile {r['flex_compile_s']:.1f} s, forward {r['flex_forward_s'] * 1e3:.0f} ms; "
                f"backward: {r['flex_backward']}"
            )


if __name__ == "__main__":
    main()
