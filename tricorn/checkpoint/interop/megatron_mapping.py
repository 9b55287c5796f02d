"""What corresponds to what between a Megatron-LM GPTModel checkpoint and tricorn: configs and tensors.

Pure functions, no files and no collectives (megatron.py reads and writes).
Megatron's saved args -> tricorn's ModelConfig and TrainingConfig; the args tricorn would run
differently are listed, and architectures tricorn cannot represent (MoE, MLA, Mamba, ...) refused.
Tensors (global shapes, exact, so a round trip is bit-exact):
    linear_qkv        -> attention.wqkv: the same rows, per query group [q heads of the group, k, v]
    linear_fc1 SwiGLU -> mlp.w1: Megatron's [gate; up] becomes tricorn's interleaved rows (w1[0::2] gate)
    linear_proj/fc2   -> attention.wo / mlp.w2; norms, embeddings, output layer by name
The vocabulary is Megatron's padded one (its padding rows are real, trained rows of the checkpoint).
torch_dist stacks the layers on a leading dimension and names the pre-attention/pre-MLP norms
`linear_qkv.layer_norm_*` / `linear_fc1.layer_norm_*` (Transformer Engine names); the legacy format
has per-layer names `decoder.layers.<i>.input_layernorm.*` and one file per TP rank.
Memory: each conversion makes one new tensor the size of its input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from tricorn.checkpoint.interop.hf_mapping import ConvertError
from tricorn.config import ModelConfig

# Megatron args that name an architecture tricorn's importer cannot represent: arg -> (value that is fine, what).
REFUSED_ARCH: dict[str, tuple[Any, str]] = {
    "num_experts": (None, "mixture of experts (--num-experts)"),
    "multi_latent_attention": (False, "multi-latent attention (--multi-latent-attention)"),
    "is_hybrid_model": (False, "a hybrid Mamba model"),
    "hybrid_override_pattern": (None, "a hybrid Mamba model (--hybrid-override-pattern)"),
    "qk_layernorm": (False, "QK layernorm (--qk-layernorm)"),
    "apply_layernorm_1p": (False, "zero-centred norms (--apply-layernorm-1p)"),
    "rotary_interleaved": (False, "interleaved RoPE (--rotary-interleaved)"),
    "squared_relu": (False, "squared ReLU (--squared-relu)"),
    "openai_gelu": (False, "OpenAI's GeLU (--openai-gelu)"),
    "mtp_num_layers": (None, "multi-token prediction (--mtp-num-layers)"),
    "heterogeneous_layers_config_path": (None, "heterogeneous layers"),
    "window_size": (None, "sliding-window attention (--window-size)"),
    "rotary_percent": (1.0, "partial RoPE (--rotary-percent)"),
    "rotary_seq_len_interpolation_factor": (None, "RoPE position interpolation (--rotary-seq-len-interpolation-factor)"),
    "apply_residual_connection_post_layernorm": (False, "post-norm residuals (--apply-residual-connection-post-layernorm)"),
    "qk_l2_norm": (False, "QK L2 norm (--qk-l2-norm)"),
    "no_rope_freq": (None, "layers without RoPE (--no-rope-freq)"),
    "use_mup": (False, "muP scaling (--use-mup)"),
}


def _arg(args: dict, name: str, default: Any = None) -> Any:
    return args.get(name, default)


def model_config_from_args(args: dict, where: str) -> ModelConfig:
    """tricorn's model for Megatron's saved args; ConvertError naming what tricorn cannot represent."""
    refused = [what for name, (ok, what) in REFUSED_ARCH.items() if _arg(args, name, ok) not in (ok, None, False)]
    if _arg(args, "position_embedding_type", "learned_absolute") not in ("rope", "learned_absolute"):
        refused.append(f"--position-embedding-type {args['position_embedding_type']}")
    if _arg(args, "normalization", "LayerNorm") not in ("RMSNorm", "LayerNorm"):
        refused.append(f"--normalization {args['normalization']}")
    h, heads = args["hidden_size"], args["num_attention_heads"]
    if _arg(args, "kv_channels") not in (None, h // heads):
        refused.append(f"--kv-channels {args['kv_channels']} != hidden / heads = {h // heads}")
    if _arg(args, "add_qkv_bias") and not _arg(args, "add_bias_linear", True):
        refused.append("a QKV bias without the other biases (--add-qkv-bias)")
    if refused:
        raise ConvertError(f"{where}: unsupported Megatron architecture: {'; '.join(refused)}")
    gqa = bool(_arg(args, "group_query_attention")) and _arg(args, "num_query_groups") not in (None, heads)
    rope = args.get("position_embedding_type") == "rope"
    return ModelConfig(
        num_layers=args["num_layers"],
        hidden_size=h,
        ffn_hidden_size=args.get("ffn_hidden_size") or 4 * h,
        num_attention_heads=heads,
        num_query_groups=args["num_query_groups"] if gqa else None,
        group_query_attention=gqa,
        seq_length=args["seq_length"],
        max_position_embeddings=args.get("max_position_embeddings") or args["seq_length"],
        position_embedding_type="rope" if rope else "learned_absolute",
        rotary_base=float(args.get("rotary_base") or 10000),
        # Megatron computes its RoPE tables in float32.
        rotary_angles_dtype="float32",
        use_rope_scaling=bool(args.get("use_rope_scaling")),
        rope_scaling_factor=float(args.get("rope_scaling_factor") or 8.0),
        normalization=args.get("normalization") or "LayerNorm",
        norm_epsilon=float(args.get("norm_epsilon") or 1e-5),
        swiglu=bool(args.get("swiglu")),
        disable_bias_linear=not args.get("add_bias_linear", True),
        untie_embeddings_and_output_weights=bool(args.get("untie_embeddings_and_output_weights")),
        hidden_dropout=float(args.get("hidden_dropout", 0.1)),
        attention_dropout=float(args.get("attention_dropout", 0.1)),
        init_method_std=float(args.get("init_method_std") or 0.02),
        vocab_size=int(args["padded_vocab_size"]),
    )


def unsupported_args(args: dict) -> list[str]:
    """Megatron args whose values tricorn would not reproduce (the import goes on; the config lists them): the
    classification of every Megatron flag that pretrain_gpt.py also applies (tricorn/megatron_flags.py)."""
    from tricorn.megatron_flags import not_reproduced

    return not_reproduced(args)


# What the run trains on (Megatron's data and evaluation args), carried into megatron.yaml in the section of
# tricorn's field of the same name. Those tricorn lacks are listed as not reproduced by unsupported_args when their
# value changes the math (tricorn/megatron_flags.py: --eod-mask-loss, the reset flags, ...).
RUN_ARGS = (
    "mock_data", "data_path", "train_data_path", "valid_data_path", "test_data_path", "split", "tokenizer_type",
    "tokenizer_model", "legacy_tokenizer", "vocab_file", "merge_file", "null_tokenizer_eod_id", "null_tokenizer_pad_id",
    "eod_mask_loss", "reset_position_ids", "reset_attention_mask", "eval_iters", "eval_interval",
)  # fmt: skip


def run_fields(args: dict) -> dict[str, dict[str, Any]]:
    """{section: {field: value}} of the run's data and evaluation args that tricorn has fields for (those set, and
    not to tricorn's default)."""
    import dataclasses

    from tricorn.config import Config

    cfg = Config()
    sections = {name: {f.name for f in dataclasses.fields(getattr(cfg, name))} for name in ("data", "model", "training")}
    carried: dict[str, dict[str, Any]] = {}
    for name in RUN_ARGS:
        value = args.get(name)
        section = next((s for s, names in sections.items() if name in names), None)
        if value is None or value is False or section is None or value == getattr(getattr(cfg, section), name):
            continue
        carried.setdefault(section, {})[name] = list(value) if isinstance(value, tuple) else value
    return carried


def training_fields(args: dict, scheduler: dict) -> dict[str, Any]:
    """TrainingConfig fields of the run: its batch, optimizer and precision args, and its lr schedule's args as
    Megatron had them (the same names), so that the flags rebuild the schedule of the saved scheduler state
    (lr_schedule.py; a resume checks that they agree). The peak and floor come from that state."""
    from tricorn.lr_schedule import SCHEDULE_ARGS

    out: dict[str, Any] = {
        "micro_batch_size": int(args.get("micro_batch_size") or 1),
        "global_batch_size": int(args.get("global_batch_size") or 1),
        "weight_decay": float(args.get("weight_decay", 0.01)),
        "adam_beta1": float(args.get("adam_beta1", 0.9)),
        "adam_beta2": float(args.get("adam_beta2", 0.999)),
        "adam_eps": float(args.get("adam_eps", 1e-8)),
        "clip_grad": float(args.get("clip_grad", 1.0)),
        "calculate_per_token_loss": bool(args.get("calculate_per_token_loss")),
        "seed": int(args.get("seed", 1234)),
        "bf16": bool(args.get("bf16")),
        "fp16": bool(args.get("fp16")),
    }
    out.update({k: args[k] for k in SCHEDULE_ARGS if args.get(k) is not None and k not in out})
    if args.get("train_samples"):  # sample-based: Megatron derived train_iters from it (tricorn does too)
        out.pop("train_iters", None)
        out.pop("lr_decay_iters", None)  # Megatron's scheduler does not read it then
    if out.get("weight_decay_incr_style", "constant") == "constant":  # Megatron filled both from --weight-decay
        out.pop("start_weight_decay", None)
        out.pop("end_weight_decay", None)
    if out.get("lr_warmup_fraction") is not None:  # Megatron's scheduler ignores the others then
        out.pop("lr_warmup_iters", None)
        out.pop("lr_warmup_samples", None)
    for ours, theirs in (("lr", "max_lr"), ("min_lr", "min_lr")):
        if scheduler.get(theirs) is not None:
            out[ours] = float(scheduler[theirs])
    return out


# ---------------------------------------------------------------- the tensor mapping


@dataclass(frozen=True)
class Entry:
    """One tricorn tensor and where it is in a Megatron checkpoint."""

    name: str  # tricorn parameter name (its checkpoint key without "model.")
    dist: str  # torch_dist key (layer tensors: the stacked key, indexed by `layer`)
    legacy: str  # legacy state-dict key (per layer)
    layer: Optional[int]  # layer index in the stacked torch_dist tensor, None for the others
    tp_dim: Optional[int]  # dimension split over TP ranks in the legacy per-rank files (None: replicated)
    kind: str = "copy"  # "copy" | "gate_up" (SwiGLU fc1: [gate; up] <-> interleaved)


_LAYER = (
    # tricorn suffix, torch_dist suffix, legacy suffix, TP dim, needs bias, is fc1
    ("attention_norm.weight", "self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight", None, False, False),
    ("attention_norm.bias", "self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias", None, "norm", False),
    ("attention.wqkv.weight", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.weight", 0, False, False),
    ("attention.wqkv.bias", "self_attention.linear_qkv.bias", "self_attention.linear_qkv.bias", 0, True, False),
    ("attention.wo.weight", "self_attention.linear_proj.weight", "self_attention.linear_proj.weight", 1, False, False),
    ("attention.wo.bias", "self_attention.linear_proj.bias", "self_attention.linear_proj.bias", None, True, False),
    ("mlp_norm.weight", "mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight", None, False, False),
    ("mlp_norm.bias", "mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias", None, "norm", False),
    ("mlp.w1.weight", "mlp.linear_fc1.weight", "mlp.linear_fc1.weight", 0, False, True),
    ("mlp.w1.bias", "mlp.linear_fc1.bias", "mlp.linear_fc1.bias", 0, True, True),
    ("mlp.w2.weight", "mlp.linear_fc2.weight", "mlp.linear_fc2.weight", 1, False, False),
    ("mlp.w2.bias", "mlp.linear_fc2.bias", "mlp.linear_fc2.bias", None, True, False),
)


def tensor_map(m: ModelConfig) -> list[Entry]:
    layer_norm = m.normalization == "LayerNorm"
    out = [Entry("tok_embeddings.weight", "embedding.word_embeddings.weight", "embedding.word_embeddings.weight", None, 0)]
    if m.position_embedding_type == "learned_absolute":
        key = "embedding.position_embeddings.weight"
        out.append(Entry("pos_embeddings.weight", key, key, None, None))
    for i in range(m.num_layers):
        for ours, dist, legacy, tp_dim, bias, fc1 in _LAYER:
            if (bias == "norm" and not layer_norm) or (bias is True and m.disable_bias_linear):
                continue
            kind = "gate_up" if fc1 and m.swiglu else "copy"
            out.append(Entry(f"layers.{i}.{ours}", f"decoder.layers.{dist}", f"decoder.layers.{i}.{legacy}", i, tp_dim, kind))
    out.append(Entry("norm.weight", "decoder.final_layernorm.weight", "decoder.final_layernorm.weight", None, None))
    if layer_norm:
        out.append(Entry("norm.bias", "decoder.final_layernorm.bias", "decoder.final_layernorm.bias", None, None))
    if m.untie_embeddings_and_output_weights:
        out.append(Entry("output.weight", "output_layer.weight", "output_layer.weight", None, 0))
    return out


def tricorn_shape(e: Entry, m: ModelConfig) -> tuple[int, ...]:
    """The global shape of tricorn tensor `e` (Megatron's global shape is the same, layers unstacked)."""
    h, ffn = m.hidden_size, m.ffn_size
    qkv = (m.num_attention_heads + 2 * m.kv_heads) * m.head_dim
    fc1 = 2 * ffn if m.swiglu else ffn
    suffix = e.name.split(".", 2)[-1] if e.layer is not None else e.name
    shapes = {
        "tok_embeddings.weight": (m.vocab_size, h),
        "output.weight": (m.vocab_size, h),
        "pos_embeddings.weight": (m.max_positions, h),
        "attention.wqkv.weight": (qkv, h),
        "attention.wqkv.bias": (qkv,),
        "attention.wo.weight": (h, m.num_attention_heads * m.head_dim),
        "mlp.w1.weight": (fc1, h),
        "mlp.w1.bias": (fc1,),
        "mlp.w2.weight": (h, ffn),
    }
    return shapes.get(suffix, (h,))


def to_tricorn(kind: str, t: torch.Tensor) -> torch.Tensor:
    """Megatron's global tensor -> tricorn's (exact)."""
    if kind == "copy":
        return t
    gate, up = t.chunk(2, dim=0)
    return torch.stack([gate, up], dim=1).reshape(t.shape)


def to_megatron(kind: str, t: torch.Tensor) -> torch.Tensor:
    """tricorn's global tensor -> Megatron's (exact)."""
    if kind == "copy":
        return t
    return torch.cat([t[0::2], t[1::2]], dim=0)


def merge_tp(e: Entry, parts: list[torch.Tensor]) -> torch.Tensor:
    """Megatron's global tensor from its legacy per-TP-rank pieces (SwiGLU fc1 ranks hold [gate_r; up_r])."""
    if e.tp_dim is None or len(parts) == 1:
        return parts[0]
    if e.kind == "gate_up":
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=e.tp_dim)


def split_tp(e: Entry, t: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """The inverse of merge_tp: Megatron's global tensor -> its legacy per-rank pieces."""
    if e.tp_dim is None or tp == 1:
        return [t] * tp
    if e.kind == "gate_up":
        gates, ups = (half.chunk(tp, dim=0) for half in t.chunk(2, dim=0))
        return [torch.cat([g, u], dim=0).contiguous() for g, u in zip(gates, ups)]
    return [p.contiguous() for p in t.chunk(tp, dim=e.tp_dim)]


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)


def legacy_optimizer_order(rank_state: dict) -> dict[str, int]:
    """Model key -> index into the legacy FP32 optimizer's state, for one rank's model_optim_rng.pt.

    Megatron builds its param groups from the model's parameters in registration order (the order of the
    saved model state dict) and puts biases and 1-D parameters in the group without weight decay; torch
    numbers the state by group, then by position. The derived order is checked against every group's size
    and every moment's shape; ValueError when it does not fit (other grouping rules, the distributed optimizer)."""
    opt = rank_state.get("optimizer") or {}
    if "param_groups" not in opt or "state" not in opt:
        raise ValueError("not torch's optimizer state dict (the distributed optimizer)")
    params = {k: v for k, v in rank_state["model"].items() if isinstance(v, torch.Tensor)}
    order: dict[str, int] = {}
    for group in opt["param_groups"]:
        no_wd = float(group.get("wd_mult", 1.0)) == 0.0
        members = [k for k, v in params.items() if (k.endswith(".bias") or v.dim() == 1) == no_wd and k not in order]
        if len(members) != len(group["params"]) or float(group.get("lr_mult", 1.0)) != 1.0:
            raise ValueError("param groups do not follow Megatron's default weight-decay grouping")
        order.update(zip(members, group["params"]))
    if sorted(order.values()) != sorted(opt["state"]) or len(order) != len(params):
        raise ValueError("optimizer state indices do not match the parameters")
    for key, index in order.items():
        for field in ("exp_avg", "exp_avg_sq"):
            moment = opt["state"][index].get(field)
            if not isinstance(moment, torch.Tensor) or moment.shape != params[key].shape:
                raise ValueError(f"{key}: the {field} at index {index} has another shape")
    return order
