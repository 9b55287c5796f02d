"""tricorn's Transformer Engine calls, and the CPU stand-in, against TE's REAL API of the pinned range.

The pinned TE's pure-Python wheel (`transformer_engine`, which holds transformer_engine/pytorch/*.py; the
C++ parts are the separate transformer_engine_torch / transformer_engine_cu12 packages) is installed with
`pip install --no-deps --target` for the lowest and the highest version of the `te` extra's range. Its
sources are parsed with `ast` and never imported (TE does not import without CUDA). Checked:
- every keyword tricorn passes to `Linear(...)`, `Linear.forward`, the recipes and the autocast entry point
  (recorded by running tricorn's TE code on the stand-in) is a parameter of that version's signature, and
  the names tricorn reaches (`te.pytorch.Linear`, `autocast` / `fp8_autocast`, the recipe classes, `Format`
  members) exist there;
- every parameter of the stand-in (tests/te_standin.py) exists in TE with the same kind and default;
- the check fails against a TE source with one keyword tricorn uses renamed.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Optional

import pytest
import te_standin
import torch
import torch.distributed as dist
from real_tokenizers import OFFLINE  # what pip and npm print when the registry is unreachable

from tricorn.config_args import config_from_args
from tricorn.parallel.te import TE_BELOW, TE_MIN

# The lowest and the highest release of the pinned range (pyproject.toml's `te` extra).
TE_VERSIONS = ["2.8.0", "2.20.2"]
FLAGS = "--device cpu --mock-data --num-layers 1 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --vocab-size 100 --swiglu --bf16".split()


# ---------------------------------------------------------------- TE's sources, parsed


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "positional" (positional or keyword) | "keyword" (keyword-only)
    default: Optional[str]  # the default's source text; None: required


def _params(fn: ast.FunctionDef) -> dict[str, Param]:
    a = fn.args
    out = {}
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for arg, d in zip(positional, defaults):
        out[arg.arg] = Param(arg.arg, "positional", None if d is None else ast.unparse(d))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out[arg.arg] = Param(arg.arg, "keyword", None if d is None else ast.unparse(d))
    out.pop("self", None)
    return out


def _class(tree: ast.Module, name: str) -> Optional[ast.ClassDef]:
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def _method(cls: ast.ClassDef, name: str) -> Optional[ast.FunctionDef]:
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _fields(cls: ast.ClassDef) -> dict[str, Param]:
    """A dataclass's fields (annotated class attributes), as keyword parameters of its constructor."""
    return {
        n.target.id: Param(n.target.id, "keyword", None if n.value is None else ast.unparse(n.value))
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }


def parse_api(root: Path) -> dict[str, dict[str, Param]]:
    """TE's signatures tricorn depends on, from the sources under `root` (a dir holding transformer_engine/)."""
    pt = root / "transformer_engine" / "pytorch"
    api: dict[str, dict[str, Param]] = {}
    linear = _class(ast.parse((pt / "module" / "linear.py").read_text()), "Linear")
    assert linear is not None, "no class Linear in transformer_engine/pytorch/module/linear.py"
    api["Linear.__init__"] = _params(_method(linear, "__init__"))
    api["Linear.forward"] = _params(_method(linear, "forward"))
    exported = {
        alias.asname or alias.name
        for node in ast.walk(ast.parse((pt / "__init__.py").read_text()))
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    for source in sorted(pt.glob("*.py")):  # the autocast entry points: pytorch/fp8.py (2.8), quantization.py (2.9+)
        for node in ast.parse(source.read_text()).body:
            if node.__class__ in (ast.FunctionDef, ast.ClassDef) and node.name in ("autocast", "fp8_autocast"):
                if node.name in exported:
                    fn = _method(node, "__init__") if isinstance(node, ast.ClassDef) else node
                    api[node.name] = _params(fn)
    recipes = ast.parse((root / "transformer_engine" / "common" / "recipe" / "__init__.py").read_text())
    for name in ("DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling"):
        cls = _class(recipes, name)
        if cls is not None:
            api[name] = _fields(cls)
    fmt = _class(recipes, "Format")
    api["Format"] = {
        t.id: Param(t.id, "keyword", None)
        for n in (fmt.body if fmt else [])
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    return api


def call_problems(api: dict[str, dict[str, Param]], calls: dict[str, list]) -> list[str]:
    """What tricorn passed (`calls`: name -> [(args, kwargs)]) that the parsed `api` does not take."""
    problems = []
    for name, made in calls.items():
        if name not in api:
            problems.append(f"tricorn calls {name}, which this TE does not have")
            continue
        params = api[name]
        positional = [p for p in params.values() if p.kind == "positional"]
        for args, kwargs in made:
            if len(args) > len(positional):
                problems.append(f"{name}: {len(args)} positional arguments, TE takes {len(positional)}")
            for key in kwargs:
                if key not in params:
                    problems.append(f"{name}: tricorn passes {key}=, which TE's signature does not have")
            for p in positional[: len(args)]:
                if p.name in kwargs:
                    problems.append(f"{name}: {p.name} passed twice")
    return sorted(set(problems))


def standin_problems(api: dict[str, dict[str, Param]]) -> list[str]:
    """Parameters of the stand-in that TE does not have, or has with another kind or default."""
    s = te_standin
    ours = {
        "Linear.__init__": inspect.signature(s.Linear.__init__),
        "Linear.forward": inspect.signature(s.Linear.forward),
        "autocast": inspect.signature(s.autocast.__init__),
        "fp8_autocast": inspect.signature(s.fp8_autocast),
    }
    problems = []
    for name, sig in ours.items():
        if name not in api:
            continue  # e.g. TE 2.8 has no autocast: tricorn then calls fp8_autocast (checked by call_problems)
        for p in list(sig.parameters.values()):
            if p.name == "self":
                continue
            theirs = api[name].get(p.name)
            kind = "keyword" if p.kind is inspect.Parameter.KEYWORD_ONLY else "positional"
            default = None if p.default is inspect.Parameter.empty else p.default
            if theirs is None:
                problems.append(f"stand-in {name} has {p.name}, TE does not")
            elif theirs.kind != kind or not _same_default(default, theirs.default):
                problems.append(f"stand-in {name}({p.name}={default!r}) differs from TE's {theirs}")
    for cls in (s.DelayedScaling, s.Float8CurrentScaling, s.MXFP8BlockScaling):
        assert is_dataclass(cls)
        for f in fields(cls):
            theirs = api.get(cls.__name__, {}).get(f.name)
            if theirs is None or not _same_default(f.default, theirs.default):
                problems.append(f"stand-in {cls.__name__}.{f.name}={f.default!r} differs from TE's {theirs}")
    problems += [f"stand-in Format.{m} is not TE's" for m in s.Format.__members__ if m not in api["Format"]]
    return problems


def _same_default(ours: object, theirs: Optional[str]) -> bool:
    if theirs is None:
        return ours is None
    try:
        return ast.literal_eval(theirs) == ours
    except ValueError:
        return theirs == str(ours)  # e.g. Format.HYBRID


# ---------------------------------------------------------------- the pinned TE, installed without dependencies


@pytest.fixture(scope="module")
def te_sources(tmp_path_factory) -> dict[str, Path]:
    roots = {}
    for version in TE_VERSIONS:
        target = tmp_path_factory.mktemp(f"te-{version}")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--quiet",
            "--target",
            str(target),
            f"transformer-engine=={version}",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            if any(s in done.stderr for s in OFFLINE):
                pytest.skip(f"PyPI unreachable, TE {version} not installed: {done.stderr.strip().splitlines()[-1]}")
            raise AssertionError(f"pip install transformer-engine=={version} failed:\n{done.stderr[-2000:]}")
        roots[version] = target
    return roots


def tricorn_calls(monkeypatch, tmp_path, old_autocast: bool) -> dict[str, list]:
    """Run every TE path of tricorn (both linears, the forward, each recipe, the autocast) on the stand-in."""
    from tricorn.model import GPTModel
    from tricorn.parallel.te import enable_fp8, te_spec
    from tricorn.parallel.tensor import tensor_parallel_spec

    calls = te_standin.install(monkeypatch, old_autocast=old_autocast)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv{int(old_autocast)}", rank=0, world_size=1)
    try:
        for recipe in ("delayed", "tensorwise", "mxfp8"):
            cfg = config_from_args(FLAGS + ["--fp8-format", "hybrid", "--fp8-recipe", recipe], world_size=1)
            group = dist.group.WORLD
            model = GPTModel(cfg.model, te_spec(tensor_parallel_spec(cfg, group), cfg, group, torch.device("cpu")))
            model.init_weights(1)
            enable_fp8([model], cfg, group)
            tokens = torch.randint(0, 100, (16, 2))
            model(tokens, tokens).sum().backward()
    finally:
        dist.destroy_process_group()
    return {name: list(made) for name, made in calls.items()}


@pytest.mark.parametrize("version", TE_VERSIONS)
def test_tricorn_calls_and_standin_match_te(te_sources, version, monkeypatch, tmp_path):
    major, minor = map(int, version.split(".")[:2])
    assert TE_MIN <= (major, minor) < TE_BELOW, f"{version} is outside the pin"
    api = parse_api(te_sources[version])
    old = "autocast" not in api  # TE 2.8: tricorn falls back to fp8_autocast
    assert old == (version == "2.8.0"), sorted(api)
    calls = tricorn_calls(monkeypatch, tmp_path, old_autocast=old)
    assert {"Linear.__init__", "Linear.forward", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling"} <= set(calls)
    assert ("fp8_autocast" if old else "autocast") in calls, sorted(calls)
    assert call_problems(api, calls) == []
    assert standin_problems(api) == []


def test_the_check_fails_when_te_renames_a_keyword(te_sources, monkeypatch, tmp_path):
    """The same check against TE 2.20's source with Linear's `sequence_parallel` renamed: it reports it."""
    src = te_sources[TE_VERSIONS[-1]]
    renamed = tmp_path / "renamed"
    for path in src.joinpath("transformer_engine").rglob("*.py"):
        dest = renamed / path.relative_to(src)
        dest.parent.mkdir(parents=True, exist_ok=True)
        text = path.read_text()
        if path.name == "linear.py" and path.parent.name == "module":
            assert "        sequence_parallel: bool = False,\n" in text
            text = text.replace(
                "        sequence_parallel: bool = False,\n", "        sequence_parallel_mode: bool = False,\n", 1
            )
        dest.write_text(text)
    api = parse_api(renamed)
    calls = tricorn_calls(monkeypatch, tmp_path, old_autocast=False)
    assert "Linear.__init__: tricorn passes sequence_parallel=, which TE's signature does not have" in call_problems(api, calls)
    assert "stand-in Linear.__init__ has sequence_parallel, TE does not" in standin_problems(api)


def test_the_te_extra_pins_the_tested_range():
    from tricorn.parallel.te import TE_PIN

    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert f'te = ["{TE_PIN}"]' in pyproject
    assert f"{TE_MIN[0]}.{TE_MIN[1]}.0" == TE_VERSIONS[0]  # the lowest version of the range is the one parsed
