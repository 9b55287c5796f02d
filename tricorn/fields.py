"""The type and range of one config value, declared next to its field: the leaf under tricorn.config.

A field's metadata (see flag_field) carries its flag's help, choices, nargs and `bound`, the
allowed range. `yaml_type_error` types a YAML value like the flag would; `value_error` checks any
value (from the flags, the YAML or code) against the field's type, choices and range. Pure Python:
no torch, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Bound:
    """The allowed range of a numeric field (each element of a list field), declared next to the field."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False  # lo itself is excluded
    hi_open: bool = False

    def contains(self, value: float) -> bool:
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    def describe(self) -> str:
        lo, hi = _num(self.lo), _num(self.hi)
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'greater than' if self.lo_open else 'at least'} {lo}"
        return f"{'less than' if self.hi_open else 'at most'} {hi}"


def flag_field(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field that also describes its command-line flag (`bound`: its allowed range)."""
    meta["help"] = help
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _num(x: Optional[float]) -> str:
    if x is None:
        return ""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


AT_LEAST_1 = Bound(lo=1)
NON_NEGATIVE = Bound(lo=0)
POSITIVE = Bound(lo=0, lo_open=True)
PROBABILITY = Bound(lo=0, hi=1, hi_open=True)  # dropout rates and Adam betas: 1 would zero everything / never decay
# Every int must fit the int64 tensors and numpy arrays it ends up in; every float the fp32 ones.
INT_LIMIT = 2**63 - 1
FLOAT_LIMIT = 3.4028234663852886e38


def int_tuple(text: str) -> list[int]:
    """Megatron's tuple_type: "4095,0" or "(4095,0)" -> [4095, 0] (an argparse type; --window-size)."""
    import argparse

    try:
        return [int(part) for part in str(text).strip().strip("()").split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be integers separated by a comma (e.g. 4095,0), got {text!r}") from None


def field_kind(f: dataclasses.Field) -> tuple[str, bool]:
    """(base type name: int/float/str/bool/list, whether None is allowed) of a config field."""
    ftype = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str")
    optional = ftype.startswith("Optional[")
    return ftype.removeprefix("Optional[").rstrip("]"), optional


def flag_of(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def yaml_type_error(f: dataclasses.Field, value: Any) -> Optional[str]:
    """Why a YAML value cannot go into field `f` ("must be an integer, got '64'"), or None: YAML is typed like the flag."""
    base, optional = field_kind(f)
    choices = f.metadata.get("choices")
    if value is None:
        return None if optional or f.default is None else "needs a value"
    if base == "bool":
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if base == "list":
        nargs = f.metadata.get("nargs")
        if not isinstance(value, list) or not value or (isinstance(nargs, int) and len(value) != nargs):
            count = f"{nargs} values" if isinstance(nargs, int) else "one or more values"
            return f"must be a list of {count}, got {value!r}"
        element_int = f.metadata.get("type") is int
        for v in value:
            ok = _is_int(v) if element_int else isinstance(v, str) or _is_number(v)  # data paths: WEIGHT PREFIX
            if not ok or (choices and v not in choices):
                return f"must list {'integers' if element_int else 'strings'}{_choice_text(choices)}, got {v!r}"
        return None
    ok = {"int": _is_int, "float": _is_number, "str": lambda v: isinstance(v, str)}[base](value)
    kind = {"int": "an integer", "float": "a number", "str": "a string"}[base]
    if not ok or (choices and value not in choices):
        return f"must be {kind}{_choice_text(choices)}, got {value!r}"
    return None


def _choice_text(choices: Optional[list]) -> str:
    return f" (one of {', '.join(str(c) for c in choices)})" if choices else ""


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 24 else f"{text[:20]}... ({len(text)} digits)"


def value_error(f: dataclasses.Field, value: Any) -> Optional[str]:
    """Why `value` cannot be field f's ("must be at least 1, got 0"), or None."""
    base, _ = field_kind(f)
    if value is None or base in ("bool", "str"):
        return yaml_type_error(f, value)
    values = value if isinstance(value, list) else [value]
    element = "int" if base == "int" or f.metadata.get("type") is int else "float" if base == "float" else None
    if element is None:
        return yaml_type_error(f, value)
    bound: Optional[Bound] = f.metadata.get("bound")
    for v in values:
        if not (_is_int(v) if element == "int" else _is_number(v)):
            return f"must be {'an integer' if element == 'int' else 'a number'}, got {v!r}"
        if element == "float" and not (math.isfinite(v) and abs(v) <= FLOAT_LIMIT):
            return f"must be a finite number that fits in float32, got {v!r}"
        if bound is not None and not bound.contains(v):
            return f"must be {bound.describe()}, got {_short(v)}"
        if element == "int" and abs(v) > INT_LIMIT:
            return f"must fit in 64 bits, got {_short(v)}"
    return None
