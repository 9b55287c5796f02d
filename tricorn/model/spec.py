"""Layer spec: which classes build each linear, norm, embedding and attention core.

The decoder in transformer.py is written once against this spec. `local_spec()`
gives plain single-process layers; tricorn.parallel swaps in tensor/sequence/
context-parallel ones (and Transformer Engine ones) without the model knowing.

Contract every implementation keeps (hidden states are sequence-first, [seq, batch, features];
token ids [seq, batch]):
- column_linear(in, out, bias): takes the layer input as the model sees it and
  returns this rank's contiguous slice of the `out` features. The decoder lays
  out fused weights (QKV by query group, SwiGLU gate/up interleaved) so that a
  contiguous slice is always whole heads / whole gate-up pairs, for any split.
- row_linear(in, out, bias): takes a slice of `in` features, returns all `out`.
- embedding(num_embeddings, dim, scatter_output): tokens -> hidden states;
  scatter_output=True lets a parallel implementation hand the blocks their
  sequence shard directly, otherwise the decoder calls `sequence_scatter`.
- output_head(dim, num_embeddings, tied): hidden -> (slice of) logits; with
  tied=True the forward receives the embedding weight.
- cross_entropy(logits, labels, vocab_size) -> per-token fp32 loss of labels' shape, where
  logit columns at or beyond vocab_size (padding) never count.
- core_attention(q, k, v, dropout): [b, heads, s, d] causal attention (views of sequence-first
  [s, b, heads, d] tensors; the output is best written in q's layout, as SDPA does); `dropout` is None
  or the layer's AttentionDropout (dropout.py: masks drawn by global sample, head and position).
- norm(dim, kind, eps): a norm module.
- head_norm(dim, kind, eps): the per-head norm of queries or keys (--qk-layernorm), over the head dim; each
  TP rank applies it to its own heads, so a parallel implementation marks its weights for a TP gradient sum.
- weight_grad: None, or the hook (lean.WeightGrad) through which the norms and the routed experts' GEMMs hand
  over their weights' gradients in backward, so that tricorn.parallel can defer them to a zero-bubble W
  (tricorn/parallel/wgrad.py's `defer`); None computes them in the backward.
- dropout_seed, tp_rank, sequence_shard_rank: what dropout.py needs to draw the same mask as one
  process would: the run seed, where this rank's heads start, which sequence shard it holds.

No collectives here; memory effect: none.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tricorn.model.dropout import AttentionDropout, attention_with_dropout
from tricorn.model.layers import LayerNorm, RMSNorm
from tricorn.model.lean import WeightGrad, cross_entropy


class Linear(nn.Linear):
    """nn.Linear with our (out, in) weight and deterministic init hooks left to init.py."""


class HeadLinear(nn.Module):
    """Output projection; tied heads borrow the embedding weight at call time."""

    def __init__(self, dim: int, num_embeddings: int, tied: bool):
        super().__init__()
        self.weight = None if tied else nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        return F.linear(x, self.weight if weight is None else weight)


class Embedding(nn.Embedding):
    def __init__(self, num_embeddings: int, dim: int, scatter_output: bool = False):
        super().__init__(num_embeddings, dim)


def masked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-token loss in fp32; padded vocabulary columns are excluded from the softmax. The logits are kept
    in their own dtype and the fp32 softmax is computed in chunks (lean.cross_entropy)."""
    return cross_entropy(logits, labels, 0, min(vocab_size, logits.shape[-1]))


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: Optional[AttentionDropout]) -> torch.Tensor:
    """Causal attention through torch's fused kernel (flash on GPU); GQA without copying k/v.

    With attention dropout the explicit form runs instead: SDPA would draw its own, layout-dependent mask."""
    if dropout is not None:
        pos = torch.arange(q.shape[2], device=q.device)
        return attention_with_dropout(q, k, v, dropout, pos, pos)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


@dataclass
class LayerSpec:
    column_linear: Callable[..., nn.Module] = Linear
    row_linear: Callable[..., nn.Module] = Linear
    embedding: Callable[..., nn.Module] = Embedding
    sequence_scatter: Callable[[], nn.Module] = nn.Identity
    output_head: Callable[..., nn.Module] = HeadLinear
    cross_entropy: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] = masked_cross_entropy
    core_attention: Callable[..., torch.Tensor] = sdpa_causal
    norm: Callable[[int, str, float], nn.Module] = field(default=None)  # type: ignore[assignment]
    head_norm: Callable[[int, str, float], nn.Module] = field(default=None)  # type: ignore[assignment]
    weight_grad: Optional[WeightGrad] = None  # the norms' (when `norm` is left default) and the experts' hook
    # Layout-independent dropout (dropout.py): the run seed, this rank's TP rank (its heads start at
    # tp_rank x local heads) and which of the `sequence_shards` sequence pieces it holds.
    dropout_seed: int = 0
    tp_rank: int = 0
    sequence_shard_rank: int = 0
    # Position offset of this rank's sequence chunk (context parallel); a function of seq length.
    position_ids: Optional[Callable[[int, torch.device], torch.Tensor]] = None
    # Ranks that split the sequence of the hidden states between blocks (TP under sequence parallelism):
    # a pipeline stage that receives hidden states rebuilds the full local sequence length from it.
    sequence_shards: int = 1
    # Expert parallelism (tricorn/parallel/expert.py): this rank's (ep rank, ep size), and the function
    # that runs token copies through experts spread over the ep group; None runs them locally (moe.py).
    expert_parallel: tuple[int, int] = (0, 1)
    expert_dispatch: Optional[Callable[..., torch.Tensor]] = None
    # Sums a router statistic (per-expert copy counts) over the `sequence_shards` ranks of one microbatch, so an
    # MoE layer that sees one sequence shard balances over the whole sequence (moe.py); None: nothing to sum.
    sequence_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    # Expert tensor parallelism (tricorn/parallel/expert.py): this rank's (TP rank, ETP size) of each routed
    # expert's w1 rows / w2 columns, and the two TP collectives around the experts: `expert_tp_enter` makes a
    # tensor shaped like the hidden states the same on every TP rank (under SP gathers the sequence), and
    # `expert_tp_exit` sums the experts' partial outputs over TP (under SP back to the sequence shard).
    expert_tensor_parallel: tuple[int, int] = (0, 1)
    expert_tp_enter: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    expert_tp_exit: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def __post_init__(self) -> None:
        if self.norm is None:
            self.norm = functools.partial(make_norm, weight_grad=self.weight_grad)
        if self.head_norm is None:
            self.head_norm = functools.partial(make_norm, weight_grad=self.weight_grad)


def make_norm(dim: int, kind: str, eps: float, weight_grad: Optional[WeightGrad] = None) -> nn.Module:
    return (RMSNorm if kind == "RMSNorm" else LayerNorm)(dim, eps, weight_grad)


def local_spec() -> LayerSpec:
    return LayerSpec()
