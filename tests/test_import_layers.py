"""Imports point down only: config is the leaf, parallel sits under training, the model knows no collectives.

Read from the source with `ast`, so a lazy import inside a function counts as much as a top-level one.
"""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "tricorn"


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
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
            [PKG / "config.py", PKG / "presets.py"],
            ("tricorn.parallel", "tricorn.training", "tricorn.planning", "tricorn.data", "tricorn.model"),
        ),
        (sorted((PKG / "parallel").rglob("*.py")), ("tricorn.training", "tricorn.planning")),
        (sorted((PKG / "model").rglob("*.py")), ("torch.distributed", "tricorn.parallel", "tricorn.training")),
        ([PKG / "timers.py"], ("tricorn.parallel", "tricorn.training")),
    ],
    ids=["config-is-the-leaf", "parallel-under-training", "model-collective-free", "timers-leaf"],
)
def test_imports_point_down(files, forbidden):
    assert files
    assert offenders(files, forbidden) == []


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
