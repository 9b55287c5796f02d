"""Write tricorn/megatron_args.json: every option of Megatron-LM's argument parser (core_v0.19.0).

Run with Megatron-LM's source on the path, in the fixture environment (megatron-core 0.19.2, Python 3.12):

    PYTHONPATH=/tmp/Megatron-LM /tmp/mcore/bin/python scripts/make_megatron_args_fixture.py \
        --output tricorn/megatron_args.json

The parser is the one pretrain_gpt.py builds (megatron.training.arguments.add_megatron_arguments; the
ModelOpt options it adds only when nvidia-modelopt is installed are not part of it). Stored per option, in the
parser's order: its flag strings, dest, action (store, store_true, ...), nargs, type name, default (JSON, or
its repr), choices and const, and the title of its argument group (keys whose value is null are left out).
Help texts are left out (Megatron's prose). It is a fixture made by the tool itself, kept in the package
rather than under tests/fixtures because pretrain_gpt.py reads it at run time: tricorn/megatron_flags.py
classifies each option, and docs/megatron-flags.md is generated from both.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MEGATRON_LM_TAG = "core_v0.19.0"
ACTIONS = {
    argparse._StoreAction: "store",
    argparse._StoreTrueAction: "store_true",
    argparse._StoreFalseAction: "store_false",
    argparse._StoreConstAction: "store_const",
    argparse._AppendAction: "append",
    argparse._AppendConstAction: "append_const",
    argparse._CountAction: "count",
    argparse.BooleanOptionalAction: "boolean_optional",
}


def _json(value):
    """value if JSON can hold it exactly, else its repr."""
    try:
        if json.loads(json.dumps(value)) == value:
            return value
    except (TypeError, ValueError):
        pass
    return repr(value)


def dump(parser: argparse.ArgumentParser) -> list[dict]:
    group_of = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    out = []
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        kind = ACTIONS.get(type(a), type(a).__name__)
        type_name = None if a.type is None else getattr(a.type, "__name__", repr(a.type))
        option = {
            "flags": list(a.option_strings),
            "dest": a.dest,
            "action": kind,
            "nargs": a.nargs,
            "type": type_name,
            "default": _json(a.default),
            "choices": None if a.choices is None else [_json(c) for c in a.choices],
            "const": _json(a.const),
            "group": group_of.get(id(a)),
        }
        out.append({k: v for k, v in option.items() if v is not None})
    return out


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--output", type=Path, required=True)
    out = cli.parse_args().output
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    options = dump(parser)
    lines = [json.dumps(o) for o in options]  # one option a line: a diff of the fixture reads as a diff of flags
    out.write_text(f'{{"megatron_lm": "{MEGATRON_LM_TAG}", "options": [\n' + ",\n".join(lines) + "\n]}\n")
    print(f"wrote {len(options)} options to {out}")


if __name__ == "__main__":
    main()
