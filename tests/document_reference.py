"""A packed corpus and a plain-torch float64 reference of tricorn's decoder with an explicit attention mask.

`packed_corpus` writes a small Megatron-format dataset of short documents, each ending with the end-of-document
token (the NullTokenizer's V - 1), so every sample of 64 tokens packs several documents. `reference_loss` is the
decoder of tricorn/model/transformer.py written again in a few lines of plain torch, in float64, from a state
dict: the fused QKV by query group, RoPE by the given positions, the [b, s, s] mask of the rule (causal, within
a document, within a window) built explicitly, and the loss over the loss mask. It shares no attention code
with tricorn (tests/test_document_attention.py compares the trainer's first loss with it).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from tricorn.data.indexed import IndexedDatasetBuilder

VOCAB = 500
EOD = VOCAB - 1  # megatron-core's NullTokenizer: the last id


def packed_corpus(prefix: Path, documents: int = 400, seed: int = 0) -> str:
    """Documents of 0-40 tokens (a few up to 150, longer than a sample) each ending with EOD; returns the prefix."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", np.uint16)
    for _ in range(documents):
        n = int(rng.integers(0, 150 if rng.random() < 0.05 else 41))
        text = rng.integers(0, EOD, size=n)
        builder.add_document(np.concatenate([text, [EOD]]), [n + 1])
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def allowed_mask(s: int, starts: Optional[torch.Tensor], window: Optional[int], batch: int) -> torch.Tensor:
    """[b, s, s] booleans: key j is seen by query i when start(i) <= j <= i and i - window <= j."""
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (j <= i).expand(batch, s, s).clone()
    if starts is not None:
        allowed &= j >= starts[:, :, None]
    if window is not None:
        allowed &= j >= i - window
    return allowed


def _norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    if bias is None:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """x [b, s, heads, d] rotated by each sample's positions [b, s] (rotate-half)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = positions.to(torch.float64)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, :, None]
    half = d // 2
    return x * angles.cos() + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * angles.sin()


def reference_loss(state: dict, cfg, tokens, labels, loss_mask, positions, allowed) -> float:
    """The mean loss over loss_mask of tricorn's decoder (cfg: a ModelConfig) with weights `state`, in float64."""
    p = {k: v.to(torch.float64) for k, v in state.items()}
    b, s = tokens.shape
    heads, groups, d = cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim
    per_group = heads // groups
    x = p["tok_embeddings.weight"][tokens]
    for layer in range(cfg.num_layers):
        pre = f"layers.{layer}."
        bias = None if cfg.normalization == "RMSNorm" else p[pre + "attention_norm.bias"]
        h = _norm(x, p[pre + "attention_norm.weight"], bias, cfg.norm_epsilon)
        qkv = F.linear(h, p[pre + "attention.wqkv.weight"], p.get(pre + "attention.wqkv.bias"))
        qkv = qkv.view(b, s, groups, per_group + 2, d)
        q = qkv[:, :, :, :per_group].reshape(b, s, heads, d)
        k, v = qkv[:, :, :, per_group], qkv[:, :, :, per_group + 1]
        q, k = _rope(q, positions, cfg.rotary_base), _rope(k, positions, cfg.rotary_base)
        k, v = (t.repeat_interleave(per_group, dim=2) for t in (k, v))
        scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(d)
        probs = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
        attn = torch.einsum("bhij,bjhd->bihd", probs, v).reshape(b, s, heads * d)
        x = x + F.linear(attn, p[pre + "attention.wo.weight"], p.get(pre + "attention.wo.bias"))
        bias = None if cfg.normalization == "RMSNorm" else p[pre + "mlp_norm.bias"]
        h = F.linear(
            _norm(x, p[pre + "mlp_norm.weight"], bias, cfg.norm_epsilon), p[pre + "mlp.w1.weight"], p.get(pre + "mlp.w1.bias")
        )
        h = F.silu(h[..., 0::2]) * h[..., 1::2] if cfg.swiglu else F.gelu(h)
        x = x + F.linear(h, p[pre + "mlp.w2.weight"], p.get(pre + "mlp.w2.bias"))
    x = _norm(x, p["norm.weight"], None if cfg.normalization == "RMSNorm" else p["norm.bias"], cfg.norm_epsilon)
    head = p.get("output.weight", p["tok_embeddings.weight"])
    logits = F.linear(x, head)[..., : cfg.vocab_size]
    per_token = F.cross_entropy(logits.reshape(b * s, -1), labels.reshape(-1), reduction="none").view(b, s)
    mask = loss_mask.to(torch.float64)
    return float((per_token * mask).sum() / mask.sum())
