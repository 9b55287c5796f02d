"""Documents and windows over whole sequences on CUDA: one varlen flash attention call (cu_seqlens, window).

Where a rank attends whole sequences (one device, or context parallelism's a2a after its all-to-all) in fp16 or
bf16 on a GPU flash takes, tricorn/model/masking.py runs the masked attention as one call of torch 2.13's varlen
flash kernel instead of one call per document: the microbatch's documents become variable-length sequences of one
packed batch ([b * s, heads, d], the cumulative starts `cu_seqlens` on the device) and the window is flash's own
``window_size_left`` (right 0: causal). This is ``aten._flash_attention_forward`` / ``_backward`` called as torch's
``torch.nn.attention.varlen.varlen_attn`` calls them (torch/nn/attention/varlen.py, read for this module): its lse
is [heads, total tokens]; dropout 0, so the rng state is never read. ``varlen_attn`` itself is not called: on
sm90 / sm100 with cuDNN >= 9.18 it picks cuDNN, which takes no window and no GQA.

`cu_seqlens` is built on the host from the host bounds (tricorn/data/documents.py) in pinned memory and copied
without blocking; max_seqlen is s (an upper bound flash accepts), so no device value is read and a compiled layer
sees no new constant. The layout: q, k, v are [b, heads, s, d] views of sequence-first [s, b, heads, d] tensors, so
with b = 1 the packed [s, heads, d] is the same memory; with b > 1 a copy. tricorn/attention_kernels.py's
``varlen_refusal`` is the rule of when this runs; tests/test_varlen.py runs this module on the CPU against a
stand-in with flash's semantics (no GPU was lent to run it). No collectives; memory: flash's output and lse.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from tricorn.attention_kernels import AttentionCall, varlen_refusal
from tricorn.pinned import host_side

_aten = torch.ops.aten


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether varlen flash runs these whole sequences (a GPU, fp16/bf16, flash's head dims and arch)."""
    if q.device.type != "cuda":
        return False
    call = AttentionCall.of(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return varlen_refusal(call, torch.cuda.get_device_capability(q.device)) is None


def cu_seqlens(rows: Optional[Sequence[Sequence[int]]], batch: int, s: int, device: torch.device) -> torch.Tensor:
    """int32 cumulative starts of every document of the microbatch packed sample after sample (pinned, non-blocking)."""
    starts = [0]
    for i in range(batch):
        row = rows[i] if rows is not None else (0, s)
        starts += [i * s + end for end in row[1:]]
    with host_side():  # host memory by design: the integers come from the host bounds
        host = torch.tensor(starts, dtype=torch.int32, pin_memory=torch.cuda.is_available())
    return host.to(device, non_blocking=True)


def _packed(x: torch.Tensor) -> torch.Tensor:
    """[b, heads, s, d] -> [b * s, heads, d] (the same memory for a [s, 1, heads, d] tensor)."""
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b * s, h, d)


def _unpacked(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[b * s, heads, d] -> `like`'s shape and strides ([b, heads, s, d] over sequence-first memory)."""
    b, h, s, d = like.shape
    view = x.view(b, s, h, d).transpose(1, 2)
    if b == 1:  # sample-major and sequence-first are the same memory: present it with like's strides
        return view.as_strided(like.shape, like.stride())
    out = torch.empty_like(like)
    out.copy_(view)
    return out


def _window(window: Optional[int]) -> tuple[bool, int, int]:
    """(is_causal, left, right) as varlen_attn passes them: causal alone, or a (W, 0) window."""
    return (True, -1, 0) if window is None else (False, window, 0)


def _cu(documents: Optional[torch.Tensor], rows, b: int, s: int, device: torch.device) -> torch.Tensor:
    """cu_seqlens of a microbatch, copied to the device once for all its layers (kept on the bounds tensor)."""
    if documents is None:
        return cu_seqlens(rows, b, s, device)
    key = (documents._version, b, s, device)
    hit = getattr(documents, "_tricorn_cu", None)
    if hit is None or hit[0] != key:
        hit = (key, cu_seqlens(rows, b, s, device))
        documents._tricorn_cu = hit
    return hit[1]


def forward(q, k, v, documents, rows, window: Optional[int], ops=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's layout, lse [b, heads, s] fp32) of causal attention within documents (`rows`: the host bounds
    `documents` decoded) and the window."""
    b, h, s, _ = q.shape
    cu = _cu(documents, rows, b, s, q.device)
    causal, left, right = _window(window)
    fwd = (ops or _aten)._flash_attention_forward
    out, lse, *_ = fwd(
        _packed(q), _packed(k), _packed(v), cu, cu, s, s, 0.0, causal, False,
        scale=None, window_size_left=left, window_size_right=right,
    )  # fmt: skip
    return _unpacked(out, q), lse.view(h, b, s).transpose(0, 1).contiguous()


def backward(dout, q, k, v, out, lse, documents, rows, window: Optional[int], ops=None) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv (in q's, k's, v's layouts) of `forward`, from its out and lse."""
    b, h, s, _ = q.shape
    cu = _cu(documents, rows, b, s, q.device)
    causal, left, right = _window(window)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # dropout 0: never read
    unused = torch.empty(0, device=q.device)
    bwd = (ops or _aten)._flash_attention_backward
    dq, dk, dv = bwd(
        _packed(dout), _packed(q), _packed(k), _packed(v), _packed(out), lse.transpose(0, 1).reshape(h, b * s),
        cu, cu, s, s, 0.0, causal, rng_state, unused,
        scale=None, window_size_left=left, window_size_right=right,
    )  # fmt: skip
    return _unpacked(dq, q), _unpacked(dk, k), _unpacked(dv, v)
