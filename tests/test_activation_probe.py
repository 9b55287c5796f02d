"""The saved-tensor probe against the per-layer activation formula (planning/activations.py), recompute savings,
de-duplication, in-flight count.

Run as a script (`python tests/test_activation_probe.py tp`) it is the 2-rank worker of the TP/SP check.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tricorn.config import ModelConfig
from tricorn.model.transformer import GPTModel
from tricorn.parallel.recompute import apply_recompute
from tricorn.planning.activations import layer_activation_bytes, layer_activation_terms
from tricorn.training.activation_probe import ActivationProbe

B = 2  # micro batch


def _config(s: int, h: int, **kw) -> ModelConfig:
    """Our block: RMSNorm, SwiGLU, GQA (2 groups), RoPE."""
    base = dict(
        num_layers=2,
        hidden_size=h,
        num_attention_heads=4,
        group_query_attention=True,
        num_query_groups=2,
        swiglu=True,
        seq_length=s,
        vocab_size=100,
    )
    return ModelConfig(**(base | kw))


def _measure(cfg: ModelConfig, recompute: dict | None = None, dtype: torch.dtype = torch.float32) -> ActivationProbe:
    for key, value in (recompute or {}).items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    model = GPTModel(cfg, padded_vocab_size=128)
    model.init_weights(1)
    model.to(dtype)
    apply_recompute([model], cfg)
    tokens = torch.randint(0, 100, (B, cfg.seq_length))
    with ActivationProbe([model]) as probe:
        model(tokens, tokens).float().mean().backward()
    return probe


def _formula(cfg: ModelConfig, **kw) -> float:
    """The one formula for the probed CPU block (fp32 unless ``precision`` says otherwise)."""
    return layer_activation_bytes(cfg, **(dict(seq=cfg.seq_length, micro_batch=B, precision="fp32", device="cpu") | kw))


def _within(measured: float, predicted: float, rel: float) -> None:
    # Byte counts, not float sums: `rel` is each caller's acceptance bound for formula vs probe.
    assert predicted > 0 and abs(measured - predicted) <= rel * predicted, f"measured {measured} vs formula {predicted}"


@pytest.mark.parametrize("s, h", [(64, 64), (128, 128)])
def test_probe_matches_formula_without_recompute(s: int, h: int) -> None:
    cfg = _config(s, h)
    summary = _measure(cfg).summary()
    # 10%: the activation formula's acceptance bound against the probe (byte counts, no float reorder involved).
    _within(summary.activation_bytes_per_layer, _formula(cfg), 0.10)
    assert summary.activation_bytes_other > 0  # embedding, final norm, head and loss are counted apart
    # Integer byte sums in float64 (exact below 2^53): approx's default rel 1e-6 only absorbs the float conversion.
    assert summary.activation_bytes_per_microbatch == pytest.approx(
        2 * summary.activation_bytes_per_layer + summary.activation_bytes_other
    )


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_qk_layernorm_qkv_bias_kv_channels_to_the_byte(normalization: str) -> None:
    """Issue 40: the per-head norms keep q and k before them and their statistics (planning qk_norm_bytes), RoPE after
    them only its rows; head dim 24 (not 64 / 4) widens q, k, v and the attention output. The QKV bias keeps nothing."""
    cfg = _config(64, 64, qk_layernorm=True, add_qkv_bias=True, disable_bias_linear=True, kv_channels=24)
    cfg.normalization = normalization
    # Saved-tensor bytes against the formula: no float rounding anywhere, so exact.
    assert _measure(cfg).summary().activation_bytes_per_layer == _formula(cfg)


@pytest.mark.parametrize("s, h", [(64, 64), (32, 128)])
def test_full_recompute_keeps_only_the_layer_input(s: int, h: int) -> None:
    cfg = _config(s, h)
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    per_layer = _measure(cfg, full).summary().activation_bytes_per_layer
    # 5%: the layer input plus the small position-id tensor kept beside it.
    _within(per_layer, 4 * s * B * h, 0.05)  # fp32 layer input


@pytest.mark.parametrize(
    "modules, dropout",
    [(["core_attn"], 0.0), (["core_attn"], 0.1), (["mlp"], 0.0), (["norm"], 0.0), (["core_attn", "mlp", "norm"], 0.1)],
)
def test_selective_saves_what_the_formula_says(modules: list[str], dropout: float) -> None:
    """attention dropout > 0 runs explicit attention (model/dropout.py): there core_attn drops the s x s tensors."""
    cfg = _config(64, 64, attention_dropout=dropout)
    none = _measure(_config(64, 64, attention_dropout=dropout)).summary().activation_bytes_per_layer
    selective = _measure(cfg, dict(recompute_granularity="selective", recompute_modules=modules)).summary()
    saved = none - selective.activation_bytes_per_layer
    predicted = _formula(cfg) - _formula(cfg, recompute="selective", recompute_modules=modules)
    assert saved > 0
    # 10%: the activation formula's acceptance bound, for the recompute savings.
    _within(saved, predicted, 0.10)


def test_formula_agrees_with_korthikanti_style_terms() -> None:
    """TP divides the TP region, SP the norms too; selective and full remove their terms."""
    cfg = _config(256, 128, hidden_dropout=0.1)
    kw = dict(seq=256, micro_batch=B, precision="bf16", device="cuda")
    one = layer_activation_terms(cfg, **kw)
    tp = layer_activation_terms(cfg, **kw, tp=4)
    sp = layer_activation_terms(cfg, **kw, tp=4, sequence_parallel=True)
    assert tp.mlp == one.mlp / 4 and tp.qkv == one.qkv / 4 and tp.norm_inputs == one.norm_inputs
    assert sp.norm_inputs == one.norm_inputs / 4 and sp.dropout_masks == one.dropout_masks / 4
    assert sp.linear_inputs == one.linear_inputs / 4  # the column-parallel linears keep their sequence shard
    full_sp = layer_activation_bytes(cfg, **kw, tp=4, sequence_parallel=True, recompute="full")
    assert full_sp == 2 * 256 * B * 128 / 4


def test_llama2_7b_tp2_sp_meets_megatrons_count() -> None:
    """Llama-2-7B, TP2 SP, s 4096, b 1, bf16: the layer keeps Megatron's sb(12h + 4h_kv + 6f)/t (269.5 MB) plus
    the softmax and norm statistics and the RoPE rows (within 1.05x); norm + mlp_act recompute go below it."""
    from tricorn.config import PRESETS

    cfg = ModelConfig(**{k: v for k, v in PRESETS["llama2-7b"].items() if hasattr(ModelConfig, k)})
    s, t, h, f = 4096, 2, cfg.hidden_size, cfg.ffn_size
    h_kv = cfg.kv_heads * cfg.head_dim
    megatron = s * (12 * h + 4 * h_kv + 6 * f) / t
    assert round(megatron / 1e6, 1) == 269.5
    kw = dict(seq=s, micro_batch=1, tp=t, sequence_parallel=True, precision="bf16", device="cuda")
    terms = layer_activation_terms(cfg, **kw)
    statistics = terms.norm_stats + terms.attention_core + terms.rope_tables
    assert terms.total - statistics == megatron
    assert terms.total <= 1.05 * megatron
    lean = layer_activation_bytes(cfg, **kw, recompute="selective", recompute_modules=("norm", "mlp_act"))
    assert lean - statistics == s * (8 * h + 4 * h_kv + 4 * f) / t < megatron


RECOMPUTE_VARIANTS = [
    (None, ()),
    ("selective", ("core_attn",)),
    ("selective", ("mlp",)),
    ("selective", ("norm",)),
    ("selective", ("core_attn", "mlp", "norm")),
    ("selective", ("norm", "mlp_act")),
    ("full", ()),
]


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize(
    "precision, hidden_dropout, attention_dropout",
    [("fp32", 0.0, 0.0), ("fp32", 0.1, 0.1), ("bf16", 0.0, 0.0), ("bf16", 0.1, 0.0), ("bf16", 0.1, 0.1)],
)
def test_probe_equals_the_formula_to_the_byte(
    normalization: str, precision: str, hidden_dropout: float, attention_dropout: float
) -> None:
    """Every recompute variant, LayerNorm's statistics, the bool dropout masks and, with attention dropout, the
    explicit attention of model/dropout.py (fp32 and bf16). Full recompute: the chunk's first checkpoint also
    keeps the int64 position ids."""
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    s = 64
    for recompute, modules in RECOMPUTE_VARIANTS:
        cfg = _config(s, 64, normalization=normalization, hidden_dropout=hidden_dropout, attention_dropout=attention_dropout)
        settings = {
            None: {},
            "selective": dict(recompute_granularity="selective", recompute_modules=list(modules)),
            "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        }[recompute]
        measured = {layer: values[0] for layer, values in _measure(cfg, settings, dtype).layer_bytes().items()}
        predicted = _formula(cfg, precision=precision, recompute=recompute, recompute_modules=modules)
        position_ids = 8 * s if recompute == "full" else 0
        assert measured == {"0": predicted + position_ids, "1": predicted}, (recompute, modules)


# ---------------------------------------------------------------- probe mechanics


class _Views(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2  # mul by a constant saves nothing
        a, b = y[:, :4], y[:, 4:]  # views of y's storage, each saved by its own op
        return (a * a).sum() + (b * b).sum()


def test_views_of_one_storage_count_once() -> None:
    x = torch.randn(16, 8, requires_grad=True)
    with ActivationProbe([_Views()]) as probe:
        probe.chunks[0](x).backward()
    assert probe.summary().activation_bytes_other == 16 * 8 * 4


def test_peak_microbatches_in_flight() -> None:
    cfg = _config(16, 32)
    model = GPTModel(cfg, padded_vocab_size=128)
    tokens = torch.randint(0, 100, (B, 16))
    with ActivationProbe([model]) as gpipe:
        losses = [model(tokens, tokens).mean() for _ in range(3)]  # all forwards, then all backwards
        for loss in losses:
            loss.backward()
    assert gpipe.summary().peak_microbatches_in_flight == 3
    with ActivationProbe([model], max_forwards=2) as one_at_a_time:
        for _ in range(3):
            model(tokens, tokens).mean().backward()
    assert one_at_a_time.summary().peak_microbatches_in_flight == 1
    assert len(one_at_a_time.records) == 2
    with torch.no_grad(), ActivationProbe([model]) as no_grad:
        model(tokens, tokens)
    assert not no_grad.records


# ---------------------------------------------------------------- TP / SP on 2 ranks


def test_tp_and_sp_match_the_formula() -> None:
    """To the byte on 2 ranks: TP (fp32), TP+SP in fp32 and bf16, each without recompute and selective variants."""
    from harness import run_script

    out = run_script(Path(__file__), 2, ["tp"])
    assert out.count("ok tp") == 4 and out.count("ok sp") == 8, out


def _tp_worker() -> None:
    import torch.distributed as dist

    from tricorn.config import Config
    from tricorn.parallel.tensor import tensor_parallel_spec

    dist.init_process_group("gloo")
    for dtype, sp in ((torch.float32, False), (torch.float32, True), (torch.bfloat16, True)):
        for modules in ([], ["mlp"], ["core_attn", "mlp", "norm"], ["norm", "mlp_act"]):
            cfg = Config()
            cfg.model = _config(64, 64, hidden_dropout=0.1)
            cfg.parallel.tensor_model_parallel_size = 2
            cfg.parallel.sequence_parallel = sp
            recompute = "selective" if modules else None
            cfg.model.recompute_granularity, cfg.model.recompute_modules = recompute, modules
            model = GPTModel(cfg.model, tensor_parallel_spec(cfg, dist.group.WORLD), padded_vocab_size=256)
            model.init_weights(1)
            model.to(dtype)
            apply_recompute([model], cfg.model)
            tokens = torch.randint(0, 100, (B, 64), generator=torch.Generator().manual_seed(0))
            with ActivationProbe([model]) as probe:
                model(tokens, tokens).mean().backward()
            measured = probe.summary().activation_bytes_per_layer
            precision = "fp32" if dtype == torch.float32 else "bf16"
            predicted = _formula(
                cfg.model, tp=2, sequence_parallel=sp, recompute=recompute, recompute_modules=modules, precision=precision
            )
            what = f"{'sp' if sp else 'tp'} {precision} {' '.join(modules) or 'none'}"
            assert measured == predicted, f"{what}: measured {measured} vs formula {predicted}"
            print(f"ok {what} {measured} {predicted}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__" and sys.argv[1:] == ["tp"]:
    _tp_worker()
