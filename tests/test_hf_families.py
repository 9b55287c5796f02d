"""Hugging Face families beyond Llama (issue 40): Qwen2, Qwen3, Mistral, Mixtral, Qwen3-MoE, in transformers 4 and 5.

- transformers 4.57 (the dev extra's pin): a random tiny model of each family is saved by transformers, imported,
  and must give transformers' logits; its export must load in transformers with the same tensors, bit for bit.
- transformers 5: tests/fixtures/hf5/ holds a tiny model per family saved by transformers 5.24 with its logits
  (scripts/make_hf_fixtures.py; its config.json keeps rope_theta in rope_parameters, Qwen3-MoE's expert count
  under num_local_experts). The import must give those logits, and its export must load in transformers 4.57.
- Training from the import at TP2 + SP x PP2 (4 ranks, --use-checkpoint-args) starts at the single-process loss.
- config.json: every key read, checked, ignored or refused by name; transformers' defaults per family.
- Presets: the published parameter counts; a preset or checkpoint contradicted by a flag is one line.

Bounds: logits within 1e-5 of the largest logit (the issue's; test_hf.LOGITS_RTOL and its argument).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import test_hf
import torch
import transformers
from badinput import assert_refused
from harness import FP32_RTOL, run_layout
from test_hf import assert_logits_close, tricorn_model

from tricorn.checkpoint.interop.hf import export_hf, import_hf, read_model_config
from tricorn.checkpoint.interop.hf_config import FAMILIES, FAMILY_DEFAULTS, ConvertError, model_config_from_hf
from tricorn.cli import main as cli
from tricorn.config import PRESETS, ModelConfig
from tricorn.planning.memory import active_params, total_params

FIXTURES = Path(__file__).parent / "fixtures" / "hf5"
QUIET = dict(console=lambda _: None)
VOCAB = 300
SMALL = {**test_hf.SMALL, "rope_theta": 50000.0}
# family -> (config class, model class, config keywords): transformers 4.57's classes. Qwen3 and Qwen3-MoE at head
# dim 24 (64 / 4 = 16), Mistral with its default 4096-token window (>= 128 positions: it never masks), Qwen2 tied.
TF4 = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, intermediate_size=48)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True),
    ),
}


def save_tf4(family: str, path: Path):
    cfg_name, model_name, extra = TF4[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**{**SMALL, **extra})).eval()
    with torch.no_grad():  # random norm weights and biases: a norm or bias mapped to the wrong place shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape) * 0.2 + (0.0 if name.endswith("bias") else 1.0))
    model.save_pretrained(path, max_shard_size="200KB")
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))


def architecture(family: str) -> str:
    return TF4[family][1]


@pytest.mark.parametrize("family", list(TF4))
def test_transformers4_import_logits_and_export_round_trip(tmp_path, family):
    hf = save_tf4(family, tmp_path / "hf")
    ckpt = import_hf(tmp_path / "hf", tmp_path / "ckpt", **QUIET)
    tok = tokens()
    with torch.no_grad():
        assert_logits_close(tricorn_model(ckpt)(tok), hf(tok).logits)
    # Mistral's math is Llama's: export-hf writes Llama unless asked for the family by name.
    export_hf(tmp_path / "ckpt", tmp_path / "out", max_shard_bytes=100_000, architecture=architecture(family), **QUIET)
    back = getattr(transformers, architecture(family)).from_pretrained(tmp_path / "out").eval()
    ours, theirs = hf.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), f"{key} changed in the round trip"
    with torch.no_grad():
        assert torch.equal(back(tok).logits, hf(tok).logits)  # the same model, bit for bit


@pytest.mark.parametrize("family", sorted(p.name for p in FIXTURES.iterdir()))
def test_transformers5_fixture_import_logits_and_export_loads_in_transformers4(tmp_path, family):
    config = json.loads((FIXTURES / family / "config.json").read_text())
    assert config["transformers_version"].startswith("5.") and "rope_theta" not in config  # rope_parameters holds it
    ckpt = import_hf(FIXTURES / family, tmp_path / "ckpt", **QUIET)
    ref = np.load(FIXTURES / family / "reference.npz")
    tok, theirs = torch.from_numpy(ref["tokens"]), torch.from_numpy(ref["logits"])
    with torch.no_grad():
        assert_logits_close(tricorn_model(ckpt)(tok), theirs)
    export_hf(tmp_path / "ckpt", tmp_path / "out", architecture=architecture(family), **QUIET)
    back = getattr(transformers, architecture(family)).from_pretrained(tmp_path / "out").eval()
    from safetensors.torch import load_file

    original = load_file(FIXTURES / family / "model.safetensors")
    exported = back.state_dict()
    for key, value in original.items():
        assert torch.equal(value, exported[key]), f"{key} changed in the round trip"
    with torch.no_grad():
        assert_logits_close(back(tok).logits, theirs)


def test_transformers5_fixtures_cover_every_family():
    made = {json.loads((FIXTURES / f / "config.json").read_text())["architectures"][0] for f in TF4}
    assert made == set(FAMILIES)
    total = sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file())
    assert total < 1.5 * 2**20, f"fixtures grew to {total / 2**20:.1f} MiB"


# ---------------------------------------------------------------- training from an import


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe", "mixtral"])
def test_training_from_the_import_at_tp2_sp_pp2_starts_at_the_single_process_loss(tmp_path, family):
    """Qwen2's QKV biases, Qwen3-MoE's q/k norms at head dim 16 and its experts, Mixtral's experts: resharded from the
    import (saved whole) onto TP2 + SP x PP2, the model flags from the checkpoint (--use-checkpoint-args). The
    first loss is the mean over the first global batch (mock samples 0-3) before any step: the single-process
    model's loss on those tokens, computed here. Llama's import trains at TP2 x PP2 in tests/test_hf.py; Mistral's
    model is Llama's (the same tensors) and Qwen3's a part of Qwen3-MoE's and Qwen2's."""
    from tricorn.data.base import MockSamples

    ckpt = import_hf(FIXTURES / family, tmp_path / "ckpt", **QUIET)
    flags = ["--load", str(tmp_path / "ckpt"), "--use-checkpoint-args", "--device", "cpu", "--mock-data", "--seq-length", "32"]
    flags += "--micro-batch-size 1 --global-batch-size 4 --train-iters 1 --lr 1e-3 --log-interval 1 --seed 1234".split()
    flags += "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2".split()
    run = run_layout(flags, 4, tmp_path / "run")
    assert "training starts at iteration 0" in run.stdout
    samples = torch.stack([MockSamples(read_model_config(ckpt).vocab_size, 32, 1234)[i] for i in range(4)])
    with torch.no_grad():
        one = tricorn_model(ckpt)(samples[:, :-1], samples[:, 1:]).mean().item()
    # harness.FP32_RTOL: the layout and the microbatch sums reorder fp32 sums only (its argument).
    assert abs(run.losses[0] - one) <= FP32_RTOL * abs(one), (run.losses, one)


# ---------------------------------------------------------------- config.json


def _config(family: str, **keys) -> dict:
    arch = next(a for a, f in FAMILIES.items() if f.model_type == family)
    base = dict(architectures=[arch], model_type=family, vocab_size=100, hidden_size=64, intermediate_size=96)
    return {**base, "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128, **keys}


def test_rope_theta_is_read_where_transformers_4_and_5_put_it():
    v4 = model_config_from_hf(_config("llama", rope_theta=50000.0))
    v5 = model_config_from_hf(_config("llama", rope_parameters={"rope_type": "default", "rope_theta": 50000.0}))
    assert v4 == v5 and v5.rotary_base == 50000.0  # the measured misread: transformers 5's theta silently 10000
    scaled = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    v5 = model_config_from_hf(_config("llama", rope_parameters={**scaled, "rope_theta": 5e5}))  # transformers 5 default
    assert v5.use_rope_scaling and v5.rope_scaling_original_max_position_embeddings == 128 and v5.rotary_base == 5e5
    v4 = model_config_from_hf(_config("llama", rope_scaling={**scaled, "original_max_position_embeddings": 64}))
    assert v4.rope_scaling_original_max_position_embeddings == 64 and v4.rotary_base == 10000.0
    assert model_config_from_hf(_config("mixtral")).rotary_base == 1e6  # Mixtral's own default theta
    both = _config("llama", rope_theta=1e4, rope_parameters={"rope_type": "default", "rope_theta": 5e4})
    with pytest.raises(ConvertError, match="rope_theta 10000.0 at the top level but 50000.0 in rope_parameters"):
        model_config_from_hf(both)


@pytest.mark.parametrize(
    "family, keys, named",
    [
        ("llama", dict(attention_bias=True), "attention_bias True"),
        ("qwen3", dict(attention_bias=True), "attention_bias True"),
        ("llama", dict(mlp_bias=True), "mlp_bias True"),
        ("llama", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        ("llama", dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
        ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn'"),
        ("llama", dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope type 'linear'"),
        ("qwen2", dict(use_mrope=True), "use_mrope True"),
        ("qwen3_moe", dict(norm_topk_prob=False), "norm_topk_prob False"),
        ("qwen3_moe", dict(norm_topk_prob=True, decoder_sparse_step=2), "decoder_sparse_step 2"),
        ("qwen3_moe", dict(norm_topk_prob=True, mlp_only_layers=[1]), "mlp_only_layers [1]"),
        ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise 0.1"),
        ("qwen2", dict(use_sliding_window=True, sliding_window=32, max_window_layers=1), "on 1 of 2 layers"),
        ("qwen2", dict(layer_types=["bogus", "bogus"]), "layer_types ['bogus', 'bogus']"),
        ("qwen3", dict(layer_types=["full_attention"]), "layer_types ['full_attention']"),  # 1 type for 2 layers
        ("qwen2", dict(use_sliding_window=True, sliding_window=32, max_window_layers=None), "max_window_layers None"),
        (
            "qwen3",
            dict(use_sliding_window=True, sliding_window=32, layer_types=["full_attention", "sliding_attention"]),
            "on 1 of 2",
        ),
        ("llama", dict(quantization_config={"quant_method": "fp8"}), "a quantized checkpoint"),
        ("llama", dict(some_new_key=1), "unknown key 'some_new_key'"),
    ],
)
def test_keys_that_change_the_model_are_refused_by_name(family, keys, named):
    config = _config(family, **keys)
    with pytest.raises(ConvertError, match="does not implement") as e:
        model_config_from_hf(config)
    assert named in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_keys_that_do_not_limit_or_do_not_matter_are_accepted():
    cases = [
        _config("mistral", sliding_window=4096),  # at 128 positions the window never masks
        _config("qwen2", use_sliding_window=False, sliding_window=32, max_window_layers=1),  # the switch is off
        _config("qwen3", sliding_window=None, layer_types=["full_attention"] * 2, max_window_layers=28),
        _config("llama", torch_dtype="bfloat16", use_cache=True, transformers_version="4.40.0", pretraining_tp=1),
        _config("llama", bos_token_id=1, eos_token_id=[2, 3], _name_or_path="x", max_length=20, temperature=0.7),
        _config("mixtral", output_router_logits=True, router_aux_loss_coef=0.02, head_dim=None),
    ]
    for config in cases:
        model_config_from_hf(config)
    assert model_config_from_hf(cases[-1]).moe_aux_loss_coeff == 0.02


def test_mistral_sliding_window_is_window_size_n_minus_1(tmp_path):
    """transformers' sliding_window N (query i sees keys i - N + 1 .. i) imports as --window-size N-1,0: tricorn's
    logits are transformers' at 40 positions with an 8-key window (which masks most of every row), and export-hf
    writes sliding_window 8 back. A window at least as long as the sequences is dropped, as it masks nothing."""
    assert model_config_from_hf(_config("mistral", sliding_window=64)).window_size == [63, 0]
    assert model_config_from_hf(_config("mistral", max_position_embeddings=8192)).window_size == [4095, 0]  # the default
    assert model_config_from_hf(_config("mistral", sliding_window=128)).window_size is None
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(transformers.MistralConfig(**{**SMALL, "sliding_window": 8})).eval()
    hf.save_pretrained(tmp_path / "hf")
    ckpt = import_hf(tmp_path / "hf", tmp_path / "ckpt", **QUIET)
    assert read_model_config(ckpt).window_size == [7, 0]
    tok = tokens()
    with torch.no_grad():
        windowed = hf(tok).logits
        assert_logits_close(tricorn_model(ckpt)(tok), windowed)
        hf.config.sliding_window = None  # the same weights without the window: far from it, so the window was applied
        assert (hf(tok).logits - windowed).abs().max() > 1e-2
    export_hf(tmp_path / "ckpt", tmp_path / "out", **QUIET)  # a window and no QKV bias: Mistral by default
    assert json.loads((tmp_path / "out" / "config.json").read_text())["sliding_window"] == 8


def _config_class(family: str):
    return getattr(
        transformers, next(f for f in FAMILIES.values() if f.model_type == family).architecture[: -len("ForCausalLM")] + "Config"
    )


def test_family_defaults_are_transformers():
    """FAMILY_DEFAULTS (keys a config.json may leave out) against transformers 4.57's config classes. sliding_window
    against the class with its switch on: Qwen2/3's and Qwen3-MoE's config keeps it only then."""
    for family, defaults in FAMILY_DEFAULTS.items():
        plain, switched_on = _config_class(family)(), _config_class(family)(use_sliding_window=True)
        for key, value in defaults.items():
            theirs = switched_on if key == "sliding_window" else plain
            if key == "hidden_act" or not hasattr(theirs, key):
                continue  # families without the switch apply any window they have; hidden_act is CHECKED, not a default
            want = theirs.num_attention_heads if value == "heads" else value
            got = getattr(theirs, key)
            if value == "hidden/heads":  # transformers 4.57's Mistral and Mixtral: None, which means the same
                want, got = (
                    theirs.hidden_size // theirs.num_attention_heads,
                    got or theirs.hidden_size // theirs.num_attention_heads,
                )
            assert got == want, (family, key, got, want)


def _transformers_window(config: dict) -> list:
    """The window transformers 4.57 applies on each layer of `config` (None: full attention): Qwen2/3's attention reads
    its config's layer_types (built from use_sliding_window, sliding_window and max_window_layers when absent); the
    other families' apply their config's sliding_window on every layer."""
    theirs = _config_class(config["model_type"])(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    types = getattr(theirs, "layer_types", None) or ["sliding_attention"] * theirs.num_hidden_layers
    return [theirs.sliding_window if t == "sliding_attention" else None for t in types]


@pytest.mark.parametrize(
    "family, keys",
    [
        ("qwen2", dict(use_sliding_window=True, sliding_window=32)),  # max_window_layers 28: no layer of 2 has it
        ("qwen3", dict(use_sliding_window=True, sliding_window=32)),
        ("qwen2", dict(use_sliding_window=True)),  # sliding_window 4096 too
        ("qwen2", dict(use_sliding_window=True, sliding_window=32, max_window_layers=0)),  # every layer
        ("qwen3", dict(use_sliding_window=True, sliding_window=32, max_window_layers=2)),  # none
        ("qwen2", dict(use_sliding_window=True, sliding_window=32, num_hidden_layers=30)),  # layers 28 and 29: refused
        ("qwen3", dict(use_sliding_window=True, max_window_layers=1, max_position_embeddings=8192)),  # 4096 on layer 1
        ("qwen3", dict(use_sliding_window=True, sliding_window=None, max_window_layers=0)),  # a null window: none
        ("qwen3_moe", dict(use_sliding_window=True, sliding_window=32, norm_topk_prob=True)),  # Qwen3-MoE: every layer
        ("qwen3_moe", dict(use_sliding_window=True, sliding_window=32, max_window_layers=1, norm_topk_prob=True)),  # unread
        ("mistral", dict(max_position_embeddings=8192)),  # 4096 on every layer
        ("mixtral", dict(max_position_embeddings=8192)),  # none
    ],
)
def test_absent_window_keys_mean_what_they_mean_to_transformers(family, keys):
    """The sliding window of a config.json that leaves out sliding_window or max_window_layers: the one transformers
    applies on every layer (--window-size N-1,0), none, or refused naming the window when only some layers have it."""
    config = _config(family, **keys)
    per_layer = _transformers_window(config)
    if len(set(per_layer)) > 1:
        with pytest.raises(ConvertError, match=f"sliding_window {max(w for w in per_layer if w)} below"):
            model_config_from_hf(config)
        return
    window = per_layer[0] if per_layer[0] is not None and per_layer[0] < config["max_position_embeddings"] else None
    assert model_config_from_hf(config).window_size == (None if window is None else [window - 1, 0]), per_layer


def test_qwen2_window_switched_on_below_max_window_layers_imports_without_a_window(tmp_path):
    """Qwen2 with use_sliding_window and an 8-key window but no max_window_layers (28: no layer of 2 has the window):
    tricorn's logits are transformers', which are those without the window."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**{**SMALL, "use_sliding_window": True, "sliding_window": 8})
    hf = transformers.Qwen2ForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in ("max_window_layers", "layer_types"):  # what a config.json written before layer_types existed holds
        saved.pop(key)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(saved))
    ckpt = import_hf(tmp_path / "hf", tmp_path / "ckpt", **QUIET)
    assert read_model_config(ckpt).window_size is None
    tok = tokens()
    with torch.no_grad():
        assert_logits_close(tricorn_model(ckpt)(tok), hf(tok).logits)


def test_unsupported_family_names_the_supported_ones():
    with pytest.raises(ConvertError) as e:
        model_config_from_hf({**_config("llama"), "architectures": ["GemmaForCausalLM"], "model_type": "gemma"})
    assert all(arch in str(e.value) for arch in FAMILIES), str(e.value)


# ---------------------------------------------------------------- bad input through the command line


def _refused(capsys, argv: list[str], where: Path, needle: str) -> None:
    before = sorted(where.rglob("*"))
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tricorn: error: ") and "\n" not in err and needle in err, err
    assert sorted(where.rglob("*")) == before, "a refused import wrote files"


def test_import_bad_inputs_are_one_line_and_write_nothing(tmp_path, capsys):
    import shutil

    def copy(name: str) -> Path:
        shutil.copytree(FIXTURES / "qwen3", tmp_path / name)
        return tmp_path / name

    def imp(src: Path, needle: str) -> None:
        _refused(capsys, ["import-hf", "--input", str(src), "--save", str(tmp_path / "out" / src.name)], tmp_path, needle)

    index = copy("index")
    (index / "model.safetensors").rename(index / "model-00001-of-00002.safetensors")
    weight_map = dict.fromkeys(["model.embed_tokens.weight"], "model-00002-of-00002.safetensors")
    (index / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    imp(index, "names shard 'model-00002-of-00002.safetensors'")
    shape = copy("shape")
    config = json.loads((shape / "config.json").read_text())
    (shape / "config.json").write_text(json.dumps({**config, "head_dim": 8}))
    imp(shape, "'model.layers.0.self_attn.q_proj.weight' has shape (64, 32), config.json implies (32, 32)")
    family = copy("family")
    (family / "config.json").write_text(json.dumps({**config, "architectures": ["PhiForCausalLM"], "model_type": "phi"}))
    imp(family, "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM")
    key = copy("key")
    (key / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    imp(key, "attention_bias True")


def test_export_refuses_what_the_family_cannot_hold(tmp_path, capsys):
    import_hf(FIXTURES / "qwen3", tmp_path / "ckpt", **QUIET)
    argv = ["export-hf", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"), "--architecture"]
    _refused(capsys, argv + ["LlamaForCausalLM"], tmp_path, "as LlamaForCausalLM: it has --qk-layernorm")
    # Llama has no sliding window: a windowed model is written as Mistral or Mixtral, or refused
    from tricorn.checkpoint.interop.hf_config import export_family

    windowed = ModelConfig(swiglu=True, disable_bias_linear=True, window_size=[7, 0], vocab_size=100)
    assert export_family(windowed).architecture == "MistralForCausalLM"
    with pytest.raises(ConvertError, match="--window-size 7,0"):
        export_family(windowed, "LlamaForCausalLM")


# ---------------------------------------------------------------- presets and where the model flags come from

# Parameters of the releases: their model.safetensors.index.json total_size / 2 (bf16), which the model cards
# round to 7.61B, 8.2B, 7.25B and 30.5B (3.3B activated).
PUBLISHED = {"qwen2.5-7b": 7_615_616_512, "qwen3-8b": 8_190_735_360, "mistral-7b": 7_248_023_552, "qwen3-30b-a3b": 30_532_122_624}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_presets_have_the_published_parameter_counts(preset):
    m = ModelConfig(**PRESETS[preset])
    assert total_params(m) == PUBLISHED[preset]
    if preset == "qwen3-30b-a3b":  # the card's "3.3B activated": 3.35B, embedding and head included as here
        assert 3.3e9 <= active_params(m) < 3.4e9
    else:
        assert active_params(m) == total_params(m)


def test_a_preset_contradicted_by_a_flag_is_one_line(tmp_path):
    base = ["--model-preset", "qwen3-8b", "--mock-data", "--device", "cpu", "--save", "ckpt"]
    assert_refused(
        base + ["--kv-channels", "64"],
        tmp_path,
        needle="--kv-channels 64 contradicts --model-preset qwen3-8b, which has head dim 128",
    )
    assert_refused(base + ["--normalization", "LayerNorm"], tmp_path, needle="--normalization LayerNorm contradicts")
    (tmp_path / "run.yaml").write_text("model:\n  hidden_size: 1024\n")
    assert_refused(base + ["--config", "run.yaml"], tmp_path, needle="--hidden-size 1024 contradicts")


def test_use_checkpoint_args_takes_the_model_and_refuses_a_contradicting_flag(tmp_path):
    from tricorn.config_args import config_from_args

    import_hf(FIXTURES / "qwen3_moe", tmp_path / "ckpt", **QUIET)
    flags = ["--load", str(tmp_path / "ckpt"), "--use-checkpoint-args", "--mock-data", "--device", "cpu"]
    cfg = config_from_args(flags, world_size=1)
    assert cfg.model == read_model_config(sorted((tmp_path / "ckpt").glob("iter_*"))[0])
    same = config_from_args(flags + ["--kv-channels", "16", "--ffn-hidden-size", "48", "--seq-length", "8"], world_size=1)
    assert same.model.head_dim == 16 and same.model.seq_length == 8  # values equal to the checkpoint's; the run's length
    assert_refused(flags + ["--num-experts", "8"], tmp_path, needle="--num-experts 8 contradicts the checkpoint, which sets 4")
    assert_refused(["--use-checkpoint-args", "--mock-data", "--vocab-size", "8"], tmp_path, needle="needs --load")
