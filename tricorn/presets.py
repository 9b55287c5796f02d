"""Model presets (`--model-preset`): published shapes, as ModelConfig field values. A leaf: imports nothing."""

from __future__ import annotations

from typing import Any

# Published shapes. ffn sizes are the released checkpoints' (Llama rounds 8h/3 up).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        num_layers=4,
        hidden_size=128,
        ffn_hidden_size=352,
        num_attention_heads=4,
        num_query_groups=2,
        group_query_attention=True,
        seq_length=256,
        swiglu=True,
        disable_bias_linear=True,
        untie_embeddings_and_output_weights=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
    ),
    "llama2-7b": dict(
        num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32, seq_length=4096, vocab_size=32000
    ),
    "llama2-13b": dict(
        num_layers=40, hidden_size=5120, ffn_hidden_size=13824, num_attention_heads=40, seq_length=4096, vocab_size=32000
    ),
    "llama2-70b": dict(
        num_layers=80,
        hidden_size=8192,
        ffn_hidden_size=28672,
        num_attention_heads=64,
        num_query_groups=8,
        group_query_attention=True,
        seq_length=4096,
        vocab_size=32000,
    ),
    "llama3-8b": dict(
        num_layers=32,
        hidden_size=4096,
        ffn_hidden_size=14336,
        num_attention_heads=32,
        num_query_groups=8,
        group_query_attention=True,
        seq_length=8192,
        vocab_size=128256,
        rotary_base=500000.0,
    ),
    "llama3-70b": dict(
        num_layers=80,
        hidden_size=8192,
        ffn_hidden_size=28672,
        num_attention_heads=64,
        num_query_groups=8,
        group_query_attention=True,
        seq_length=8192,
        vocab_size=128256,
        rotary_base=500000.0,
    ),
    "codellama-34b": dict(
        num_layers=48,
        hidden_size=8192,
        ffn_hidden_size=22016,
        num_attention_heads=64,
        num_query_groups=8,
        group_query_attention=True,
        seq_length=16384,
        vocab_size=32016,
        rotary_base=1000000.0,
    ),
}
PRESETS["moe-tiny"] = {**PRESETS["tiny"], "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 128}
PRESETS["mixtral-8x7b"] = dict(
    num_layers=32,
    hidden_size=4096,
    ffn_hidden_size=14336,
    num_attention_heads=32,
    num_query_groups=8,
    group_query_attention=True,
    seq_length=4096,
    max_position_embeddings=32768,
    vocab_size=32000,
    rotary_base=1000000.0,
    num_experts=8,
    moe_router_topk=2,
    moe_aux_loss_coeff=0.02,
)
_LLAMA_COMMON = dict(
    swiglu=True,
    disable_bias_linear=True,
    untie_embeddings_and_output_weights=True,
    normalization="RMSNorm",
    position_embedding_type="rope",
    norm_epsilon=1e-5,
)
for _name, _shape in PRESETS.items():
    if _name not in ("tiny", "moe-tiny"):
        PRESETS[_name] = {**_LLAMA_COMMON, **_shape}
