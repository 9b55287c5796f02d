"""A Llama/GPT decoder you can read top to bottom.

    tokens -> embedding (+ learned positions) -> [block] x L -> final norm -> head -> loss
    block:  x + attn(norm(x)) then x + mlp(norm(x)), pre-norm, dropout on both branches
    attn:   fused QKV (grouped by key/value head; optional bias), optional per-head q/k norm, RoPE, causal SDPA,
            output projection; head dim --kv-channels (default hidden / heads)
    mlp:    SwiGLU (gate and up fused, interleaved) or GeLU; or a mixture of experts (moe.py)

Hidden states are sequence-first, [seq, batch, hidden], as in Megatron: a sequence shard
(sequence and context parallelism) is then one contiguous block, gathered and scattered
without transposes. Token ids and labels come in as [batch, seq]; the loss and the logits
go out as [batch, seq(, vocab)]. Attention sees [batch, heads, seq, head_dim] views of
sequence-first q, k and v (SDPA writes its output in q's layout, so the output projection
reads it without a copy). Norms, softmax and the loss run in fp32.

The model takes every layer class from a LayerSpec (spec.py), so tensor,
sequence and context parallelism plug in without a single collective here. A
pipeline stage builds only its part: `layer_ids` are global layer indices (they
name the parameters, so init and checkpoints are the same at any split),
`pre_process` adds the embedding, `post_process` the final norm, head and loss.

Fused weights are laid out so that any contiguous slice of their rows is whole
units - whole query groups for QKV ([q heads of the group, k, v] per group,
Megatron's layout) and whole (gate, up) pairs for SwiGLU - which is what lets a
column-parallel split keep them intact at any TP size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tricorn.config import ModelConfig
from tricorn.model.dropout import (
    ATTENTION_OUTPUT,
    ATTENTION_PROBS,
    MLP_OUTPUT,
    AttentionDropout,
    DropoutKey,
    hidden_dropout,
    sample_ids_or_default,
)
from tricorn.model.init import INIT_KEY_ATTR, SHARD_ATTR, ShardInfo, init_weights, shard_info
from tricorn.model.layers import RopeScaling, Rotary
from tricorn.model.lean import rope, split_qkv_rope, swiglu
from tricorn.model.moe import MoEMLP
from tricorn.model.spec import LayerSpec, local_spec


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, layer_id: int = 0):
        super().__init__()
        self.spec = spec
        self.layer_id = layer_id
        self.seq_length = cfg.seq_length
        self.head_dim = cfg.head_dim
        self.q_per_group = cfg.num_attention_heads // cfg.kv_heads
        self.dropout_p = cfg.attention_dropout
        qkv_out = cfg.kv_heads * (self.q_per_group + 2) * self.head_dim
        self.wqkv = spec.column_linear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)  # --add-qkv-bias: here only
        self.wo = spec.row_linear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, bias=not cfg.disable_bias_linear)
        # --qk-layernorm: one norm over each head's d features, shared by the heads, for queries and one for keys.
        self.q_layernorm = self.k_layernorm = None
        if cfg.qk_layernorm:
            self.q_layernorm = spec.head_norm(self.head_dim, cfg.normalization, cfg.norm_epsilon)
            self.k_layernorm = spec.head_norm(self.head_dim, cfg.normalization, cfg.norm_epsilon)

    def forward(
        self, x: torch.Tensor, rotary: Optional[Rotary], position_ids: torch.Tensor, sample_ids: Optional[Sequence[int]] = None
    ) -> torch.Tensor:
        qkv = self.wqkv(x)
        s, b = qkv.shape[:2]
        # [s, b, local groups, q_per_group + 2, d]: the group count is whatever slice this rank holds.
        qkv = qkv.view(s, b, -1, self.q_per_group + 2, self.head_dim)
        cos, sin = rotary.rows(position_ids, qkv.dtype) if rotary is not None else (None, None)
        # q, k, v as separate [s, b, heads, d] tensors (RoPE'd): attention keeps exactly these, and the QKV
        # output is freed. The core sees them as [b, heads, s, d] views.
        q, k, v = self._split(qkv, cos, sin)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = self.spec.core_attention(q, k, v, self._dropout(sample_ids, b, local_heads=q.shape[1]))
        # [b, heads, s, d] -> [s, b, heads * d]: a view when the kernel wrote q's layout (SDPA does).
        return self.wo(out.permute(2, 0, 1, 3).flatten(2))

    def _split(
        self, qkv: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [s, b, heads, d]; with --qk-layernorm q and k are normalised per head before RoPE (Qwen3's order)."""
        if self.q_layernorm is None:
            return split_qkv_rope(qkv, self.q_per_group, cos, sin)
        q, k, v = split_qkv_rope(qkv, self.q_per_group, None, None)
        q, k = self.q_layernorm(q), self.k_layernorm(k)
        return (q, k, v) if cos is None else (rope(q, cos, sin), rope(k, cos, sin), v)

    def _dropout(self, sample_ids: Optional[Sequence[int]], batch: int, local_heads: int) -> Optional[AttentionDropout]:
        if not self.training or self.dropout_p == 0.0:
            return None
        ids = sample_ids_or_default(sample_ids, batch)
        key = DropoutKey(self.spec.dropout_seed, ids, self.layer_id, ATTENTION_PROBS, self.seq_length)
        return AttentionDropout(self.dropout_p, key, head_offset=self.spec.tp_rank * local_heads)


class Activation(nn.Module):
    """The MLP's nonlinearity (a module so selective recompute can drop and rebuild its output)."""

    def __init__(self, gated: bool):
        super().__init__()
        self.gated = gated

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return swiglu(h) if self.gated else F.gelu(h)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, ffn_size: Optional[int] = None):
        super().__init__()
        self.act = Activation(cfg.swiglu)
        bias = not cfg.disable_bias_linear
        ffn = ffn_size or cfg.ffn_size
        # SwiGLU rows interleave (gate_i, up_i) so any contiguous slice holds whole pairs.
        self.w1 = spec.column_linear(cfg.hidden_size, ffn * (2 if cfg.swiglu else 1), bias=bias)
        self.w2 = spec.row_linear(ffn, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)))


def moe_mlp(cfg: ModelConfig, spec: LayerSpec) -> MoEMLP:
    """The mixture-of-experts MLP (moe.py), with its optional shared expert built like a dense MLP."""
    shared = cfg.moe_shared_expert_intermediate_size
    return MoEMLP(cfg, spec, MLP(cfg, spec, ffn_size=shared) if shared else None)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, layer_id: int = 0):
        super().__init__()
        self.spec = spec
        self.layer_id = layer_id
        self.seq_length = cfg.seq_length
        self.attention_norm = spec.norm(cfg.hidden_size, cfg.normalization, cfg.norm_epsilon)
        self.attention = Attention(cfg, spec, layer_id)
        self.mlp_norm = spec.norm(cfg.hidden_size, cfg.normalization, cfg.norm_epsilon)
        self.mlp = moe_mlp(cfg, spec) if cfg.is_moe_layer(layer_id) else MLP(cfg, spec)
        self.hidden_dropout = cfg.hidden_dropout

    def _dropout(
        self, x: torch.Tensor, site: int, position_ids: torch.Tensor, sample_ids: Optional[Sequence[int]]
    ) -> torch.Tensor:
        if not self.training or self.hidden_dropout == 0.0:
            return x
        # The branch output is this rank's sequence shard (SP) of the positions `position_ids` lists (CP).
        rows = position_ids.chunk(self.spec.sequence_shards)[self.spec.sequence_shard_rank]
        key = DropoutKey(
            self.spec.dropout_seed, sample_ids_or_default(sample_ids, x.shape[1]), self.layer_id, site, self.seq_length
        )
        # hidden_dropout takes [b, s, h]: a transposed view, and its mask is drawn in x's own memory layout.
        return hidden_dropout(x.transpose(0, 1), self.hidden_dropout, key, rows).transpose(0, 1)

    def forward(
        self, x: torch.Tensor, rotary: Optional[Rotary], position_ids: torch.Tensor, sample_ids: Optional[Sequence[int]] = None
    ) -> torch.Tensor:
        attn = self.attention(self.attention_norm(x), rotary, position_ids, sample_ids)
        x = x + self._dropout(attn, ATTENTION_OUTPUT, position_ids, sample_ids)
        return x + self._dropout(self.mlp(self.mlp_norm(x)), MLP_OUTPUT, position_ids, sample_ids)


def rotary_of(cfg: ModelConfig) -> Rotary:
    scaling = None
    if cfg.use_rope_scaling:
        scaling = RopeScaling(
            cfg.rope_scaling_factor,
            cfg.rope_scaling_low_freq_factor,
            cfg.rope_scaling_high_freq_factor,
            cfg.rope_scaling_original_max_position_embeddings,
        )
    angles_dtype = torch.float32 if cfg.rotary_angles_dtype == "float32" else torch.float64
    return Rotary(cfg.head_dim, cfg.max_positions, cfg.rotary_base, angles_dtype, scaling)


class GPTModel(nn.Module):
    """One pipeline stage (or the whole model) of the decoder.

    forward(inputs, labels) takes token ids on the first stage and hidden states
    elsewhere; it returns hidden states, or the per-token fp32 loss on the last stage.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        spec: Optional[LayerSpec] = None,
        layer_ids: Optional[Sequence[int]] = None,
        pre_process: bool = True,
        post_process: bool = True,
        padded_vocab_size: Optional[int] = None,
    ):
        super().__init__()
        spec = spec or local_spec()
        self.cfg = cfg
        self.spec = spec
        self.pre_process, self.post_process = pre_process, post_process
        self.vocab_size = cfg.vocab_size
        vocab = padded_vocab_size or cfg.padded_vocab_size(1)
        self.tied = not cfg.untie_embeddings_and_output_weights
        learned = cfg.position_embedding_type == "learned_absolute"
        if pre_process:
            self.tok_embeddings = spec.embedding(vocab, cfg.hidden_size, scatter_output=not learned)
            self.pos_embeddings = nn.Embedding(cfg.max_positions, cfg.hidden_size) if learned else None
            self.sequence_scatter = spec.sequence_scatter() if learned else None
        ids = list(range(cfg.num_layers)) if layer_ids is None else list(layer_ids)
        # Keys are global layer indices so parameter names do not depend on the pipeline split.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, spec, layer_id=i) for i in ids})
        self.rotary = None if learned else rotary_of(cfg)
        if post_process:
            self.norm = spec.norm(cfg.hidden_size, cfg.normalization, cfg.norm_epsilon)
            # A tied head on a stage without the embedding keeps its own copy, initialised
            # from the embedding's name and kept equal by the trainer (grad all-reduce).
            own_weight = not self.tied or not pre_process
            self.output = spec.output_head(cfg.hidden_size, vocab, tied=not own_weight)
            if self.tied and not pre_process:
                setattr(self.output.weight, INIT_KEY_ATTR, "tok_embeddings.weight")
        # Vocabulary-sized weights are padded; record the real row count (global shape)
        # when the spec's layer did not already describe a tensor-parallel split.
        for module in (getattr(self, "tok_embeddings", None), getattr(self, "output", None)):
            weight = getattr(module, "weight", None)
            if isinstance(weight, nn.Parameter) and shard_info(weight) is None:
                setattr(weight, SHARD_ATTR, ShardInfo(dim=0, rank=0, world=1, full_size=cfg.vocab_size))

    def init_weights(self, seed: int) -> None:
        init_weights(self, seed, self.cfg.init_method_std, self.cfg.num_layers)

    def _position_ids(self, seq: int, device: torch.device) -> torch.Tensor:
        if self.spec.position_ids is not None:
            return self.spec.position_ids(seq, device)
        return torch.arange(seq, device=device)

    def forward(
        self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None, sample_ids: Optional[Sequence[int]] = None
    ) -> torch.Tensor:
        """`inputs`: token ids [b, s] on the first stage, else the previous stage's hidden states [s, b, h];
        `labels` [b, s]; `sample_ids`: the global sample index of each row, which dropout masks are drawn by
        (dropout.py). Returns hidden states [s, b, h], the per-token loss [b, s] or the logits [b, s, V]."""
        # Hidden states from a previous pipeline stage may be sequence-sharded; token ids never are.
        seq = inputs.shape[1] if self.pre_process else inputs.shape[0] * self.spec.sequence_shards
        position_ids = self._position_ids(seq, inputs.device)
        if self.pre_process:
            x = self.tok_embeddings(inputs.t().contiguous())  # sequence-first from here on
            if self.pos_embeddings is not None:
                x = self.sequence_scatter(x + self.pos_embeddings(position_ids).unsqueeze(1))
        else:
            x = inputs
        for layer in self.layers.values():
            x = layer(x, self.rotary, position_ids, sample_ids)
        if not self.post_process:
            return x
        logits = self.head(x)
        if labels is None:
            return logits.transpose(0, 1)
        return self.spec.cross_entropy(logits, labels.t(), self.vocab_size).t()

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the output head: logits [s, b, V] (V/t columns under TP). A region of its own, which
        --torch-compile compiles like a layer; the loss stays outside it (parallel/compile.py says why)."""
        head_weight = self.tok_embeddings.weight if (self.tied and self.pre_process) else None
        return self.output(self.norm(x), head_weight)
