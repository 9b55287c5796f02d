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
# Qwen and Mistral (issue 40): the architecture fields are the released config.json's, so `tricorn import-hf` of
# the release gives this model (the preset's seq_length is only the default run length, up to
# max_position_embeddings). Parameter counts against the model cards: tests/test_hf_families.py.
PRESETS["qwen2.5-7b"] = dict(  # Qwen2.5-7B: biases on Q, K and V only
    num_layers=28,
    hidden_size=3584,
    ffn_hidden_size=18944,
    num_attention_heads=28,
    num_query_groups=4,
    group_query_attention=True,
    add_qkv_bias=True,
    seq_length=4096,
    max_position_embeddings=131072,
    vocab_size=152064,
    rotary_base=1000000.0,
    norm_epsilon=1e-6,
)
PRESETS["qwen3-8b"] = dict(  # Qwen3-8B: per-head q/k RMSNorm
    num_layers=36,
    hidden_size=4096,
    ffn_hidden_size=12288,
    num_attention_heads=32,
    num_query_groups=8,
    group_query_attention=True,
    qk_layernorm=True,
    seq_length=4096,
    max_position_embeddings=40960,
    vocab_size=151936,
    rotary_base=1000000.0,
    norm_epsilon=1e-6,
)
PRESETS["mistral-7b"] = dict(  # Mistral-7B-v0.3 (no sliding window)
    num_layers=32,
    hidden_size=4096,
    ffn_hidden_size=14336,
    num_attention_heads=32,
    num_query_groups=8,
    group_query_attention=True,
    seq_length=4096,
    max_position_embeddings=32768,
    vocab_size=32768,
    rotary_base=1000000.0,
)
PRESETS["qwen3-30b-a3b"] = dict(  # Qwen3-30B-A3B: 128 experts, 8 per token; head dim 128 at hidden 2048 / 32 heads
    num_layers=48,
    hidden_size=2048,
    ffn_hidden_size=6144,
    num_attention_heads=32,
    num_query_groups=4,
    group_query_attention=True,
    kv_channels=128,
    qk_layernorm=True,
    seq_length=4096,
    max_position_embeddings=40960,
    vocab_size=151936,
    rotary_base=1000000.0,
    norm_epsilon=1e-6,
    num_experts=128,
    moe_router_topk=8,
    moe_ffn_hidden_size=768,
    moe_aux_loss_coeff=0.001,
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
