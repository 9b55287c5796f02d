"""`tricorn estimate`: per-rank memory of a config, by category, as a table, JSON or a bar chart.

    tricorn estimate --model-preset llama2-7b --bf16 --world-size 8 --use-distributed-optimizer --gpu-type h100-80gb
    tricorn estimate --model-preset tiny --vocab-size 256 --device cpu --json

Takes pretrain_gpt.py's flags (the same parser) plus --world-size (there is no launcher here), --gpu-type or
--gpu-memory-gb (to say whether it fits), --json and --plot FILE.png. ``format_report(cfg)`` is the text that
``pretrain_gpt.py --dry-run`` prints. Data flags are not needed: the estimate reads no data.
No collectives, no device work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from tricorn.config import Config, ConfigError
from tricorn.config_args import build_parser, config_from_args
from tricorn.parallel.te import ON_THIS_NODE
from tricorn.planning.flops import iteration_flops_for_config
from tricorn.planning.fp8_terms import fp8_terms
from tricorn.planning.hardware import GiB, get_gpu
from tricorn.planning.layout import Layout
from tricorn.planning.memory import MemoryEstimate, active_params, estimate_config, total_params
from tricorn.validation import validate

CATEGORIES = [
    ("params_bytes", "parameters"),
    ("grads_bytes", "gradients (main grads)"),
    ("master_params_bytes", "master parameters"),
    ("optimizer_state_bytes", "optimizer state"),
    ("activation_bytes", "activations"),
    ("embedding_logits_bytes", "embedding + logits"),
    ("buffer_bytes", "buffers"),
    ("fp8_bytes", "FP8 weights + scales"),
    ("overhead_bytes", "CUDA context/workspace"),
]


def _extra_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--world-size", type=int, help="Ranks of the job (default: TP x PP x CP, i.e. DP = 1).")
    p.add_argument("--gpu-type", help="a100-80gb | h100-80gb | h200-141gb: memory to compare with.")
    p.add_argument("--gpu-memory-gb", type=float, help="Device memory in GiB (overrides --gpu-type's).")
    p.add_argument("--json", action="store_true", help="Print the estimate as JSON.")
    p.add_argument("--plot", metavar="FILE.png", help="Draw the breakdown as a bar chart (needs matplotlib).")
    return p


def _usage() -> str:
    extra = _extra_parser().format_help().split("\n", 2)[-1]
    return build_parser("tricorn estimate").format_help() + "\nestimate:\n" + extra


def config_for_estimate(argv: list[str], world_size: Optional[int] = None) -> Config:
    """Parse pretrain_gpt.py flags for an estimate: GPU unless --device is given; data flags optional."""
    if world_size is None:  # no launcher: one model replica (DP = 1)
        p = config_from_args(argv, world_size=1).parallel
        world_size = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    cfg = config_from_args(argv, world_size=world_size)
    if "--device" not in argv:
        cfg.device = "cuda"
    if cfg.model.vocab_size is None and (cfg.data.tokenizer_model or cfg.data.vocab_file):
        cfg.model.vocab_size = _tokenizer_vocab(cfg)
    if cfg.model.vocab_size is None:
        raise ConfigError("the vocabulary size is unknown: pass --vocab-size N or the tokenizer's files (--tokenizer-model ...)")
    # An estimate needs no data, and plans on any node: what this node has installed does not matter.
    errors = [e for e in validate(cfg) if "training data" not in e and ON_THIS_NODE not in e]
    if errors:
        raise ConfigError("; ".join(errors))
    return cfg


def _tokenizer_vocab(cfg: Config) -> int:
    from tricorn.data.errors import DataError
    from tricorn.data.tokenizer import build_tokenizer

    try:
        return int(build_tokenizer(cfg).vocab_size)
    except DataError as e:
        raise ConfigError(str(e)) from None


def estimate_record(cfg: Config, gpu_memory_bytes: Optional[float] = None) -> dict:
    """The JSON record: per-rank bytes by category, the layout, FLOPs, and whether it fits."""
    est = estimate_config(cfg)
    p = cfg.parallel
    f = iteration_flops_for_config(cfg)
    rec = est.to_dict()
    rec.update(
        total_params=total_params(cfg.model),
        active_params=active_params(cfg.model),
        world_size=cfg.world_size,
        layout=dict(
            tp=p.tensor_model_parallel_size,
            pp=p.pipeline_model_parallel_size,
            vpp=cfg.virtual_stages,
            cp=p.context_parallel_size,
            dp=cfg.data_parallel_size,
            micro_batch=cfg.training.micro_batch_size,
            num_microbatches=cfg.num_microbatches,
            sequence_parallel=p.sequence_parallel,
            recompute=cfg.model.recompute_granularity,
            zero_stage=p.zero_stage_in_effect,
            precision=cfg.param_dtype_name,
            device=cfg.device,
            optimizer_cpu_offload=cfg.parallel.optimizer_cpu_offload,
            cpu_offloading_num_layers=cfg.model.cpu_offloading_num_layers,
        ),
        model_flops_per_iteration=f.model,
        hardware_flops_per_iteration=f.hardware,
    )
    if cfg.training.fp8_format and cfg.model.transformer_impl == "transformer_engine":  # native: _native_fp8_lines
        lay = Layout.from_config(cfg)
        terms = fp8_terms(cfg.model, lay, est.layers_on_stage, est.microbatches_in_flight)
        rec["fp8"] = dict(
            engine=lay.transformer_impl,
            recipe=lay.fp8_recipe,
            weight_cache_bytes=terms.weight_cache,
            saved_weights_bytes=terms.saved_weights,
            scales_bytes=terms.scales,
            activation_delta_bytes=terms.activation_delta * est.layers_on_stage * est.microbatches_in_flight,
        )
    if gpu_memory_bytes is not None:
        rec["gpu_memory_bytes"] = gpu_memory_bytes
        rec["fits"] = est.total_bytes <= gpu_memory_bytes
    return rec


def memory_errors(cfg: Config, gpu_memory_bytes: Optional[float]) -> list[str]:
    """The pre-launch check: a layout whose worst rank is estimated over the device's memory is refused."""
    if gpu_memory_bytes is None:
        return []
    rec = estimate_record(cfg, gpu_memory_bytes)
    if rec["fits"]:
        return []
    return [
        f"estimated {rec['total_bytes'] / GiB:.1f} GiB on the worst rank (pipeline stage {rec['stage']}) exceeds the "
        f"device's {gpu_memory_bytes / GiB:.1f} GiB; see `pretrain_gpt.py ... --dry-run` for the breakdown, then add "
        f"TP/PP, --use-distributed-optimizer/--zero-stage, --recompute-granularity or a smaller --micro-batch-size"
    ]


def _active(rec: dict) -> str:
    """ ", 0.012 B active per token" for a mixture of experts, else nothing."""
    return f" ({rec['active_params'] / 1e9:.3f} B active per token)" if rec["active_params"] != rec["total_params"] else ""


def _gib(x: float) -> str:
    return f"{x / GiB:9.2f} GiB"


def format_report(cfg: Config, gpu_memory_bytes: Optional[float] = None) -> str:
    """The human report: layout, parameter count, per-category bytes on the worst rank, fit.

    On a CUDA config without ``gpu_memory_bytes`` the visible device's memory is used when there is one.
    """
    if gpu_memory_bytes is None and cfg.device == "cuda":
        gpu_memory_bytes = visible_device_memory()
    rec = estimate_record(cfg, gpu_memory_bytes)
    lay = rec["layout"]
    name = cfg.model_preset or f"{cfg.model.num_layers}x{cfg.model.hidden_size}"
    zero = f"ZeRO-{lay['zero_stage']}" if lay["zero_stage"] else "no distributed optimizer"
    lines = [
        f"memory estimate for {name}: TP {lay['tp']} x PP {lay['pp']} (VPP {lay['vpp']}) x CP {lay['cp']} x DP {lay['dp']}"
        f" = {cfg.world_size} ranks on {lay['device']}",
        f"  micro batch {lay['micro_batch']} x {lay['num_microbatches']} microbatches, {lay['precision']}, {zero}, "
        f"recompute {lay['recompute'] or 'none'}, sequence parallel {'on' if lay['sequence_parallel'] else 'off'}"
        + (", optimizer in host memory" if lay["optimizer_cpu_offload"] else "")
        + (
            f", activations of {lay['cpu_offloading_num_layers']} layers per chunk to host"
            if lay["cpu_offloading_num_layers"]
            else ""
        ),
        f"  parameters: {rec['total_params'] / 1e9:.3f} B in the model{_active(rec)}, "
        f"{rec['params_on_rank'] / 1e9:.3f} B on the worst rank "
        f"(pipeline stage {rec['stage']}, {rec['layers_on_stage']} layers, {rec['microbatches_in_flight']:g} microbatches in flight)",
    ]
    for key, label in CATEGORIES:
        if key != "fp8_bytes" or "fp8" in rec:  # the FP8 row only for an FP8 run
            lines.append(f"  {label:<26}{_gib(rec[key])}")
    lines.append(f"  {'total':<26}{_gib(rec['total_bytes'])}")
    if rec["host_bytes"]:
        lines.append(f"  {'host memory (offloaded)':<26}{_gib(rec['host_bytes'])}  not in the total: {_offloaded(cfg)}")
    if "fp8" in rec:
        f = rec["fp8"]
        lines.append(
            f"  FP8 ({f['engine']}, {f['recipe']}): weight cache {f['weight_cache_bytes'] / GiB:.2f} GiB, saved FP8 "
            f"weights {f['saved_weights_bytes'] / GiB:.2f} GiB, scales {f['scales_bytes'] / 2**20:.2f} MiB; saved "
            f"activations {f['activation_delta_bytes'] / GiB:+.2f} GiB against bf16 (in activations)"
        )
    lines += _native_fp8_lines(cfg)
    if len(rec["per_stage_total_bytes"]) > 1:
        lines.append("  per pipeline stage: " + ", ".join(f"{x / GiB:.2f}" for x in rec["per_stage_total_bytes"]) + " GiB")
    if gpu_memory_bytes is not None:
        free = gpu_memory_bytes - rec["total_bytes"]
        verdict = f"fits, {free / GiB:.2f} GiB to spare" if free >= 0 else f"does NOT fit: short by {-free / GiB:.2f} GiB"
        lines.append(f"  device memory {gpu_memory_bytes / GiB:.2f} GiB: {verdict}")
    lines.append(
        f"  FLOPs per iteration: {rec['model_flops_per_iteration']:.3e} model, {rec['hardware_flops_per_iteration']:.3e} hardware"
    )
    return "\n".join(lines)


def _offloaded(cfg: Config) -> str:
    """What --optimizer-cpu-offload and --cpu-offloading-num-layers put in host memory (planning/memory.py)."""
    parts = []
    if cfg.parallel.optimizer_cpu_offload:
        parts.append("master weights, Adam moments and the step's staging copies")
    if cfg.model.cpu_offloading_num_layers:
        parts.append(f"the saved activations of {cfg.model.cpu_offloading_num_layers} layers per model chunk")
    return " and ".join(parts)


def _native_fp8_lines(cfg: Config) -> list[str]:
    """Native FP8 tensorwise: what its linears keep per layer against the same layout in bf16 (activations.py)."""
    from tricorn.planning.activations import layout_layer_bytes
    from tricorn.planning.layout import Layout

    layout = Layout.from_config(cfg)
    if not layout.fp8_inputs:
        return []
    fp8, bf16 = layout_layer_bytes(cfg.model, layout), layout_layer_bytes(cfg.model, layout, fp8_inputs=False)
    return [
        f"  FP8 (native, tensorwise): the linears keep FP8 copies of their inputs and fp32 scales: activations "
        f"{fp8 / GiB:.3f} GiB per layer and microbatch, against {bf16 / GiB:.3f} GiB in bf16"
    ]


def visible_device_memory() -> Optional[float]:
    try:
        import torch

        return float(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else None
    except Exception:
        return None


def plot(rec: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("tricorn estimate: error: --plot needs matplotlib; install it with `pip install tricorn[plot]`")
    labels = [label for _, label in CATEGORIES]
    values = [rec[key] / GiB for key, _ in CATEGORIES]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh(labels[::-1], values[::-1], color="#4c72b0")
    ax.set_xlabel("GiB per rank")
    ax.set_title(f"per-rank memory, pipeline stage {rec['stage']}: total {rec['total_bytes'] / GiB:.1f} GiB")
    if "gpu_memory_bytes" in rec:
        ax.axvline(rec["gpu_memory_bytes"] / GiB, color="#c44e52", linestyle="--", label="device memory")
        ax.legend(loc="lower right")
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def gpu_memory_from_args(gpu_type: Optional[str], gpu_memory_gb: Optional[float]) -> Optional[float]:
    if gpu_memory_gb is not None:
        return gpu_memory_gb * GiB
    if gpu_type is not None:
        return float(get_gpu(gpu_type).memory_bytes)
    return None


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(_usage())
        return 0
    extra, rest = _extra_parser().parse_known_args(argv)
    try:
        cfg = config_for_estimate(rest, extra.world_size)
        gpu_bytes = gpu_memory_from_args(extra.gpu_type, extra.gpu_memory_gb)
    except (ConfigError, ValueError) as e:
        print(f"tricorn estimate: error: {e}", file=sys.stderr)
        return 2
    if cfg.megatron_notice:  # a Megatron command line: its no-ops, in one line
        print(f"tricorn estimate: {cfg.megatron_notice}", file=sys.stderr)
    rec = estimate_record(cfg, gpu_bytes)
    if extra.plot:
        plot(rec, extra.plot)
    print(json.dumps(rec, indent=2) if extra.json else format_report(cfg, gpu_bytes))
    return 0


def estimate_for_dry_run(cfg: Config) -> MemoryEstimate:
    """What ``pretrain_gpt.py --dry-run`` checks against the device (kept here so the trainer imports one name)."""
    return estimate_config(cfg)
