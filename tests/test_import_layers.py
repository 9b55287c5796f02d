"""Imports point down only: config is the leaf, parallel sits under training, the model knows no collectives.

Read from the source with `ast`, so a lazy import inside a function counts as much as a top-level one.
"""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "tricorn"


def imported_modules(path: Path, with_members: bool = False) -> set[str]:
    """Every absolute import of the file; with_members, `from a.b import c` also names a.b.c (c may be a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if with_members:
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def offenders(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{f.relative_to(PKG.parent)} imports {m}"
        for f in files
        for m in sorted(imported_modules(f))
        if any(m == p or m.startswith(p + ".") for p in forbidden)
    ]


@pytest.mark.parametrize(
    "files, forbidden",
    [
        (
            [PKG / "config.py", PKG / "config_monitoring.py", PKG / "fields.py", PKG / "presets.py"],
            ("tricorn.parallel", "tricorn.training", "tricorn.planning", "tricorn.data", "tricorn.model"),
        ),
        (sorted((PKG / "parallel").rglob("*.py")), ("tricorn.training", "tricorn.planning")),
        (sorted((PKG / "model").rglob("*.py")), ("torch.distributed", "tricorn.parallel", "tricorn.training")),
        ([PKG / "timers.py", PKG / "profiling.py", PKG / "fr_trace.py"], ("tricorn.parallel", "tricorn.training")),
        (
            sorted((PKG / "planning").rglob("*.py")),
            ("tricorn.training", "tricorn.simulate", "tricorn.checkpoint", "tricorn.plan_cli"),
        ),
        (sorted((PKG / "checkpoint").rglob("*.py")), ("tricorn.training", "tricorn.planning", "tricorn.simulate")),
        (sorted((PKG / "data").rglob("*.py")), ("tricorn.parallel", "tricorn.training")),
        (sorted((PKG / "training").rglob("*.py")), ("tricorn.simulate", "tricorn.plan_cli", "tricorn.cli")),
    ],
    ids=[
        "config-is-the-leaf",
        "parallel-under-training",
        "model-collective-free",
        "timers-leaf",
        "planning-is-arithmetic",
        "checkpoint-under-training",
        "data-under-parallel",
        "training-under-orchestration",
    ],
)
def test_imports_point_down(files, forbidden):
    assert files
    assert offenders(files, forbidden) == []


def module_name(path: Path, root: Path = PKG) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PKG) -> dict[str, set[str]]:
    """module -> the package's modules it imports (lazy imports and TYPE_CHECKING blocks included). `from a.b import c`
    counts as an import of a.b, or of a.b.c where that is a module of its own."""
    files = {module_name(f, root): f for f in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, f in files.items():
        targets = imported_modules(f, with_members=True)
        graph[name] = {t for t in targets if t in files and t != name and not name.startswith(t + ".")}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each sorted: [] when imports form a DAG."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_no_import_cycles():
    """No two modules of tricorn import each other, directly or around a circle (a package importing its own
    submodules in __init__ is not a circle: a submodule's import of its parent package is not counted)."""
    assert import_cycles(import_graph()) == []


def test_cycle_checker_finds_a_circle(tmp_path):
    """The check can fail: a three-module circle (one import lazy, one under TYPE_CHECKING) is found."""
    pkg = tmp_path / "tricorn"
    (pkg / "planning").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "planning" / "__init__.py").write_text("")
    (pkg / "planning" / "a.py").write_text("from tricorn.planning.b import x\n")
    (pkg / "planning" / "b.py").write_text("def f():\n    from tricorn.planning import c\n")
    (pkg / "planning" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tricorn.planning.a\n")
    (pkg / "planning" / "d.py").write_text("import tricorn.planning.a\n")
    assert import_cycles(import_graph(pkg)) == [["tricorn.planning.a", "tricorn.planning.b", "tricorn.planning.c"]]


def test_checker_sees_lazy_imports(tmp_path):
    """The check can fail: an import inside a function is found."""
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from tricorn.training.loop import Trainer\n")
    assert "tricorn.training.loop" in imported_modules(f)


def test_future_warnings_from_tricorn_are_errors_under_make_test():
    """`make test` sets TRICORN_STRICT_WARNINGS=1: a FutureWarning attributed to a tricorn module raises, one from
    elsewhere stays a warning. Checked in a fresh interpreter, as a rank would start."""
    import os
    import subprocess
    import sys

    code = (
        "import warnings, tricorn\n"
        "warnings.warn_explicit('elsewhere', FutureWarning, 'x.py', 1, module='torch.distributed')\n"
        "try:\n"
        "    warnings.warn_explicit('ours', FutureWarning, 'x.py', 1, module='tricorn.parallel.tensor')\n"
        "except FutureWarning:\n"
        "    print('raised')\n"
    )
    env = {**os.environ, "TRICORN_STRICT_WARNINGS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "raised", out.stdout + out.stderr
    assert "elsewhere" in out.stderr
    lax = subprocess.run(
        [sys.executable, "-c", code], env={**env, "TRICORN_STRICT_WARNINGS": "0"}, capture_output=True, text=True, timeout=60
    )
    assert lax.stdout.strip() == "" and "ours" in lax.stderr
