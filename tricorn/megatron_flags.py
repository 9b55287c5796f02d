"""Megatron-LM's command line in tricorn: every flag of its argument parser is implemented, a no-op, or refused.

tricorn/megatron_args.json is Megatron-LM's parser at core_v0.19.0, dumped by
scripts/make_megatron_args_fixture.py (each option's flags, dest, action, nargs, type, default, choices).
Each option is

- **implemented** when tricorn's own parser (tricorn/flag_parser.py) defines one of its flags: derived, so a
  flag another change adds is implemented with no edit here;
- a **no-op** (tricorn/megatron_flag_table.py NO_OPS): it changes how Megatron runs or logs, not what tricorn
  computes. The no-ops a command line gives are listed in one start-up line (`megatron_notice`);
- **refused** (REFUSED) unless its value is what tricorn does anyway (Megatron's default, or FINE's value for
  this run): one error line names every such flag with why (`check_command_line`).

`add_megatron_options` puts the options tricorn does not define into its parser (hidden from --help, under the
dest "megatron:<dest>"), so they parse with Megatron's nargs and types. A command line with such a flag is a
Megatron command line: without --config, the flags it does not give take Megatron's defaults where tricorn's
differ and change the math (MEGATRON_DEFAULTS: LayerNorm, learned positions, dropout 0.1, ...), named in the
same start-up line. `not_reproduced` applies the same table to a checkpoint's saved args (import-megatron's
`megatron.yaml`). `flags_table_markdown` writes docs/megatron-flags.md from all of it.

Pure Python over argparse and JSON: no torch, no collectives.
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

from tricorn import megatron_flag_table as table

ARGS_FILE = Path(__file__).with_name("megatron_args.json")
PREFIX = "megatron:"  # the parser's dest of a Megatron option tricorn does not define
IMPLEMENTED, NO_OP, REFUSED = "implemented", "no-op", "refused"
# A saved args namespace holds the precision-aware optimizer's dtypes as torch dtypes; tricorn's flags name them.
TORCH_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_TYPES = {"int": int, "float": float, "str": str}


@dataclass(frozen=True)
class Option:
    """One option of Megatron-LM's parser."""

    flags: tuple[str, ...]
    dest: str
    action: str
    nargs: Any = None
    type: Optional[str] = None
    default: Any = None
    choices: Optional[tuple] = None
    const: Any = None
    group: Optional[str] = None

    @property
    def flag(self) -> str:
        return self.flags[0]


@functools.lru_cache(maxsize=1)
def megatron_options() -> tuple[Option, ...]:
    data = json.loads(ARGS_FILE.read_text())
    names = {f.name for f in fields(Option)}
    out = []
    for o in data["options"]:
        o = {k: v for k, v in o.items() if k in names}
        o["flags"] = tuple(o["flags"])
        o["choices"] = tuple(o["choices"]) if o.get("choices") is not None else None
        out.append(Option(**o))
    return tuple(out)


def megatron_version() -> str:
    return json.loads(ARGS_FILE.read_text())["megatron_lm"]


@functools.lru_cache(maxsize=1)
def _by_reason() -> tuple[dict[str, str], dict[str, str]]:
    noops = {dest: why for why, dests in table.NO_OPS.items() for dest in dests}
    refused = {dest: why for why, dests in table.REFUSED.items() for dest in dests}
    return noops, refused


@functools.lru_cache(maxsize=1)
def tricorn_flags() -> frozenset[str]:
    from tricorn.flag_parser import tricorn_parser

    return frozenset(f for a in tricorn_parser()._actions for f in a.option_strings)


def status(option: Option) -> str:
    """implemented, no-op or refused (whatever the value); KeyError for an option the tables miss."""
    if any(f in tricorn_flags() for f in option.flags):
        return IMPLEMENTED
    noops, refused = _by_reason()
    if option.dest in noops:
        return NO_OP
    if option.dest in refused:
        return REFUSED
    raise KeyError(f"Megatron option {option.flag} (dest {option.dest}) is in neither table of tricorn/megatron_flag_table.py")


def reason(option: Option) -> str:
    """Why the option is a no-op or refused (its group's reason, or a more precise one)."""
    noops, refused = _by_reason()
    return table.WHY.get(option.dest) or noops.get(option.dest) or refused.get(option.dest) or ""


def group_reason(option: Option) -> str:
    noops, refused = _by_reason()
    return noops.get(option.dest) or refused.get(option.dest) or ""


def is_fine(option: Option, value: Any, ctx: dict) -> bool:
    """Whether a refused option's value is what tricorn does anyway (FINE, else Megatron's default)."""
    fine = table.FINE.get(option.dest)
    if fine is None:
        return value == option.default
    if callable(fine):
        return fine(value, ctx)
    return value == option.default or value in fine or str(value) in fine  # str: a saved torch dtype


def _shown(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return ""
    if isinstance(value, list):
        return "=" + " ".join(str(v) for v in value)
    return f"={value}"


# ---------------------------------------------------------------- the command line


def add_megatron_options(parser: argparse.ArgumentParser) -> None:
    """Megatron's options that tricorn's parser does not define, hidden, with Megatron's nargs and types."""
    ours = {f for a in parser._actions for f in a.option_strings}
    for o in megatron_options():
        if any(f in ours for f in o.flags):
            continue
        kwargs: dict[str, Any] = {"dest": PREFIX + o.dest, "help": argparse.SUPPRESS}
        flags = o.flags
        if o.action in ("store_true", "store_false"):
            kwargs["action"] = o.action
        elif o.action == "boolean_optional":  # argparse adds the --no- form itself
            kwargs["action"] = argparse.BooleanOptionalAction
            flags = tuple(f for f in flags if not f.startswith("--no-"))
        else:
            kwargs["type"] = _TYPES.get(o.type or "str", str)
            if o.nargs is not None:
                kwargs["nargs"] = o.nargs
            if o.choices and kwargs["type"] is not str or o.choices and all(isinstance(c, str) for c in o.choices):
                kwargs["choices"] = list(o.choices)
        parser.add_argument(*flags, **kwargs)


def _by_dest() -> dict[str, Option]:
    return {o.dest: o for o in megatron_options()}


def run_context(cfg) -> dict:
    """A config as FINE's predicates read it: every field by name, the device and DP."""
    from tricorn.config import SECTIONS

    ctx = {f.name: getattr(getattr(cfg, s), f.name) for s in SECTIONS for f in fields(getattr(cfg, s))}
    ctx.update(device=cfg.device, data_parallel_size=cfg.data_parallel_size if cfg.world_size else None)
    return ctx


def check_command_line(given: dict[str, Any], ctx: dict) -> tuple[list[str], list[str]]:
    """(no-op flags, refusal sentences) of the Megatron-only options a command line gave (dest -> value)."""
    options, noops, refusals = _by_dest(), [], []
    for dest, value in given.items():
        o = options[dest]
        kind = status(o)
        if kind == NO_OP or (kind == REFUSED and is_fine(o, value, ctx)):
            noops.append(o.flag + ("" if kind == NO_OP else _shown(value)))
        elif kind == REFUSED:
            refusals.append(f"{o.flag}{_shown(value)} ({reason(o)})")
    return noops, refusals


def megatron_notice(noops: list[str], defaults: dict[str, Any]) -> Optional[str]:
    """The one start-up line of a Megatron command line: its no-ops, and Megatron's defaults it was given."""
    if not noops and not defaults:
        return None
    parts = []
    if noops:
        parts.append(f"no effect in tricorn (docs/megatron-flags.md): {', '.join(noops)}")
    if defaults:
        shown = ", ".join(_flag_text(k, v) for k, v in defaults.items())
        parts.append(f"Megatron's defaults where tricorn's differ: {shown}")
    return "Megatron flags: " + "; ".join(parts)


def _flag_text(name: str, value: Any) -> str:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    return f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"


def megatron_defaults(cfg, given: set[str]) -> dict[str, Any]:
    """Apply Megatron's defaults to the fields a Megatron command line did not set, where they matter; returns
    what was applied."""
    from tricorn.config import SECTIONS

    applied: dict[str, Any] = {}
    for section in SECTIONS:
        obj = getattr(cfg, section)
        for f in fields(obj):
            if f.name in table.MEGATRON_DEFAULTS and f.name not in given:
                value, matters = table.MEGATRON_DEFAULTS[f.name]
                if getattr(obj, f.name) != value and matters(cfg):
                    setattr(obj, f.name, value)
                    applied[f.name] = value
    m = cfg.model
    if m.swiglu and m.ffn_hidden_size is None and "ffn_hidden_size" not in given:
        # Megatron's SwiGLU width: 2/3 of 4h, down to a multiple of 64 (arguments.py)
        m.ffn_hidden_size = applied["ffn_hidden_size"] = int((4 * m.hidden_size * 2 / 3) / 64) * 64
    return applied


# ---------------------------------------------------------------- a checkpoint's saved args


def not_reproduced(args: dict) -> list[str]:
    """The Megatron args (a checkpoint's saved namespace) whose values tricorn would not reproduce, as
    `--flag=value` (docs/megatron-flags.md says why): refused options that change the math (megatron_flag_table.MATH) away from their fine
    value, and implemented ones whose value tricorn's parser would not take. `megatron.yaml`'s first line lists
    them (import-megatron)."""
    from tricorn.flag_parser import tricorn_parser

    choices = {a.dest: a.choices for a in tricorn_parser()._actions if a.choices}
    out: list[str] = []
    seen: set[str] = set()
    for o in megatron_options():
        if o.dest in seen or o.dest not in args:
            continue
        seen.add(o.dest)
        value = args[o.dest]
        kind = status(o)
        if kind == REFUSED and group_reason(o) in table.MATH and not is_fine(o, value, args):
            out.append(f"{o.flag}{_shown(value) or '=' + str(value)}")
        elif kind == IMPLEMENTED and isinstance(value, str) and o.dest in choices:
            name = value.rsplit(".", 1)[-1]  # a saved enum reads "Signals.SIGTERM", a dtype "torch.float32"
            name = TORCH_DTYPE_NAMES.get(name, name)
            if name not in choices[o.dest]:
                out.append(f"{o.flag}={value}")
    return out


# ---------------------------------------------------------------- docs/megatron-flags.md


def flags_table_markdown() -> str:
    """docs/megatron-flags.md: every option of Megatron's parser with its status in tricorn."""
    rows_by_status: dict[str, list[Option]] = {IMPLEMENTED: [], NO_OP: [], REFUSED: []}
    for o in megatron_options():
        rows_by_status[status(o)].append(o)
    lines = [
        "# Megatron-LM's flags in tricorn",
        "",
        "<!-- Generated by `python -m tricorn.megatron_flags --write-docs` from Megatron-LM's own parser",
        f"({megatron_version()}, tricorn/megatron_args.json) and tricorn/megatron_flag_table.py;",
        "tests/test_megatron_flags.py fails when it is stale. Do not edit by hand. -->",
        "",
        f"Every option of Megatron-LM's argument parser at {megatron_version()} ({len(megatron_options())} options) "
        "is one of three things in tricorn's `pretrain_gpt.py` (and the `tricorn` subcommands that take its flags):",
        "",
        f"- **implemented** ({len(rows_by_status[IMPLEMENTED])}): tricorn's parser defines the flag;",
        f"- **no-op** ({len(rows_by_status[NO_OP])}): it changes how Megatron runs or logs, not what tricorn computes; "
        "the no-ops a command line gives are listed in one start-up line;",
        f"- **refused** ({len(rows_by_status[REFUSED])}): one error line names it and says why, unless its value is the "
        "one tricorn does anyway (the *accepted* column: Megatron's default, or what this run does), which is a no-op.",
        "",
        "How a Megatron command line is read, and Megatron's defaults that differ from tricorn's: "
        "[megatron.md](megatron.md#megatrons-command-line).",
        "",
        "## Implemented",
        "",
        " ".join(f"`{o.flag}`" for o in rows_by_status[IMPLEMENTED]),
        "",
        "## No-ops",
        "",
        "| why | flags |",
        "|---|---|",
    ]
    for why in table.NO_OPS:
        flags = [f"`{f}`" for o in rows_by_status[NO_OP] if group_reason(o) == why for f in o.flags]
        lines.append(f"| {why} | {' '.join(flags)} |")
    lines += ["", "## Refused", "", "| flag | accepted | why |", "|---|---|---|"]
    for o in sorted(rows_by_status[REFUSED], key=lambda o: (list(table.REFUSED).index(group_reason(o)), o.flag)):
        lines.append(f"| {' '.join(f'`{f}`' for f in o.flags)} | {_accepted(o)} | {reason(o)} |")
    return "\n".join(lines) + "\n"


def _accepted(o: Option) -> str:
    fine = table.FINE.get(o.dest)
    if callable(fine):
        return table.FINE_TEXT[o.dest]
    values = [o.default] + [v for v in (fine or ()) if v != o.default]
    if o.action in ("store_true", "store_false", "boolean_optional"):
        return "not given"
    return ", ".join("not given" if v is None else f"`{v}`" for v in values)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tricorn.megatron_flags", description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", action="store_true", help="Rewrite docs/megatron-flags.md.")
    args = parser.parse_args(argv)
    text = flags_table_markdown()
    if args.write_docs:
        path = Path(__file__).resolve().parent.parent / "docs" / "megatron-flags.md"
        path.write_text(text)
        print(f"wrote {path}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
