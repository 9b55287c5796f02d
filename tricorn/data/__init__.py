"""Data: tokenizers, Megatron-compatible indexed datasets, GPT samples, blending, DP-invariant loaders."""
