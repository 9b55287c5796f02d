"""Which CUDA-only lines of tricorn a test run leaves unexecuted (issue 26: "CUDA-only lines make test still
does not execute"), measured with coverage.py.

    .venv/bin/python bench/cuda_coverage.py run [--out DIR] [--append] [TESTS ...]   # pytest under coverage
    .venv/bin/python bench/cuda_coverage.py report [--out DIR]            # the count and the list

`run` measures the ranks that the tests launch as well (coverage's `patch = subprocess, _exit`; the fork server
is turned off with TRICORN_TEST_NO_FORK=1 so that every rank is a real, measured process). Default tests: the
ones about the CUDA path (DEFAULT_TESTS). `report` finds the CUDA-only lines statically:

- the statements of a branch that runs only on CUDA/NCCL: `if` tests such as `device.type == "cuda"`,
  `cfg.device == "cuda"`, `t.is_cuda`, `backend == "nccl"`, `torch.cuda.is_available()`, a name `cuda`, and
  `and`-conjunctions containing one; for the negated forms (`!= "cuda"`, `not cuda`) the `else` branch, and the
  rest of the block after an early `return`/`continue`/`raise`;
- every line calling `torch.cuda.<fn>(...)` other than the queries that run on any build (is_available,
  device_count, is_initialized).

A line counts as executed when coverage saw it run. Limits: line granularity (a `torch.cuda` call inside a
conditional expression on a line that runs on CPU counts as executed), and code reachable only on CUDA through
a call from elsewhere (a function only CUDA code calls) is not found.
No torch import, no device work.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tricorn"
DEFAULT_TESTS = [
    "tests/test_timers.py",
    "tests/test_tf32.py",
    "tests/test_group_timeouts.py",
    "tests/test_cuda_context.py",
    "tests/test_cuda_branches.py",
    "tests/test_host_reads.py",
    "tests/test_te_backend.py",
    "tests/test_gpu_check.py",
    "tests/test_cuda_contract.py",
]
CUDA_CONSTANTS = {"cuda", "nccl"}
CUDA_NAMES = {"cuda", "is_cuda", "on_cuda", "use_cuda"}
HARMLESS = {"is_available", "device_count", "is_initialized"}  # torch.cuda queries that run on a CPU build


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def polarity(test: ast.AST) -> int:
    """+1: the test is true only on CUDA; -1: only off CUDA (its negation is CUDA-only); 0: neither."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return -polarity(test.operand)
    if isinstance(test, ast.BoolOp):
        signs = [polarity(v) for v in test.values]
        if isinstance(test.op, ast.And):
            return 1 if 1 in signs else 0
        return -1 if -1 in signs else 0  # `not cuda or x`: false only on CUDA
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        sides = [test.left, test.comparators[0]]
        if any(isinstance(s, ast.Constant) and s.value in CUDA_CONSTANTS for s in sides):
            positive, negative = (ast.Eq, ast.Is, ast.In), (ast.NotEq, ast.IsNot, ast.NotIn)  # `"cuda" in states` too
            return 1 if isinstance(test.ops[0], positive) else -1 if isinstance(test.ops[0], negative) else 0
        return 0
    if isinstance(test, (ast.Name, ast.Attribute)) and _dotted(test).split(".")[-1] in CUDA_NAMES:
        return 1
    if isinstance(test, ast.Call) and _dotted(test.func) == "torch.cuda.is_available":
        return 1
    return 0


def _lines(stmts: list[ast.stmt]) -> set[int]:
    out: set[int] = set()
    for stmt in stmts:
        for node in ast.walk(stmt):
            if isinstance(node, ast.stmt):
                out.add(node.lineno)
    return out


def _exits(stmts: list[ast.stmt]) -> bool:
    return bool(stmts) and isinstance(stmts[-1], (ast.Return, ast.Continue, ast.Break, ast.Raise))


def cuda_only_lines(source: str) -> set[int]:
    tree = ast.parse(source)
    out: set[int] = set()
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            for i, stmt in enumerate(block):
                if isinstance(stmt, ast.If):
                    sign = polarity(stmt.test)
                    if sign > 0:
                        out |= _lines(stmt.body)
                    elif sign < 0:
                        out |= _lines(stmt.orelse)
                        if not stmt.orelse and _exits(stmt.body):
                            out |= _lines(block[i + 1 :])
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name.startswith("torch.cuda.") and name.split(".")[-1] not in HARMLESS:
                out.add(node.lineno)
    return out


@dataclass
class Line:
    path: str
    number: int
    text: str


def report(data_file: Path) -> tuple[int, list[Line]]:
    """(CUDA-only statements in tricorn, the unexecuted ones) from a combined coverage data file."""
    import coverage

    cov = coverage.Coverage(data_file=str(data_file))
    cov.load()
    total, missing = 0, []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        candidates = cuda_only_lines(source)
        if not candidates:
            continue
        _, statements, _, not_run, _ = cov.analysis2(str(path))
        cuda = candidates & set(statements)
        total += len(cuda)
        lines = source.splitlines()
        missing += [Line(str(path.relative_to(ROOT)), n, lines[n - 1].strip()) for n in sorted(cuda & set(not_run))]
    return total, missing


def run(out: Path, tests: list[str], append: bool = False) -> int:
    out.mkdir(parents=True, exist_ok=True)
    rc = out / "coveragerc"
    rc.write_text(f"[run]\nsource = {PACKAGE}\nparallel = true\npatch = subprocess\n    _exit\ndata_file = {out / '.coverage'}\n")
    env = {**os.environ, "TRICORN_TEST_NO_FORK": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    code = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    combine = [sys.executable, "-m", "coverage", "combine", f"--rcfile={rc}", "-q", *(["--append"] if append else [])]
    subprocess.run(combine, cwd=ROOT, env=env, check=True)
    return code


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["run", "report"])
    ap.add_argument("tests", nargs="*", default=DEFAULT_TESTS)
    ap.add_argument("--append", action="store_true", help="run: add to the data of an earlier run")
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "tricorn-cuda-coverage")
    args = ap.parse_intermixed_args(argv)  # options before or after the test paths
    if args.command == "run":
        code = run(args.out, args.tests, args.append)
        print(f"tests exit {code}; data in {args.out / '.coverage'}")
    total, missing = report(args.out / ".coverage")
    for line in missing:
        print(f"{line.path}:{line.number}: {line.text}")
    print(f"CUDA-only lines in tricorn: {total}; executed: {total - len(missing)}; not executed: {len(missing)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
