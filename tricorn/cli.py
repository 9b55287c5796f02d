"""The `tricorn` command: one subcommand per tool, each a module with main(argv).

Subcommands are imported lazily so that `tricorn schedule` does not pay for
TensorBoard, and `tricorn plan` runs on a login node without a GPU.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional

# name -> ("module:function", one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("tricorn.training.main:main", "pretrain a GPT/Llama model (same flags as pretrain_gpt.py)"),
    "tokenizer": ("tricorn.data.tokenizer:cli_main", "train a sentencepiece tokenizer: tricorn tokenizer train ..."),
    "preprocess": ("tricorn.data.preprocess:main", "jsonl -> Megatron .bin/.idx"),
    "schedule": ("tricorn.parallel.pipeline.cli:main", "print a pipeline schedule grid with its bubble fraction"),
    "estimate": ("tricorn.planning.estimate:main", "per-rank memory estimate for a config"),
    "simulate": (
        "tricorn.simulate:main",
        "run the real build and training at real size on fake tensors; peak memory vs estimate",
    ),
    "plan": ("tricorn.plan_cli:main", "rank parallel layouts for a cluster, write sbatch scripts"),
    "import-hf": ("tricorn.checkpoint.interop.hf:import_main", "Hugging Face Llama (safetensors) -> tricorn checkpoint"),
    "export-hf": ("tricorn.checkpoint.interop.hf:export_main", "tricorn checkpoint (any layout) -> Hugging Face Llama"),
    "import-megatron": (
        "tricorn.checkpoint.interop.megatron:import_main",
        "Megatron-LM checkpoint (torch_dist or legacy torch) -> tricorn checkpoint",
    ),
    "export-megatron": (
        "tricorn.checkpoint.interop.megatron_export:export_main",
        "tricorn checkpoint (any layout) -> Megatron-LM checkpoint",
    ),
    "tb": ("tricorn.training.tb:main", "start TensorBoard on 127.0.0.1 and print the URL"),
    "fr-trace": ("tricorn.fr_trace:main", "where each rank stopped in its collectives, from flight-recorder dumps of a hang"),
}


def _usage() -> str:
    lines = ["usage: tricorn SUBCOMMAND [args]", "", "subcommands:"]
    lines += [f"  {name:<15} {helptext}" for name, (_, helptext) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name = argv.pop(0)
    if name not in SUBCOMMANDS:
        print(f"tricorn: unknown subcommand '{name}'\n\n{_usage()}", file=sys.stderr)
        return 2
    target, _ = SUBCOMMANDS[name]
    module_name, func = target.split(":")
    result = getattr(importlib.import_module(module_name), func)(argv)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
