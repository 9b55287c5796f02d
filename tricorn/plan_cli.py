"""`tricorn plan`: rank parallel layouts for a cluster, write sbatch scripts, and verify the top one by simulation.

    tricorn plan --model-preset llama2-70b --gpus 64 --gpu-type h100-80gb --seq-length 4096 --global-batch-size 1024
    tricorn plan ... --json | --max-model | --emit-sbatch scripts/slurm/llama2-70b.sbatch | --verify
    python -m tricorn.plan_cli --regenerate      # rewrite the checked-in scripts/slurm/*.sbatch

Orchestration, one level above planning/: the search and the arithmetic are planning/planner.py's, the script
text planning/sbatch.py's; --verify runs the real trainer on fake tensors through tricorn/simulate.py, which is
why this command lives here and not in planning/ (planning never imports the trainer).
No collectives, no device work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from tricorn.config import ConfigError, ModelConfig
from tricorn.config_args import config_from_args
from tricorn.planning import sbatch
from tricorn.planning.flops import attention_work
from tricorn.planning.hardware import GiB, get_gpu
from tricorn.planning.layout import Layout
from tricorn.planning.memory import active_params, total_params
from tricorn.planning.plan_checks import explain_impossible
from tricorn.planning.planner import FEATURE_MODES, Plan, features_text, layout_text, max_model, plan, recompute_text
from tricorn.planning.step_time import Cluster


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tricorn plan", add_help=False)
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job.")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (TP stays within a node).")
    p.add_argument("--gpu-type", default="h100-80gb", help="a100-80gb | h100-80gb | h200-141gb.")
    p.add_argument("--memory-margin", type=float, default=0.10, help="Fraction of device memory kept free (default 0.10).")
    p.add_argument("--top-k", type=int, default=5, help="Layouts to print.")
    p.add_argument("--json", action="store_true", help="Print a JSON list of records.")
    p.add_argument("--max-model", action="store_true", help="Largest model of the preset's family that fits.")
    p.add_argument("--emit-sbatch", metavar="FILE", help="Write an sbatch script for the top layout.")
    p.add_argument("--time", default="24:00:00", help="Time limit of each job in the sbatch script.")
    p.add_argument("--train-tokens", type=float, default=1e12, help="Tokens to train on (sets --train-iters).")
    p.add_argument(
        "--document-length",
        type=int,
        default=None,
        help="Mean tokens per document with --reset-attention-mask: attention then computes only within documents "
        "(default: documents as long as the sequence, no saving assumed).",
    )
    p.add_argument(
        "--verify", action="store_true", help="Simulate the top layout (tricorn simulate) and print measured beside estimated."
    )
    p.add_argument(
        "--memory-features",
        choices=FEATURE_MODES,
        default="auto",
        help="Try bf16 moments, FP8 primary weights (with tensorwise FP8), activation offload and optimizer offload on layouts that do not fit: auto (when fewer "
        "than --top-k fit without them), all, off (docs/memory.md).",
    )
    p.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    return p


def _iv(p: Plan, name: str, fmt: str) -> str:
    lo, hi = p.bounds(name)
    return f"{format(getattr(p, name), fmt)} [{format(lo, fmt)}-{format(hi, fmt)}]"


def _schedule(lay) -> str:
    """The pipeline schedule the layout runs (--pipeline-schedule; 1f1b with virtual stages is interleaved)."""
    if lay.pp == 1:
        return "-"
    return "interleaved" if lay.schedule == "1f1b" and lay.vpp > 1 else lay.schedule


def _table(plans: list[Plan]) -> str:
    head = (
        " #  TP PP VPP schedule    CP  DP  EP  mb  recompute       ZeRO  memory features          mem/GPU  step s [p10-p90]      "
        "tokens/s [p10-p90]      TFLOP/s/GPU      MFU [p10-p90]        HFU [p10-p90]        why"
    )
    rows = [head]
    for i, p in enumerate(plans, 1):
        lay = p.layout
        pp = f"{lay.pp}" if lay.first_stage_layers is None else f"{lay.pp}*"
        rows.append(
            f"{i:2d}{'=' if p.tie else ' '}{lay.tp:3d} {pp:>2} {lay.vpp:3d} {_schedule(lay):<11} {lay.cp:2d} {lay.dp:3d} {lay.ep:3d} {lay.micro_batch:3d}  "
            f"{recompute_text(lay):<15} {lay.zero_stage:4d}  {features_text(lay):<23} {p.memory_bytes / GiB:5.1f} GiB  "
            f"{_iv(p, 'step_time_s', '.2f'):<21}"
            f"{_iv(p, 'tokens_per_s', '.0f'):<24}{_iv(p, 'tflops_per_gpu', '.0f'):<17}"
            f"{_iv(p, 'mfu', '.1%'):<21}{_iv(p, 'hfu', '.1%'):<21}{p.why}"
        )
    if any(p.layout.first_stage_layers is not None for p in plans):
        rows.append("PP*: uneven split, the first and last stages hold the remainder (--decoder-first/last-pipeline-num-layers)")
    lo, hi = plans[0].interval if plans else (1.0, 1.0)
    rows.append(
        f"= : tie, its p10-p90 interval overlaps the fastest layout's. Intervals: x{lo:.2f}-x{hi:.2f} of the predicted "
        "time, the leave-one-out error on published Megatron-LM runs (bench/plan_calibration.py)."
    )
    return "\n".join(rows)


def _emit(
    path: str, name: str, model: ModelConfig, top: Plan, cluster: Cluster, argv: list[str], args, gbs: int, extra: list[str]
) -> None:
    n = total_params(model)
    train = sbatch.model_args(name, model) + ["--seq-length", str(model.seq_length)] + sbatch.layout_args(top.layout, gbs)
    train += extra
    train += sbatch.llama_hyperparameters(n, gbs * model.seq_length, args.train_tokens)
    save_every = max(10, int(1800 / top.step_time_s) // 10 * 10)  # about every 30 minutes
    train += ["--save-interval", str(save_every), "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "10"]
    job = sbatch.SbatchJob(
        job_name=f"tricorn-{name}",
        nodes=max(1, cluster.gpus // cluster.gpus_per_node),
        tasks_per_node=min(cluster.gpus, cluster.gpus_per_node),
        gpus_per_node=min(cluster.gpus, cluster.gpus_per_node),
        time=args.time,
        train_args=train,
        comments=[
            "Generated by: tricorn plan " + " ".join(_canonical(argv)),
            f"Layout: {layout_text(top.layout)}",
            f"Predicted by tricorn's step-time model: {top.memory_bytes / GiB:.1f} GiB per GPU, "
            f"{_iv(top, 'step_time_s', '.1f')} s per iteration,",
            f"  {_iv(top, 'tokens_per_s', ',.0f')} tokens/s, {_iv(top, 'tflops_per_gpu', '.0f')} TFLOP/s per GPU, "
            f"MFU {_iv(top, 'mfu', '.1%')} (p10-p90 intervals); {top.why}",
        ],
    )
    sbatch.write_script(path, sbatch.render(job))


def _canonical(argv: list[str]) -> list[str]:
    """The command line without where the script went, so regenerating it anywhere gives the same text."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--emit-sbatch":
            skip = True
        elif a != "--quiet" and not a.startswith("--emit-sbatch="):
            out.append(a)
    return out + ["--emit-sbatch", "FILE"]


def _features_note(result) -> str:
    """How many fit only with memory features (planning/memory_features.py), or why none were tried."""
    if not result.features_searched:
        return " (memory features not tried: enough fit without them; --memory-features all tries them too)"
    skipped = f"; {result.skipped} slower than the top {len(result.plans)} not tried with them" if result.skipped else ""
    return f" ({result.plain} as they are, {result.fitting - result.plain} with memory features{skipped})"


def _active_note(model: ModelConfig) -> str:
    """ " (12.88 B active per token)" for a mixture of experts, else nothing."""
    return f" ({active_params(model) / 1e9:.2f} B active per token)" if model.num_experts else ""


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(
            _parser().format_help() + "\nModel flags: --model-preset NAME or pretrain_gpt.py's model flags; "
            "--seq-length, --global-batch-size; --fp16 or --fp8-format (default bf16); --peak-tflops."
        )
        return 0
    try:
        args, rest = _parser().parse_known_args(argv)
        cfg = config_from_args(rest, world_size=args.gpus)
        gpu = get_gpu(args.gpu_type)
        model = cfg.model
        if model.vocab_size is None:
            raise ConfigError("the vocabulary size is unknown: pass --vocab-size N")
        if args.gpus < 1 or args.gpus_per_node < 1:
            raise ConfigError("--gpus and --gpus-per-node must be at least 1")
        gbs = cfg.training.global_batch_size if "--global-batch-size" in rest else None
        if gbs is None:
            raise ConfigError("pass --global-batch-size (samples per iteration)")
        precision = "fp16" if cfg.training.fp16 else "bf16"
        peak = cfg.logging.peak_tflops or gpu.peak_tflops("fp8" if cfg.training.fp8_format else precision)
        cluster = Cluster(args.gpus, args.gpus_per_node, gpu, peak, args.memory_margin)
    except (ConfigError, ValueError) as e:
        print(f"tricorn plan: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse already printed the problem
        return int(e.code or 2)
    if cfg.megatron_notice:  # a Megatron command line: its no-ops, in one line
        print(f"tricorn plan: {cfg.megatron_notice}", file=sys.stderr)
    name = cfg.model_preset or f"{model.num_layers}x{model.hidden_size}"
    if args.max_model:
        best = max_model(model, cluster, gbs, precision)
        if args.json:
            print(json.dumps(best, indent=2))
        elif best is None:
            print(f"tricorn plan: no model of the {name} family fits {args.gpus} x {gpu.name} at global batch {gbs}")
        else:
            lay = best["layout"]
            print(
                f"largest {name}-family model on {args.gpus} x {gpu.name} at seq {model.seq_length}, global batch {gbs}: "
                f"{best['num_layers']} layers x hidden {best['hidden_size']} ({best['num_attention_heads']} heads, "
                f"{best['num_query_groups']} kv groups, ffn {best['ffn_hidden_size']}) = {best['params'] / 1e9:.1f} B parameters\n"
                f"  fits with TP {lay['tp']}, PP {lay['pp']}, DP {lay['dp']}, "
                f"{'ZeRO-' + str(lay['zero_stage']) if lay['zero_stage'] else 'no distributed optimizer'}, full recompute, "
                f"micro batch 1: {best['memory_gb']} GiB per GPU on {best['gpus_used']} GPUs"
            )
        return 0 if best is not None else 1
    fp8 = Layout.from_config(cfg)  # the FP8 recipe in effect of --transformer-impl / --fp8-format / --fp8-recipe
    attention = _attention(cfg, args.document_length)
    result = plan(
        model, cluster, gbs, precision, args.top_k, (fp8.transformer_impl, fp8.fp8_recipe), attention, args.memory_features
    )
    if not result.plans:
        print(f"tricorn plan: {explain_impossible(model, name, cluster, gbs, result, precision)}", file=sys.stderr)
        if args.json:
            print("[]")
        return 1
    if args.emit_sbatch:
        _emit(args.emit_sbatch, name, model, result.plans[0], cluster, argv, args, gbs, document_args(cfg))
    if args.quiet:
        return 0
    if args.json:
        plans = [p.to_dict() for p in result.plans]
        if args.verify:  # the top plan's record gains the simulation's records
            plans[0]["verify"] = verify(name, model, result.plans[0], args.gpus, gbs, precision)[1]
        print(json.dumps(plans, indent=2))
        return 0
    fp8_text = f" + FP8 ({fp8.fp8_recipe}, {fp8.transformer_impl})" if fp8.fp8_recipe else ""
    print(
        f"{name}: {total_params(model) / 1e9:.2f} B parameters{_active_note(model)}, seq {model.seq_length}, global batch {gbs}, {precision}{fp8_text} on "
        f"{args.gpus} x {gpu.name} ({args.gpus_per_node} per node), {cluster.usable_bytes / GiB:.1f} GiB usable per GPU\n"
        f"{_attention_text(model, attention, args.document_length)}"
        f"{result.considered} layouts considered, {result.fitting} fit{_features_note(result)}, {result.ties} tie with the "
        f"fastest; top {len(result.plans)}, ties first (simplest first), then by predicted tokens/s:\n" + _table(result.plans)
    )
    fast = result.fastest
    if fast is not None and fast not in result.plans:
        print(
            f"fastest predicted (not preferred, see 'why'): {layout_text(fast.layout)}: {_iv(fast, 'step_time_s', '.2f')} s, "
            f"{_iv(fast, 'tokens_per_s', '.0f')} tokens/s, MFU {_iv(fast, 'mfu', '.1%')}, {fast.memory_bytes / GiB:.1f} GiB"
        )
    if args.emit_sbatch:
        print(f"wrote {args.emit_sbatch} for layout 1")
    if args.verify:
        from tricorn.simulate import format_table

        flags, records = verify(name, model, result.plans[0], args.gpus, gbs, precision)
        print(
            f"\nverify layout 1: tricorn simulate {' '.join(flags)} --world-size {args.gpus} (one iteration; estimated "
            "here for the CPU the simulation runs on - the table above adds the GPU's CUDA context and kernels):\n"
            + format_table(records)
        )
    return 0


def _attention(cfg, document_length: Optional[int]) -> Layout:
    """What documents and a window change in every layout: the attention's work and per-sample RoPE rows."""
    if document_length is not None and document_length < 1:
        raise ConfigError(f"--document-length must be at least 1 token, got {document_length}")
    docs = document_length if cfg.data.reset_attention_mask else None
    return Layout(
        attention_work=attention_work(cfg.model.seq_length, cfg.model.attention_window, docs),
        per_sample_positions=cfg.data.reset_position_ids,
    )


def _attention_text(model: ModelConfig, attention: Layout, document_length: Optional[int]) -> str:
    if attention.attention_work == 1.0:
        return ""
    parts = [f"window {model.attention_window}"] if model.attention_window is not None else []
    parts += [f"documents of {document_length} tokens"] if document_length else []
    return (
        f"attention computes {attention.attention_work:.1%} of causal attention's (query, key) pairs ({', '.join(parts)}): "
        "the step time counts that, MFU keeps Megatron's count\n"
    )


def document_args(cfg) -> list[str]:
    """--reset-position-ids / --reset-attention-mask / --eod-mask-loss as given (they go into the sbatch script)."""
    d = cfg.data
    flags = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
    return ["--" + f.replace("_", "-") for f in flags if getattr(d, f)]


def verify(name: str, model: ModelConfig, top: Plan, gpus: int, gbs: int, precision: str) -> tuple[list[str], list[dict]]:
    """(flags, records): the top layout's real build and one training iteration on fake tensors (tricorn/simulate.py)."""
    from tricorn.simulate import config_for_simulation, default_ranks, simulate  # torch: only when verifying

    flags = [*sbatch.model_args(name, model), "--seq-length", str(model.seq_length), f"--{precision}"]
    flags += sbatch.layout_args(top.layout, gbs)
    cfg = config_for_simulation(flags, gpus)
    return flags, simulate(cfg, default_ranks(cfg), iters=1)


def regenerate(names: Optional[list[str]] = None) -> list[str]:
    """Rewrite scripts/slurm/NAME.sbatch for each checked-in name; returns the paths."""
    paths = []
    for name in names or list(sbatch.CHECKED_IN):
        path = os.path.normpath(os.path.join(sbatch.SLURM_DIR, f"{name}.sbatch"))
        if main([*sbatch.checked_in_argv(name), "--emit-sbatch", path, "--quiet"]) != 0:
            raise SystemExit(f"tricorn plan failed for {name}")
        paths.append(path)
    return paths


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        print("usage: python -m tricorn.plan_cli --regenerate", file=sys.stderr)
        sys.exit(2)
    for p in regenerate():
        print(p)
