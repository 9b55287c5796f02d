"""Dropout whose masks do not depend on the parallel layout.

Every mask element is a function of (run seed, global sample index, layer, site, global position),
never of which rank holds the element or in which order ranks draw. A rank that holds a piece of a
tensor (a sequence shard under SP, the kept chunks under CP, some heads under TP, some samples under
DP, some layers under PP) draws the mask of each of its samples whole, from a generator seeded by
those keys, and keeps the rows (and, for attention, the key columns) it owns. So TP, SP, CP, PP and DP
runs drop exactly what the single-process run drops, recomputation redraws the same mask without any
RNG bookkeeping, and resuming needs no RNG state for dropout.

Sites: the attention output and the MLP output of each block (hidden dropout, [s, h] per sample), and
the attention probabilities ([s, s] per sample and global head). With attention dropout the core
attention runs as explicit math (scores, softmax, mask, @ v) instead of SDPA, since SDPA draws its own
mask; that keeps the s x s probabilities for backward, as torch's math kernel does.

Cost, against Megatron's per-rank RNG streams: each rank draws the full per-sample mask of a site and
keeps its slice, so under SP hidden dropout draws TP x (and under CP, CP x) the random numbers, with a
transient fp32 [s, h] per sample; attention dropout draws [s, s] per local head (CP x under CP).
Pretraining runs of Llama-style models use no dropout, where none of this runs. No collectives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from tricorn.model.lean import at_least_fp32

ATTENTION_OUTPUT, MLP_OUTPUT, ATTENTION_PROBS = 0, 1, 2
_MASK64 = (1 << 64) - 1


def mix_seed(*parts: int) -> int:
    """A stable 63-bit generator seed from integers (splitmix64 steps; Python's hash() varies per process)."""
    h = 0x9E3779B97F4A7C15
    for part in parts:
        h = ((h ^ (part & _MASK64)) * 0xBF58476D1CE4E5B9) & _MASK64
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 29
    return h >> 1


@dataclass(frozen=True)
class DropoutKey:
    """What names one dropout site of one microbatch: (seed, the samples, the layer, the site)."""

    seed: int
    sample_ids: tuple[int, ...]  # global sample index of each row of the microbatch
    layer: int
    site: int
    seq_length: int  # the global sequence length: masks are drawn over all of it

    def generator(self, sample_id: int, device: torch.device, *extra: int) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(mix_seed(self.seed, sample_id, self.layer, self.site, *extra))


class _KeepAndScale(torch.autograd.Function):
    """x * keep / (1 - p), saving the boolean mask (1 byte per element, as torch's dropout does)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return x * keep * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (keep,) = ctx.saved_tensors
        return grad * keep * ctx.scale, None, None


def hidden_dropout(x: torch.Tensor, p: float, key: DropoutKey, rows: torch.Tensor) -> torch.Tensor:
    """Dropout of hidden states [b, s_local, h] whose local rows sit at global positions `rows`.

    `x` may be a view of other memory order (the decoder passes its sequence-first states transposed): the
    mask is laid out like x, so the product keeps that order and costs no copy."""
    if len(key.sample_ids) != x.shape[0]:
        raise ValueError(f"dropout got {len(key.sample_ids)} sample ids for a microbatch of {x.shape[0]}")
    keep = torch.empty_like(x, dtype=torch.bool)
    for i, sid in enumerate(key.sample_ids):
        keep[i] = torch.rand(key.seq_length, x.shape[-1], generator=key.generator(sid, x.device), device=x.device)[rows] >= p
    return _KeepAndScale.apply(x, keep, 1.0 / (1.0 - p))


@dataclass(frozen=True)
class AttentionDropout:
    """Attention-probability dropout of one layer: the key plus where this rank's heads start."""

    p: float
    key: DropoutKey
    head_offset: int  # global index of this rank's first query head (TP)

    def keep_mask(self, heads: int, q_pos: torch.Tensor, k_pos: torch.Tensor, device: torch.device) -> torch.Tensor:
        """[b, heads, len(q_pos), len(k_pos)] booleans drawn by (sample, global head, global positions)."""
        s = self.key.seq_length
        rows = []
        for sid in self.key.sample_ids:
            per_head = []
            for head in range(self.head_offset, self.head_offset + heads):
                full = torch.rand(s, s, generator=self.key.generator(sid, device, head), device=device)
                per_head.append(full[q_pos][:, k_pos] >= self.p)
            rows.append(torch.stack(per_head))
        return torch.stack(rows)


def _fresh_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, h_x, s, d] -> a new contiguous [b * heads, s, d], each head repeated heads / h_x times (GQA).

    Always exactly one copy, whatever x's layout (a view of the fused QKV output, a RoPE output), so the
    matmuls below keep the same bytes on every layout and the activation formula can count them."""
    b, hx, s, d = x.shape
    out = x.new_empty((b, hx, heads // hx, s, d))
    out.copy_(x.unsqueeze(2).expand(b, hx, heads // hx, s, d))
    return out.view(b * heads, s, d)


def attention_with_dropout(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: AttentionDropout, q_pos: torch.Tensor, k_pos: torch.Tensor
) -> torch.Tensor:
    """Causal attention by global positions, with layout-independent dropout of the probabilities.

    q [b, heads, sq, d]; k, v [b, kv_heads, sk, d] (query head j reads key/value head j // (heads / kv_heads));
    q_pos / k_pos the global positions of their rows. Softmax in fp32 (or wider), like the model's norms.
    Saved for backward: q, k, v as [b * heads, s, d] copies, the fp32 softmax output, the bool keep mask, the
    dropped probabilities and the [sq, sk] causal mask (tricorn/planning/activations.py counts them).
    """
    b, heads, sq, d = q.shape
    qf, kf, vf = _fresh_heads(q, heads), _fresh_heads(k, heads), _fresh_heads(v, heads)
    scores = torch.bmm(qf, kf.transpose(1, 2)) * (1.0 / math.sqrt(d))
    allowed = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
    probs = F.softmax(at_least_fp32(scores).masked_fill(~allowed, float("-inf")), dim=-1).to(q.dtype)
    keep = dropout.keep_mask(heads, q_pos, k_pos, q.device).view(b * heads, sq, -1)
    out = torch.bmm(_KeepAndScale.apply(probs, keep, 1.0 / (1.0 - dropout.p)), vf)
    return out.view(b, heads, sq, d)


def sample_ids_or_default(sample_ids: Optional[Sequence[int]], batch: int) -> tuple[int, ...]:
    """The trainer passes each microbatch's global sample indices; a bare model call numbers its rows 0..b-1."""
    return tuple(range(batch)) if sample_ids is None else tuple(int(i) for i in sample_ids)
