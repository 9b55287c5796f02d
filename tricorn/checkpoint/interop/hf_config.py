"""Hugging Face config.json <-> tricorn's ModelConfig, for every family import-hf and export-hf support.

Families (the `architectures` entry of config.json):

    LlamaForCausalLM     Llama 2, 3, 3.1 (llama3 RoPE scaling)
    MistralForCausalLM   Mistral: its sliding window                          -> --window-size (see below)
    Qwen2ForCausalLM     Qwen2, Qwen2.5: biases on q, k and v              -> --add-qkv-bias
    Qwen3ForCausalLM     Qwen3: per-head RMSNorm on q and k, head_dim       -> --qk-layernorm --kv-channels
    MixtralForCausalLM   Mixtral: softmax top-k router, experts w1/w3/w2    -> --num-experts
    Qwen3MoeForCausalLM  Qwen3-MoE: Qwen3's attention, top-k router, experts

Both layouts of transformers are read: 4.x writes `rope_theta` and `rope_scaling` at the top level, 5.x
writes `rope_parameters` ({"rope_theta", "rope_type", ...}); each key is looked up in both places, the dict
first (transformers 5's own priority). Every key of config.json is one of
- READ: it sets a ModelConfig field;
- CHECKED: tricorn implements one value of it (e.g. `hidden_act` silu); any other value is refused;
- IGNORED: it never changes the weights' math (bookkeeping, generation defaults, token ids);
and any other key is refused, naming it, so that a key added by a later transformers is a decision, not a
silent default. A key absent from config.json takes transformers' default for its family (FAMILY_DEFAULTS,
checked against transformers' config classes by tests/test_hf_families.py).

Sliding windows: transformers masks key j for query i when i - j >= window, so `sliding_window: N` lets a query
see N keys, itself included: Megatron's and tricorn's `--window-size N-1,0` (keys i - (N - 1) .. i;
tricorn/model/masking.py), which import-hf sets and export-hf writes back as N (Mistral and Mixtral, whose every
layer has the window). Absent keys are transformers' defaults here too: Qwen2/3's window (sliding_window 4096 when
use_sliding_window is on) is on layers max_window_layers (28) and up only, so none of a model of at most 28 layers
has it; Qwen3-MoE's is on every layer. A window on no layer, or of at least max_position_embeddings (it never masks
anything at the longest sequence the model runs), is dropped. A window on some layers only (Qwen2/3's
max_window_layers or layer_types) is refused: tricorn's window is the same on every layer.

Pure functions, no files, no collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from tricorn.config import ModelConfig

_HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class ConvertError(ValueError):
    """Bad input for a conversion; the message is one line saying what to fix."""


@dataclass(frozen=True)
class Family:
    architecture: str
    model_type: str
    qkv_bias: bool = False  # q/k/v_proj always have biases (Qwen2)
    qk_norm: bool = False  # q_norm/k_norm per head (Qwen3)
    moe: Optional[str] = None  # None, "mixtral" (block_sparse_moe.experts.E.w1/w3/w2) or "qwen3_moe" (mlp.experts.E.*)


FAMILIES: dict[str, Family] = {
    f.architecture: f
    for f in (
        Family("LlamaForCausalLM", "llama"),
        Family("MistralForCausalLM", "mistral"),
        Family("Qwen2ForCausalLM", "qwen2", qkv_bias=True),
        Family("Qwen3ForCausalLM", "qwen3", qk_norm=True),
        Family("MixtralForCausalLM", "mixtral", moe="mixtral"),
        Family("Qwen3MoeForCausalLM", "qwen3_moe", qk_norm=True, moe="qwen3_moe"),
    )
}

# transformers' defaults (4.57 and 5.x agree) for keys a config.json may leave out. "heads": num_attention_heads;
# "hidden/heads": hidden_size // num_attention_heads.
_COMMON_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "num_key_value_heads": "heads",
    "head_dim": "hidden/heads",
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "hidden_act": "silu",
    "sliding_window": None,
    "use_sliding_window": True,  # families without the switch apply any window they have
    # max_window_layers: only Qwen2/3 have it (the window's first layer); the other families window every layer
    "attention_bias": False,
    "mlp_bias": False,
}
# Qwen2/3: a window of 4096 keys when use_sliding_window is on, on the layers from max_window_layers on.
_QWEN_WINDOW = {**_COMMON_DEFAULTS, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON_DEFAULTS, "max_position_embeddings": 2048},
    "mistral": {**_COMMON_DEFAULTS, "max_position_embeddings": 131072, "num_key_value_heads": 8, "sliding_window": 4096},
    "qwen2": {**_QWEN_WINDOW, "max_position_embeddings": 32768},
    "qwen3": {**_QWEN_WINDOW, "max_position_embeddings": 32768, "head_dim": 128},
    "mixtral": {
        **_COMMON_DEFAULTS,
        "max_position_embeddings": 131072,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_jitter_noise": 0.0,
        "router_aux_loss_coef": 0.001,
    },
    "qwen3_moe": {
        **_COMMON_DEFAULTS,
        "max_position_embeddings": 32768,
        "num_key_value_heads": 4,
        "use_sliding_window": False,
        "sliding_window": 4096,  # on every layer: Qwen3-MoE has no max_window_layers
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
    },
}

# Keys that set ModelConfig fields (or decide, with the CHECKED ones, whether the model is one tricorn runs).
READ = frozenset(
    {
        "architectures",
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "initializer_range",
        "attention_dropout",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "partial_rotary_factor",
        "sliding_window",
        "use_sliding_window",
        "max_window_layers",
        "layer_types",
        "num_local_experts",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "router_aux_loss_coef",
    }
)
# Keys with the one value tricorn implements (None and absent mean the family default).
CHECKED: dict[str, tuple[Any, str]] = {
    "hidden_act": ("silu", "tricorn's SwiGLU uses silu"),
    "attention_bias": (False, "biases on q, k, v and o; tricorn has --add-qkv-bias (q, k, v: Qwen2)"),
    "mlp_bias": (False, "MLP biases"),
    "use_mrope": (False, "multimodal RoPE (Qwen2-VL)"),
    "router_jitter_noise": (0.0, "multiplicative router noise in training"),
    "decoder_sparse_step": (1, "MoE layers at (i + 1) % step == 0; tricorn's --moe-layer-freq puts them at i % freq == 0"),
    "mlp_only_layers": ([], "dense layers among the MoE ones"),
    "norm_topk_prob": (True, "top-k routing weights that do not sum to one; tricorn renormalises them"),
    "is_decoder": (False, "a decoder of an encoder-decoder model"),
    "add_cross_attention": (False, "cross-attention"),
    "is_encoder_decoder": (False, "an encoder-decoder model"),
}
# Keys that never change the math of the weights: bookkeeping, what generate() and the tokenizer use, outputs.
IGNORED = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "transformers_version",
        "torch_dtype",  # the tensors' own dtypes are what import-hf keeps
        "dtype",
        "use_cache",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "tokenizer_class",
        "output_router_logits",  # whether forward returns the router logits (the aux loss is --moe-aux-loss-coeff)
        "pretraining_tp",  # Llama's sliced matmuls when > 1: the same products, summed in another order
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "torchscript",
        "use_bfloat16",
        "tf_legacy_loss",
        "pruned_heads",
        "chunk_size_feed_forward",
        "id2label",
        "label2id",
        "problem_type",
        "finetuning_task",
        "task_specific_params",
        "prefix",
        "cross_attention_hidden_size",
        "tie_encoder_decoder",
        # generate() defaults of old configs
        "max_length",
        "min_length",
        "do_sample",
        "early_stopping",
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "repetition_penalty",
        "length_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "num_return_sequences",
        "output_scores",
        "return_dict_in_generate",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
    }
)
# Keys that name something tricorn does not read at all: a sentence says what.
REFUSED: dict[str, str] = {
    "quantization_config": "a quantized checkpoint (dequantize it to bf16/fp16/fp32 safetensors first)",
    "auto_map": "custom modeling code (auto_map)",
}
_ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta", "factor", "partial_rotary_factor"})
_LLAMA3_KEYS = frozenset({"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})


def family_of(hf: dict, where: str) -> Family:
    arch = hf.get("architectures") or []
    family = FAMILIES.get(arch[0]) if len(arch) == 1 else None
    if family is None or hf.get("model_type", family.model_type) != family.model_type:
        raise ConvertError(
            f"{where}: {', '.join(arch) or 'no architectures'} (model_type {hf.get('model_type')!r}) is not supported; "
            f"import-hf reads {', '.join(FAMILIES)}"
        )
    return family


def _rope(hf: dict, defaults: dict) -> tuple[dict, list[str]]:
    """The RoPE parameters wherever transformers 4 or 5 put them, and the problems with them."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}  # transformers 5: rope_scaling wins
    problems: list[str] = []
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        return {}, [f"rope_parameters per layer type ({params!r})"]
    rope = dict(params)
    top = hf.get("rope_theta")
    if top is not None and rope.get("rope_theta") is not None and float(top) != float(rope["rope_theta"]):
        # transformers 5 would use the dict's, transformers 4 the top-level one: two different models
        problems.append(f"rope_theta {top} at the top level but {rope['rope_theta']} in rope_parameters")
    if rope.get("rope_theta") is None:
        rope["rope_theta"] = defaults["rope_theta"] if top is None else top
    if hf.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        problems.append(f"rope type {kind!r} (tricorn implements default and llama3)")
    if float(rope.get("partial_rotary_factor") or 1.0) != 1.0:
        problems.append(f"partial_rotary_factor {rope['partial_rotary_factor']} (tricorn rotates the whole head)")
    known = _ROPE_KEYS | (_LLAMA3_KEYS if kind == "llama3" else frozenset())
    problems += [f"rope parameter {k!r}" for k in rope if k not in known and rope[k] is not None]
    if kind == "llama3":
        rope.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))  # transformers 5
    rope["rope_type"] = kind
    return rope, problems


def _window(hf: dict, defaults: dict, layers: int, max_pos: int) -> tuple[Optional[int], Optional[str]]:
    """(transformers' sliding_window when it limits attention on every layer, the problem with the window if one
    limits some layers only) (module docstring). A null sliding_window is no window, as in transformers; an absent
    one the family's default."""
    window = hf.get("sliding_window", defaults["sliding_window"])
    if not hf.get("use_sliding_window", defaults["use_sliding_window"]):
        window = None  # Qwen2/3 and Qwen3-MoE: the window exists only with use_sliding_window
    types = hf.get("layer_types")
    if types is not None:
        if (
            not isinstance(types, list)
            or len(types) != layers
            or any(t not in ("full_attention", "sliding_attention") for t in types)
        ):
            return None, f"layer_types {types!r} (one of full_attention, sliding_attention per layer)"
        windowed = [i for i, t in enumerate(types) if t == "sliding_attention"]
    elif window is None:
        windowed = []
    elif "max_window_layers" in defaults:  # Qwen2/3 without layer_types: the layers from max_window_layers on
        first = hf.get("max_window_layers", defaults["max_window_layers"])
        if not isinstance(first, int) or isinstance(first, bool):
            return None, f"max_window_layers {first!r} (the first layer with the window)"
        windowed = list(range(first, layers))
    else:  # Mistral, Mixtral, Qwen3-MoE: every layer
        windowed = list(range(layers))
    if not windowed or window is None or window >= max_pos:
        return None, None
    if len(windowed) == layers:
        return int(window), None
    return None, (
        f"sliding_window {window} below max_position_embeddings {max_pos} on {len(windowed)} of {layers} layers "
        "(tricorn's --window-size holds on every layer; a window of at least the sequence length changes nothing)"
    )


def _problems(hf: dict, family: Family, defaults: dict) -> list[str]:
    problems = [f"{k}: {why}" for k, why in REFUSED.items() if hf.get(k)]
    for key, (ok, what) in CHECKED.items():
        value = hf.get(key, defaults.get(key, ok))
        if key == "attention_bias" and family.qkv_bias:
            continue  # Qwen2's q/k/v biases are fixed by the architecture, not by this key
        if value is not None and value != ok and not (isinstance(ok, list) and not value):
            problems.append(f"{key} {value!r} ({what})")
    unknown = sorted(k for k in hf if k not in READ and k not in IGNORED and k not in CHECKED and k not in REFUSED)
    problems += [f"unknown key {k!r} (tricorn does not know whether it changes the model)" for k in unknown]
    return problems


def model_config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """tricorn's model for a config.json of any supported family and transformers version; ConvertError naming every
    key tricorn cannot represent."""
    family = family_of(hf, where)
    defaults = FAMILY_DEFAULTS[family.model_type]
    missing = [
        k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads") if k not in hf
    ]
    if missing:
        raise ConvertError(f"{where}: missing {', '.join(missing)}; is it a {family.architecture} config?")
    value = lambda key: hf[key] if hf.get(key) is not None else defaults.get(key)  # noqa: E731 - None: the default
    heads, hidden, layers = hf["num_attention_heads"], hf["hidden_size"], hf["num_hidden_layers"]
    kv = heads if value("num_key_value_heads") == "heads" else value("num_key_value_heads")
    head_dim = hidden // heads if value("head_dim") == "hidden/heads" else value("head_dim")
    max_pos = value("max_position_embeddings")
    rope, problems = _rope(hf, defaults)
    problems += _problems(hf, family, defaults)
    window, problem = _window(hf, defaults, layers, max_pos)
    problems += [problem] if problem else []
    if problems:
        raise ConvertError(f"{where}: {family.architecture} with what tricorn does not implement: {'; '.join(problems)}")
    m = ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=kv if kv != heads else None,
        group_query_attention=kv != heads,
        kv_channels=head_dim if head_dim * heads != hidden else None,
        qk_layernorm=family.qk_norm,
        seq_length=max_pos,
        max_position_embeddings=max_pos,
        position_embedding_type="rope",
        rotary_base=float(rope["rope_theta"]),
        # transformers computes the RoPE angles in float32: the imported model is that model, bit for bit.
        rotary_angles_dtype="float32",
        normalization="RMSNorm",
        norm_epsilon=float(value("rms_norm_eps")),
        swiglu=True,
        disable_bias_linear=True,
        add_qkv_bias=family.qkv_bias,
        untie_embeddings_and_output_weights=not value("tie_word_embeddings"),
        attention_dropout=float(value("attention_dropout")),
        init_method_std=float(value("initializer_range")),
        vocab_size=hf["vocab_size"],
        window_size=None if window is None else [window - 1, 0],  # N keys, the query's own included
    )
    if rope["rope_type"] == "llama3":
        m.use_rope_scaling = True
        m.rope_scaling_factor = float(rope["factor"])
        m.rope_scaling_low_freq_factor = float(rope["low_freq_factor"])
        m.rope_scaling_high_freq_factor = float(rope["high_freq_factor"])
        m.rope_scaling_original_max_position_embeddings = int(rope["original_max_position_embeddings"])
    if family.moe:
        m.num_experts = int(_experts(hf, family, defaults, where))
        m.moe_router_topk = int(value("num_experts_per_tok"))
        if family.moe == "qwen3_moe":
            m.moe_ffn_hidden_size = int(value("moe_intermediate_size"))
        m.moe_aux_loss_coeff = float(value("router_aux_loss_coef"))
    return m


def _experts(hf: dict, family: Family, defaults: dict, where: str) -> int:
    """The expert count: Mixtral's num_local_experts; Qwen3-MoE's num_experts (transformers 4), which transformers 5
    writes as num_local_experts (its attribute_map)."""
    counts = {k: hf[k] for k in ("num_experts", "num_local_experts") if hf.get(k) is not None}
    if len(set(counts.values())) > 1:
        raise ConvertError(
            f"{where}: num_experts {counts['num_experts']} and num_local_experts {counts['num_local_experts']} disagree"
        )
    default = defaults["num_local_experts" if family.moe == "mixtral" else "num_experts"]
    return int(next(iter(counts.values()), default))


# ---------------------------------------------------------------- export


# The families whose config's sliding_window applies to every layer (what --window-size is).
WINDOWED_FAMILIES = ("mistral", "mixtral")
WINDOWED_ARCHITECTURES = ("MistralForCausalLM", "MixtralForCausalLM")


def export_family(m: ModelConfig, architecture: Optional[str] = None) -> Family:
    """The family export-hf writes: `architecture` when given, else the one the model's features name."""
    if architecture is None:
        if m.num_experts is not None:
            architecture = "Qwen3MoeForCausalLM" if m.qk_layernorm else "MixtralForCausalLM"
        elif m.qk_layernorm:
            architecture = "Qwen3ForCausalLM"
        elif m.attention_window is not None and not m.add_qkv_bias:
            architecture = "MistralForCausalLM"  # Llama's math with a sliding window
        else:
            architecture = "Qwen2ForCausalLM" if m.add_qkv_bias else "LlamaForCausalLM"
    if architecture not in FAMILIES:
        raise ConvertError(f"--architecture {architecture} is not one export-hf writes: {', '.join(FAMILIES)}")
    family = FAMILIES[architecture]
    problems = []
    if not m.swiglu:
        problems.append("a GeLU MLP (needs --swiglu)")
    if m.normalization != "RMSNorm":
        problems.append(f"{m.normalization} (needs RMSNorm)")
    if m.position_embedding_type != "rope":
        problems.append(f"{m.position_embedding_type} positions (needs rope)")
    if not m.disable_bias_linear:
        problems.append("biases on every linear (needs --disable-bias-linear)")
    if m.add_qkv_bias != family.qkv_bias:
        problems.append("QKV biases" if m.add_qkv_bias else "no QKV biases")
    if m.qk_layernorm != family.qk_norm:
        problems.append("--qk-layernorm" if m.qk_layernorm else "no q/k norms")
    if (m.num_experts is not None) != bool(family.moe):
        problems.append("a mixture of experts" if m.num_experts else "a dense MLP")
    if m.num_experts is not None:
        problems += _moe_export_problems(m)
    if m.attention_window is not None and family.model_type not in WINDOWED_FAMILIES:
        problems.append(f"--window-size {m.attention_window},0 (write it as {' or '.join(WINDOWED_ARCHITECTURES)})")
    if problems:
        raise ConvertError(f"export-hf cannot write this checkpoint as {architecture}: it has {', '.join(problems)}")
    return family


def _moe_export_problems(m: ModelConfig) -> list[str]:
    problems = []
    if m.moe_layer_freq != 1:
        problems.append(f"--moe-layer-freq {m.moe_layer_freq} (Hugging Face's families have MoE in every layer)")
    if m.moe_shared_expert_intermediate_size:
        problems.append("a shared expert")
    if m.moe_router_score_function != "softmax" or m.moe_router_enable_expert_bias:
        problems.append("a sigmoid router or an expert bias (Mixtral and Qwen3-MoE route by softmax)")
    return problems


def hf_config_from_model(
    m: ModelConfig, dtype: torch.dtype, extra: Optional[dict] = None, architecture: Optional[str] = None
) -> dict:
    """config.json of the family `architecture` (default: export_family's choice) for tricorn model `m`. Written in
    transformers 4's layout (rope_theta, rope_scaling at the top level), which transformers 5 reads too, with
    transformers 5's rope_parameters beside it (the same values)."""
    family = export_family(m, architecture)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rotary_base}
    scaling = None
    if m.use_rope_scaling:
        scaling = {
            "rope_type": "llama3",
            "factor": m.rope_scaling_factor,
            "low_freq_factor": m.rope_scaling_low_freq_factor,
            "high_freq_factor": m.rope_scaling_high_freq_factor,
            "original_max_position_embeddings": m.rope_scaling_original_max_position_embeddings,
        }
        rope = {**scaling, "rope_theta": m.rotary_base}
    config: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
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
        "rope_parameters": rope,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "vocab_size": m.vocab_size,
        "attention_dropout": m.attention_dropout,
        "initializer_range": m.init_method_std,
        # transformers' window counts the query itself: --window-size N-1,0 is sliding_window N (module docstring)
        "sliding_window": None if m.attention_window is None else m.attention_window + 1,
        "use_cache": True,
        # transformers >= 4.56 reads "dtype", older versions and other tools "torch_dtype".
        "dtype": _HF_DTYPE_NAMES[dtype],
        "torch_dtype": _HF_DTYPE_NAMES[dtype],
    }
    if family.model_type in ("llama", "qwen3", "qwen3_moe"):
        config.update(attention_bias=False)
    if family.model_type == "llama":
        config.update(mlp_bias=False, pretraining_tp=1)
    if family.model_type in ("qwen2", "qwen3", "qwen3_moe"):
        config.update(use_sliding_window=False, max_window_layers=m.num_layers)
    if family.model_type in ("qwen2", "qwen3"):
        config.update(layer_types=["full_attention"] * m.num_layers)
    if family.moe:
        config.update(num_experts_per_tok=m.moe_router_topk, router_aux_loss_coef=m.moe_aux_loss_coeff)
        config.update(output_router_logits=False)
    if family.moe == "mixtral":
        config.update(num_local_experts=m.num_experts, intermediate_size=m.moe_ffn_size, router_jitter_noise=0.0)
    if family.moe == "qwen3_moe":
        config.update(num_experts=m.num_experts, moe_intermediate_size=m.moe_ffn_size, norm_topk_prob=True)
        config.update(decoder_sparse_step=1, mlp_only_layers=[])
    return {**config, **(extra or {})}
