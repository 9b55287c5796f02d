"""Fuzz the config layer: random bad flag values and random bad YAML, at least 500 cases in-process.

Each case takes the valid base flags, breaks one to three fields (from the command line or a YAML
file; the bad value is drawn from the field's own type, choices and range, so every case is invalid)
and runs the real entry point. Every case must exit 2 with one `tricorn: error:` line, no traceback,
and nothing written. The seed is fixed, so a failure reproduces; the failing case is in the message.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import yaml
from badinput import assert_one_line, run_main, snapshot
from harness import BASE_FLAGS

from tricorn.config import SECTIONS
from tricorn.fields import field_kind, flag_of

CASES = 600
FIELDS = [(section, f) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
JUNK = ["", "abc", "1.5.2", "0x1g", "--", "[]", "{a: 1}", "ünïcode", "1e999999", "nan", "-inf"]


def bad_number(rng: random.Random, f: dataclasses.Field, integer: bool) -> Any:
    """A value of the right type outside the field's range, or outside int64 / finite float32."""
    bound = f.metadata.get("bound")
    options: list[Any] = [10 ** rng.randint(19, 4000) * rng.choice([1, -1])] if integer else [float("nan"), float("inf"), 1e39]
    if bound is not None and bound.lo is not None:
        options.append(bound.lo - (rng.randint(1, 1000) if integer else rng.uniform(1e-6, 1e3)))
        if bound.lo_open:
            options.append(bound.lo)
    if bound is not None and bound.hi is not None:
        options.append(bound.hi + (rng.randint(1, 1000) if integer else rng.uniform(1e-6, 1e3)))
        if bound.hi_open:
            options.append(bound.hi)
    return rng.choice(options)


def cli_case(rng: random.Random, f: dataclasses.Field) -> list[str]:
    """Flag tokens that must be refused for field f."""
    base, _ = field_kind(f)
    flag = flag_of(f)
    if base == "bool":
        return [f.metadata.get("negate") or flag, rng.choice(JUNK[1:4])]  # a store_true flag takes no value
    if base in ("int", "float") and f.metadata.get("choices") is None:
        if rng.random() < 0.3:
            return [flag, rng.choice(JUNK[:6])]
        return [f"{flag}={bad_number(rng, f, base == 'int')}"]
    if f.metadata.get("choices") is not None:
        return [flag, rng.choice(JUNK[1:3]) + "x"]
    if f.metadata.get("nargs") == 3:
        return [flag, "1", rng.choice(["x", "2.5"]), "3"]
    if base == "list" and f.metadata.get("type") is int:
        return [flag, "1"]
    return []  # a free string or list of strings: any text is valid on the command line


def yaml_value(rng: random.Random, f: dataclasses.Field) -> Any:
    """A YAML value that must be refused for field f."""
    base, _ = field_kind(f)
    wrong_type = {
        "bool": ["yes please", 1, [True], {"a": 1}],
        "int": ["64", 1.5, [2], {"a": 1}, True],
        "float": ["fast", [1.0], {"a": 1}, False],
        "str": [3, 2.5, ["a"], {"a": 1}, True],
        "list": ["a b", 7, {"a": 1}, [], [[1]]],
    }[base]
    if base in ("int", "float") and f.metadata.get("choices") is None and rng.random() < 0.5:
        return bad_number(rng, f, base == "int")
    if f.metadata.get("choices") and base == "str":
        wrong_type.append("not-a-choice")
    return rng.choice(wrong_type)


def random_case(rng: random.Random, case: int) -> tuple[list[str], Any]:
    """(argv tail, YAML data or None)."""
    if case % 10 == 9:  # broken YAML documents and structure
        return [], rng.choice(
            [
                "model: [unclosed",
                "- just\n- a list",
                {"model": {"hidden_sise": 64}},
                {"optimizer": {}},
                {"model": 5},
                {"device": "tpu"},
                {"model_preset": 7},
                "\t\x00",
            ]
        )
    picks = rng.sample(FIELDS, rng.randint(1, 3))
    if rng.random() < 0.5:
        tokens = [t for _, f in picks for t in cli_case(rng, f)]
        if tokens:
            return tokens, None
    data: dict[str, dict[str, Any]] = {}
    for section, f in picks:
        data.setdefault(section, {})[f.name] = yaml_value(rng, f)
    return [], data


def _keep_base_out(flags: list[str], data: Any) -> list[str]:
    """Base flags minus those the YAML sets (flags override the YAML: the bad value would be hidden)."""
    if not isinstance(data, dict):
        return flags
    hidden = {flag_of(f) for section, values in data.items() if isinstance(values, dict) for f in _fields(section, values)}
    out, skip = [], False
    for i, token in enumerate(flags):
        if skip:
            skip = False
            continue
        if token in hidden:
            skip = i + 1 < len(flags) and not flags[i + 1].startswith("--")
            continue
        out.append(token)
    return out


def _fields(section: str, values: dict) -> list[dataclasses.Field]:
    cls = SECTIONS.get(section)
    return [f for f in dataclasses.fields(cls) if f.name in values] if cls else []


def test_fuzz_config_cases(tmp_path):
    rng = random.Random(16)
    before = snapshot(tmp_path)
    config = tmp_path / "fuzz.yaml"
    for case in range(CASES):
        tail, data = random_case(rng, case)
        argv = list(BASE_FLAGS)
        if data is not None:
            config.write_text(data if isinstance(data, str) else yaml.safe_dump(data, allow_unicode=True))
            argv = ["--config", str(config)] + _keep_base_out(argv, data)
        argv += tail
        code, stderr = run_main(argv, tmp_path)
        try:
            assert_one_line(code, stderr)
        except AssertionError as e:
            raise AssertionError(f"case {case}: argv {argv} yaml {data!r}: {e}") from None
        if config.exists():
            config.unlink()
        assert snapshot(tmp_path) == before, f"case {case} ({argv}) wrote {sorted(snapshot(tmp_path) - before)}"
