"""tricorn's own flags as an argparse parser, generated from the dataclass fields of tricorn/config.py.

A leaf: both the full command line (tricorn/config_args.py, which adds Megatron's other flags) and the Megatron
flag classification (tricorn/megatron_flags.py, which asks which flags tricorn defines) build on it.
"""

from __future__ import annotations

import argparse
import dataclasses

from tricorn.config import SECTIONS, ConfigError
from tricorn.fields import field_kind, flag_of
from tricorn.presets import PRESETS


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are a ConfigError (one `tricorn: error:` line from the entry point, not usage + exit)."""

    def error(self, message: str):  # type: ignore[override]
        raise ConfigError(f"{message}; see --help")


def tricorn_parser(prog: str = "pretrain_gpt.py") -> argparse.ArgumentParser:
    """tricorn's own command line, generated from the dataclasses (defaults are None so we can tell what was
    given). tricorn/config_args.py adds Megatron's other flags to it."""
    parser = _Parser(
        prog=prog, description="tricorn: Megatron-style 3D-parallel GPT pretraining.", argument_default=argparse.SUPPRESS
    )
    parser.add_argument(
        "--config", help="YAML file with sections model/parallel/training/data/checkpoint/logging; flags override it."
    )
    parser.add_argument("--model-preset", help=f"Published model shape: {', '.join(PRESETS)}.")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="Device (default: cuda when available).")
    parser.add_argument("--dry-run", action="store_true", help="Print the memory estimate and exit without training.")
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        for f in dataclasses.fields(cls):
            add_field_flag(group, f)
    return parser


def add_field_flag(group, f: dataclasses.Field, default: object = argparse.SUPPRESS) -> None:
    """The flag of one config field (Megatron's name and its other spellings, help, type, choices, nargs); also
    used by `tricorn preprocess`."""
    flag = flag_of(f)
    meta = dict(f.metadata)
    helptext = meta.pop("help")
    negate = meta.pop("negate", None)
    names = [flag, *meta.pop("aliases", [])]  # Megatron's other spellings of the same flag
    meta.pop("bound", None)
    base, _ = field_kind(f)
    if base == "bool":
        if negate:
            group.add_argument(negate, dest=f.name, action="store_false", help=helptext + " (on by default)", default=default)
            group.add_argument(*names, dest=f.name, action="store_true", help=argparse.SUPPRESS, default=default)
        else:
            group.add_argument(*names, dest=f.name, action="store_true", help=helptext, default=default)
        return
    if "type" not in meta:
        meta["type"] = {"int": int, "float": float}.get(base, str)
    if "choices" in meta and meta["type"] is str:
        meta["choices"] = [str(c) for c in meta["choices"]]
    group.add_argument(*names, dest=f.name, help=helptext, default=default, **meta)
