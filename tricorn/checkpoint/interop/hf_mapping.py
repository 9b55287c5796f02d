"""What corresponds to what between Hugging Face's LlamaForCausalLM and tricorn: configs and tensors.

Pure functions, no files and no collectives (hf.py reads and writes).
The tensor mapping is exact, so a round trip is bit-exact:
    q/k/v_proj       -> attention.wqkv, rows regrouped per key/value group [q heads of the group, k, v]
    gate/up_proj     -> mlp.w1, rows interleaved (w1[0::2] is gate, w1[1::2] is up)
    o_proj/down_proj -> attention.wo / mlp.w2; norms and embeddings by name
There is no RoPE permutation: Hugging Face's Llama and tricorn both rotate halves.
Memory: fuse/split make one new tensor the size of their input.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from tricorn.config import ModelConfig

_HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class ConvertError(ValueError):
    """Bad input for a conversion; the message is one line saying what to fix."""


# ---------------------------------------------------------------- configs


def model_config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """The tricorn model of a LlamaForCausalLM config.json; ConvertError for what tricorn cannot represent."""
    arch = hf.get("architectures") or []
    if hf.get("model_type") != "llama" or (arch and arch != ["LlamaForCausalLM"]):
        raise ConvertError(
            f"{where}: model_type {hf.get('model_type')!r} ({', '.join(arch) or 'no architectures'}) is not supported; "
            "import-hf reads LlamaForCausalLM checkpoints (Llama 2, 3, 3.1)"
        )
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    kv = hf.get("num_key_value_heads") or heads
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf['hidden_act']!r} (tricorn's SwiGLU uses silu)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        problems.append("linear biases (attention_bias/mlp_bias)")
    if hf.get("head_dim") not in (None, hidden // heads):
        problems.append(f"head_dim {hf['head_dim']} != hidden_size / num_attention_heads = {hidden // heads}")
    scaling = hf.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if scaling and rope_type != "llama3":
        problems.append(f"rope_scaling type {rope_type!r} (tricorn supports 'llama3')")
    if problems:
        raise ConvertError(f"{where}: unsupported Llama variant: {'; '.join(problems)}")
    max_pos = hf.get("max_position_embeddings", 2048)
    m = ModelConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hidden,
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=kv if kv != heads else None,
        group_query_attention=kv != heads,
        seq_length=max_pos,
        max_position_embeddings=max_pos,
        position_embedding_type="rope",
        rotary_base=float(hf.get("rope_theta", 10000.0)),
        # transformers computes the RoPE angles in float32: the imported model is that model, bit for bit.
        rotary_angles_dtype="float32",
        normalization="RMSNorm",
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        swiglu=True,
        disable_bias_linear=True,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        init_method_std=float(hf.get("initializer_range", 0.02)),
        vocab_size=hf["vocab_size"],
    )
    if scaling:
        m.use_rope_scaling = True
        m.rope_scaling_factor = float(scaling["factor"])
        m.rope_scaling_low_freq_factor = float(scaling["low_freq_factor"])
        m.rope_scaling_high_freq_factor = float(scaling["high_freq_factor"])
        m.rope_scaling_original_max_position_embeddings = int(scaling["original_max_position_embeddings"])
    return m


def hf_config_from_model(m: ModelConfig, dtype: torch.dtype, extra: Optional[dict] = None) -> dict:
    """config.json of LlamaForCausalLM for tricorn model `m` (ConvertError when it is not a Llama)."""
    problems = []
    if not m.swiglu:
        problems.append("a GeLU MLP (needs --swiglu)")
    if m.normalization != "RMSNorm":
        problems.append(f"{m.normalization} (needs RMSNorm)")
    if m.position_embedding_type != "rope":
        problems.append(f"{m.position_embedding_type} positions (needs rope)")
    if not m.disable_bias_linear:
        problems.append("linear biases (needs --disable-bias-linear)")
    if problems:
        raise ConvertError(f"export-hf writes LlamaForCausalLM, but this checkpoint's model has {', '.join(problems)}")
    scaling = None
    if m.use_rope_scaling:
        scaling = {
            "rope_type": "llama3",
            "factor": m.rope_scaling_factor,
            "low_freq_factor": m.rope_scaling_low_freq_factor,
            "high_freq_factor": m.rope_scaling_high_freq_factor,
            "original_max_position_embeddings": m.rope_scaling_original_max_position_embeddings,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_positions,
        "rms_norm_eps": m.norm_epsilon,
        "rope_theta": m.rotary_base,
        "rope_scaling": scaling,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "vocab_size": m.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": m.attention_dropout,
        "initializer_range": m.init_method_std,
        "pretraining_tp": 1,
        "use_cache": True,
        # transformers >= 4.56 reads "dtype", older versions and other tools "torch_dtype".
        "dtype": _HF_DTYPE_NAMES[dtype],
        "torch_dtype": _HF_DTYPE_NAMES[dtype],
        **(extra or {}),
    }


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
        elif isinstance(value, list):  # --window-size LEFT,RIGHT (Megatron's form)
            flags += [flag, ",".join(str(v) for v in value)]
        else:
            flags += [flag, str(int(value) if isinstance(value, float) and value.is_integer() else value)]
    return flags


# ---------------------------------------------------------------- the tensor mapping


@dataclass(frozen=True)
class Mapped:
    """One tricorn tensor and the Hugging Face tensors it is made of."""

    name: str  # tricorn parameter name (the checkpoint key without "model.")
    parts: tuple[str, ...]
    kind: str = "copy"  # "copy" | "qkv" | "gate_up"


def tensor_map(m: ModelConfig) -> list[Mapped]:
    out = [Mapped("tok_embeddings.weight", ("model.embed_tokens.weight",))]
    for i in range(m.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn = tuple(f"{hf}self_attn.{x}_proj.weight" for x in "qkv")
        out += [
            Mapped(f"{ours}attention_norm.weight", (f"{hf}input_layernorm.weight",)),
            Mapped(f"{ours}attention.wqkv.weight", attn, "qkv"),
            Mapped(f"{ours}attention.wo.weight", (f"{hf}self_attn.o_proj.weight",)),
            Mapped(f"{ours}mlp_norm.weight", (f"{hf}post_attention_layernorm.weight",)),
            Mapped(f"{ours}mlp.w1.weight", (f"{hf}mlp.gate_proj.weight", f"{hf}mlp.up_proj.weight"), "gate_up"),
            Mapped(f"{ours}mlp.w2.weight", (f"{hf}mlp.down_proj.weight",)),
        ]
    out.append(Mapped("norm.weight", ("model.norm.weight",)))
    if m.untie_embeddings_and_output_weights:
        out.append(Mapped("output.weight", ("lm_head.weight",)))
    return out


def hf_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, d = m.hidden_size, m.head_dim
    shapes = {"embed_tokens": (m.vocab_size, h), "lm_head": (m.vocab_size, h), "q_proj": (m.num_attention_heads * d, h)}
    shapes.update({"k_proj": (m.kv_heads * d, h), "v_proj": (m.kv_heads * d, h), "o_proj": (h, m.num_attention_heads * d)})
    shapes.update({"gate_proj": (m.ffn_size, h), "up_proj": (m.ffn_size, h), "down_proj": (h, m.ffn_size)})
    return shapes


def expected_shape(hf_name: str, m: ModelConfig) -> tuple[int, ...]:
    module = hf_name.split(".")[-2]
    return hf_shapes(m).get(module, (m.hidden_size,))  # the rest are norm weights


def fuse(kind: str, parts: list[torch.Tensor], m: ModelConfig) -> torch.Tensor:
    """Hugging Face tensors -> the tricorn tensor (a new contiguous tensor; exact)."""
    if kind == "copy":
        return parts[0]
    h = m.hidden_size
    if kind == "qkv":
        q, k, v = parts
        groups, d = m.kv_heads, m.head_dim
        grouped = [q.view(groups, -1, d, h), k.view(groups, 1, d, h), v.view(groups, 1, d, h)]
        return torch.cat(grouped, dim=1).view(-1, h)
    gate, up = parts
    return torch.stack([gate, up], dim=1).view(-1, h)


def split(kind: str, t: torch.Tensor, m: ModelConfig) -> list[torch.Tensor]:
    """The tricorn tensor -> its Hugging Face tensors (contiguous copies; exact)."""
    if kind == "copy":
        return [t]
    h = m.hidden_size
    if kind == "qkv":
        q_per_group, d = m.num_attention_heads // m.kv_heads, m.head_dim
        grouped = t.view(m.kv_heads, q_per_group + 2, d, h)
        pieces = (grouped[:, :q_per_group], grouped[:, q_per_group], grouped[:, q_per_group + 1])
        return [p.reshape(-1, h).contiguous() for p in pieces]
    return [t[0::2].contiguous(), t[1::2].contiguous()]


def fused_shape(mp: Mapped, m: ModelConfig) -> tuple[int, ...]:
    shapes = [expected_shape(p, m) for p in mp.parts]
    return (sum(s[0] for s in shapes), *shapes[0][1:])
