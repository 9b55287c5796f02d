"""What corresponds to what between Hugging Face's decoder families and tricorn: tensors (configs: hf_config.py).

Pure functions, no files and no collectives (hf.py reads and writes).
The tensor mapping is exact, so a round trip is bit-exact:
    q/k/v_proj (weights, and Qwen2's biases) -> attention.wqkv, rows regrouped per key/value group [q heads, k, v]
    q_norm/k_norm (Qwen3)                    -> attention.q_layernorm / k_layernorm
    gate/up_proj (Mixtral's w1/w3)           -> mlp.w1 (each expert's: mlp.experts.<e>.w1), rows interleaved
                                                (w1[0::2] is gate, w1[1::2] is up)
    o_proj/down_proj (Mixtral's w2)          -> attention.wo / mlp.w2 (mlp.experts.<e>.w2)
    the MoE gate                             -> mlp.router.weight; norms and embeddings by name
There is no RoPE permutation: Hugging Face's families and tricorn both rotate halves.
Memory: fuse/split make one new tensor the size of their input.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

# The config mapping lives in hf_config.py; re-exported because every converter imports ConvertError from here.
from tricorn.checkpoint.interop.hf_config import (  # noqa: E402, F401
    ConvertError,
    Family,
    export_family,
    hf_config_from_model,
    model_config_from_hf,
)
from tricorn.config import ModelConfig

_ALWAYS_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "rotary_base", "vocab_size")


def model_flags(m: ModelConfig) -> list[str]:
    """The command-line flags that build model `m` (those differing from the defaults, seq length excluded)."""
    default = ModelConfig()
    flags: list[str] = []
    for f in dataclasses.fields(ModelConfig):
        value = getattr(m, f.name)
        if f.name == "seq_length" or (value == getattr(default, f.name) and f.name not in _ALWAYS_FLAGS):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags += [flag] if value else []
        else:
            flags += [flag, str(int(value) if isinstance(value, float) and value.is_integer() else value)]
    return flags


# ---------------------------------------------------------------- the tensor mapping


@dataclass(frozen=True)
class Mapped:
    """One tricorn tensor and the Hugging Face tensors it is made of, with their shapes."""

    name: str  # tricorn checkpoint key without "model." (experts: the per-expert name, ...experts.<e>.w1)
    parts: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]  # each part's shape, as config.json implies it
    kind: str = "copy"  # "copy" | "qkv" (q, k, v regrouped per key/value group) | "gate_up" (rows interleaved)

    @property
    def shape(self) -> tuple[int, ...]:
        """The tricorn tensor's shape: the parts stacked along their first dimension."""
        return (sum(s[0] for s in self.shapes), *self.shapes[0][1:])


def _attention(m: ModelConfig, hf: str, ours: str) -> list[Mapped]:
    h, d = m.hidden_size, m.head_dim
    q, kv = m.num_attention_heads * d, m.kv_heads * d
    qkv = tuple(f"{hf}self_attn.{x}_proj" for x in "qkv")
    out = [Mapped(f"{ours}attention.wqkv.weight", tuple(f"{p}.weight" for p in qkv), ((q, h), (kv, h), (kv, h)), "qkv")]
    if m.add_qkv_bias:
        out.append(Mapped(f"{ours}attention.wqkv.bias", tuple(f"{p}.bias" for p in qkv), ((q,), (kv,), (kv,)), "qkv"))
    out.append(Mapped(f"{ours}attention.wo.weight", (f"{hf}self_attn.o_proj.weight",), ((h, q),)))
    if m.qk_layernorm:
        out += [Mapped(f"{ours}attention.{x}_layernorm.weight", (f"{hf}self_attn.{x}_norm.weight",), ((d,),)) for x in "qk"]
    return out


def _mlp(hf: str, ours: str, h: int, f: int, names: tuple[str, str, str]) -> list[Mapped]:
    """A SwiGLU MLP (dense, or one expert): `names` are Hugging Face's gate, up and down projections."""
    gate, up, down = (f"{hf}{n}.weight" for n in names)
    return [Mapped(f"{ours}w1.weight", (gate, up), ((f, h), (f, h)), "gate_up"), Mapped(f"{ours}w2.weight", (down,), ((h, f),))]


def _moe(m: ModelConfig, family: Family, hf: str, ours: str) -> list[Mapped]:
    """Router and experts. tricorn saves expert e of the stacked weights as ...mlp.experts.<e>.w1 / .w2 (pieces.py)."""
    h, f, n = m.hidden_size, m.moe_ffn_size, m.num_experts
    block, names = (
        ("block_sparse_moe.", ("w1", "w3", "w2")) if family.moe == "mixtral" else ("mlp.", ("gate_proj", "up_proj", "down_proj"))
    )
    out = [Mapped(f"{ours}mlp.router.weight", (f"{hf}{block}gate.weight",), ((n, h),))]
    for e in range(n):
        for mp in _mlp(f"{hf}{block}experts.{e}.", f"{ours}mlp.experts.{e}.", h, f, names):
            out.append(Mapped(mp.name.removesuffix(".weight"), mp.parts, mp.shapes, mp.kind))
    return out


def tensor_map(m: ModelConfig, family: Family) -> list[Mapped]:
    h, v = m.hidden_size, m.vocab_size
    out = [Mapped("tok_embeddings.weight", ("model.embed_tokens.weight",), ((v, h),))]
    for i in range(m.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        out.append(Mapped(f"{ours}attention_norm.weight", (f"{hf}input_layernorm.weight",), ((h,),)))
        out += _attention(m, hf, ours)
        out.append(Mapped(f"{ours}mlp_norm.weight", (f"{hf}post_attention_layernorm.weight",), ((h,),)))
        if family.moe:
            out += _moe(m, family, hf, ours)
        else:
            out += _mlp(f"{hf}mlp.", f"{ours}mlp.", h, m.ffn_size, ("gate_proj", "up_proj", "down_proj"))
    out.append(Mapped("norm.weight", ("model.norm.weight",), ((h,),)))
    if m.untie_embeddings_and_output_weights:
        out.append(Mapped("output.weight", ("lm_head.weight",), ((v, h),)))
    return out


def fuse(mp: Mapped, parts: list[torch.Tensor], m: ModelConfig) -> torch.Tensor:
    """Hugging Face tensors -> the tricorn tensor (a new contiguous tensor; exact)."""
    if mp.kind == "copy":
        return parts[0]
    if mp.kind == "qkv":  # weights [rows, h] or biases [rows]: rows regrouped per key/value group
        q, k, v = parts
        groups, d, tail = m.kv_heads, m.head_dim, tuple(q.shape[1:])
        grouped = [q.view(groups, -1, d, *tail), k.view(groups, 1, d, *tail), v.view(groups, 1, d, *tail)]
        return torch.cat(grouped, dim=1).view(-1, *tail)
    gate, up = parts
    return torch.stack([gate, up], dim=1).view(-1, *gate.shape[1:])


def split(mp: Mapped, t: torch.Tensor, m: ModelConfig) -> list[torch.Tensor]:
    """The tricorn tensor -> its Hugging Face tensors (contiguous copies; exact)."""
    if mp.kind == "copy":
        return [t]
    if mp.kind == "qkv":
        q_per_group, d, tail = m.num_attention_heads // m.kv_heads, m.head_dim, tuple(t.shape[1:])
        grouped = t.view(m.kv_heads, q_per_group + 2, d, *tail)
        pieces = (grouped[:, :q_per_group], grouped[:, q_per_group], grouped[:, q_per_group + 1])
        return [p.reshape(-1, *tail).contiguous() for p in pieces]
    return [t[0::2].contiguous(), t[1::2].contiguous()]
