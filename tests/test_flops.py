"""FLOPs formula: published formulas for GPT-3 175B and Llama, and an exact matmul count of a tiny decoder."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tricorn.config import PRESETS, ModelConfig
from tricorn.config_args import config_from_args
from tricorn.planning import flops
from tricorn.planning.hardware import GPUS, peak_tflops


def gpt3_175b() -> ModelConfig:
    # Narayanan's assumptions: MHA, 4h GeLU MLP, tied head, vocab 51200 (50257 padded).
    return ModelConfig(num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048, vocab_size=51200, swiglu=False)


def test_gpt3_175b_full_recompute_matches_narayanan() -> None:
    m, batch = gpt3_175b(), 1536
    ours = flops.iteration_flops(m, batch, recompute_granularity="full", flash_attention=False, recompute_early_stop=False)
    published = flops.narayanan_flops(batch, 2048, 96, 12288, 51200)
    # 1%: the published figure's rounding; the next line checks the unrounded formula.
    assert ours.hardware == pytest.approx(published, rel=1e-2)
    # The same numbers without rounding: the formulas are the same sum of matmuls.
    # Two float64 evaluations of the same sum of ~10 matmul terms in another order: ~1e-15 apart, 1e-12 is room.
    assert ours.hardware == pytest.approx(published, rel=1e-12)
    # Narayanan's model FLOPs are 3/4 of the transformer part plus the head: 72*B*s*l*h^2*(1 + s/6h + V/12lh).
    # The same closed form in float64, reordered: approx's default rel 1e-6 is far above float64 rounding (1e-15).
    assert ours.model == pytest.approx(72 * batch * 2048 * 96 * 12288**2 * (1 + 2048 / (6 * 12288) + 51200 / (12 * 96 * 12288)))


@pytest.mark.parametrize("preset", ["llama2-7b", "llama2-70b", "llama3-8b", "codellama-34b"])
def test_llama_model_flops_match_megatron(preset: str) -> None:
    m = ModelConfig(**PRESETS[preset])
    ours = flops.iteration_flops(m, 512)
    # Megatron's formula and ours: the same terms summed in another order in float64 (~1e-15 apart).
    assert ours.model == pytest.approx(flops.megatron_flops(m, 512, m.padded_vocab_size(1)), rel=1e-12)


def test_6n_rule_of_thumb_for_llama2_7b() -> None:
    # Without the attention term, model FLOPs per token are 6 * (matmul parameters): a sanity anchor.
    m = ModelConfig(**PRESETS["llama2-7b"])
    f = flops.iteration_flops(m, 1)
    layer = flops.layer_forward_flops_per_token(m)
    matmul_params = m.num_layers * (4 * 4096**2 + 3 * 4096 * 11008) + 4096 * 32000
    # Float64 sums of integer FLOP counts; the difference keeps ~1e-15 relative error, default rel 1e-6 is room.
    assert f.model - 3 * f.tokens * m.num_layers * layer.core == pytest.approx(6 * matmul_params * f.tokens)


def test_causal_halving_halves_only_the_attention_core() -> None:
    m = ModelConfig(**PRESETS["llama3-8b"])
    full, half = flops.iteration_flops(m, 8), flops.iteration_flops(m, 8, causal_halving=True)
    core = 3 * full.tokens * m.num_layers * flops.layer_forward_flops_per_token(m).core
    # Float64 arithmetic on integer FLOP counts: default rel 1e-6, far above its ~1e-15 rounding.
    assert full.model - half.model == pytest.approx(core / 2)


def test_recompute_adds_hardware_flops_only() -> None:
    m = ModelConfig(**PRESETS["llama2-7b"])
    base = flops.iteration_flops(m, 4, flash_attention=False)
    full = flops.iteration_flops(m, 4, recompute_granularity="full", flash_attention=False, recompute_early_stop=False)
    sel = flops.iteration_flops(m, 4, recompute_granularity="selective", flash_attention=False)
    layer = flops.layer_forward_flops_per_token(m)
    assert full.model == sel.model == base.model
    # Float64 arithmetic on integer FLOP counts: default rel 1e-6, far above its ~1e-15 rounding.
    assert full.recompute == pytest.approx(base.tokens * m.num_layers * layer.total)
    assert sel.recompute == pytest.approx(base.tokens * m.num_layers * layer.core)
    # Full recompute costs one more forward of the layers: hardware/model just under 4/3.
    assert 1.25 < full.hardware / full.model < 4 / 3


def test_block_recompute_counts_layers_per_chunk() -> None:
    argv = "--model-preset llama2-7b --recompute-granularity full --recompute-method block --recompute-num-layers 3"
    cfg = config_from_args([*argv.split(), "--pipeline-model-parallel-size", "4", "--global-batch-size", "4"], world_size=4)
    assert flops.recomputed_layer_count(cfg) == 12
    f = flops.iteration_flops_for_config(cfg, flash_attention=False)
    layer = flops.layer_forward_flops_per_token(cfg.model)
    down_proj = 2 * 4096 * 11008  # torch's non-reentrant checkpoint does not re-run the last matmul
    # Float64 arithmetic on integer FLOP counts: default rel 1e-6, far above its ~1e-15 rounding.
    assert f.recompute == pytest.approx(f.tokens * 12 * (layer.total - down_proj))


def test_mfu_and_peak_table() -> None:
    assert GPUS["a100-80gb"].bf16_tflops == 312 and GPUS["h100-80gb"].bf16_tflops == 989
    assert GPUS["h200-141gb"].bf16_tflops == 989
    assert peak_tflops("h100-80gb", "fp8") == 2 * 989
    assert peak_tflops("h100-80gb", "bf16", override=500.0) == 500.0
    assert peak_tflops(None, "bf16") is None  # CPU: MFU only with --peak-tflops
    with pytest.raises(ValueError, match="no fp8"):
        peak_tflops("a100-80gb", "fp8")
    # 8 GPUs doing 8 * 400e12 FLOPs in one second: 400 TFLOP/s each, MFU 400/989.
    # One float64 division each: default rel 1e-6 only absorbs its rounding.
    assert flops.tflops_per_device(8 * 400e12, 1.0, 8) == pytest.approx(400.0)
    assert flops.mfu(8 * 400e12, 1.0, 8, 989.0) == pytest.approx(400 / 989)


# ---------------------------------------------------------------- exact count on a reference decoder


class RMSNorm(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


def rope(x: torch.Tensor) -> torch.Tensor:
    b, n, s, d = x.shape
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    cos, sin = ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Block(nn.Module):
    """Plain PyTorch GQA + SwiGLU (or GeLU) block: the architecture tricorn's model implements."""

    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        h, d, bias = m.hidden_size, m.head_dim, not m.disable_bias_linear
        self.m = m
        self.norm1, self.norm2 = RMSNorm(h), RMSNorm(h)
        self.q = nn.Linear(h, m.num_attention_heads * d, bias=bias)
        self.k = nn.Linear(h, m.kv_heads * d, bias=bias)
        self.v = nn.Linear(h, m.kv_heads * d, bias=bias)
        self.o = nn.Linear(h, h, bias=bias)
        self.w1 = nn.Linear(h, m.ffn_size, bias=bias)
        self.w3 = nn.Linear(h, m.ffn_size, bias=bias) if m.swiglu else None
        self.w2 = nn.Linear(m.ffn_size, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        m, d = self.m, self.m.head_dim
        y = self.norm1(x)
        q = rope(self.q(y).view(b, s, m.num_attention_heads, d).transpose(1, 2))
        k = rope(self.k(y).view(b, s, m.kv_heads, d).transpose(1, 2))
        v = self.v(y).view(b, s, m.kv_heads, d).transpose(1, 2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, h))
        y = self.norm2(x)
        inner = F.silu(self.w1(y)) * self.w3(y) if self.w3 is not None else F.gelu(self.w1(y))
        return x + self.w2(inner)


class Decoder(nn.Module):
    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(m.vocab_size, m.hidden_size)
        self.blocks = nn.ModuleList(Block(m) for _ in range(m.num_layers))
        self.norm = RMSNorm(m.hidden_size)
        self.head = nn.Linear(m.hidden_size, m.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def train_step(model: Decoder, tokens: torch.Tensor) -> None:
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()


TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128)


@pytest.mark.parametrize(
    "shape",
    [
        dict(TINY, ffn_hidden_size=160, swiglu=True, num_query_groups=2, group_query_attention=True, disable_bias_linear=True),
        dict(TINY, swiglu=False, disable_bias_linear=False),  # MHA, GeLU 4h, biases
    ],
    ids=["gqa-swiglu", "mha-gelu"],
)
def test_formula_equals_exact_matmul_count(shape: dict) -> None:
    torch.manual_seed(0)
    m = ModelConfig(**shape)
    model, batch = Decoder(m), 3
    tokens = torch.randint(0, m.vocab_size, (batch, m.seq_length + 1))
    counted = flops.count_matmul_flops(train_step, model, tokens)
    f = flops.iteration_flops(m, batch, vocab_size=m.vocab_size)
    assert counted > 0
    # Exact integer counts summed in float64 in two orders: 1e-12 is 1000x their rounding.
    assert counted == pytest.approx(f.hardware, rel=1e-12)  # flash attention's backward recomputes Q K^T
    assert counted - f.attention_backward_recompute == pytest.approx(f.model, rel=1e-12)


@pytest.mark.parametrize("reentrant", [False, True])
def test_exact_count_sees_recompute(reentrant: bool) -> None:
    from torch.utils.checkpoint import checkpoint

    m = ModelConfig(**dict(TINY, ffn_hidden_size=160, swiglu=True, num_query_groups=2, group_query_attention=True))
    model, tokens = Decoder(m), torch.randint(0, 128, (2, m.seq_length + 1))

    def step() -> None:
        x = model.embed(tokens[:, :-1])
        for block in model.blocks:
            x = checkpoint(block, x, use_reentrant=reentrant)
        logits = model.head(model.norm(x))
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()

    # Non-reentrant checkpoint stops before the last matmul; reentrant (Megatron's) re-runs the whole layer.
    f = flops.iteration_flops(m, 2, vocab_size=128, recompute_granularity="full", recompute_early_stop=not reentrant)
    # Exact integer counts summed in float64 in two orders: 1e-12 is 1000x their rounding.
    assert flops.count_matmul_flops(step) == pytest.approx(f.hardware, rel=1e-12)
    # isclose's default rel 1e-9: recompute adds whole layers (~25%), far above it.
    assert not math.isclose(f.hardware, f.model)
