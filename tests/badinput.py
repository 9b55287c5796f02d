"""Shared by the bad-input tests: run the real entry point in this process and check the one-line contract.

A bad input must end with exit code 2 (config) or 1 (damaged checkpoint or data), exactly one
non-empty stderr line starting `tricorn: error:`, no traceback, and nothing written in the working
directory. Running `main()` in-process (argv given, stderr captured, SystemExit caught) costs
milliseconds, so hundreds of cases fit in a test; any other exception escapes and fails the test.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

from tricorn.training.main import main


def snapshot(root: Path) -> set[str]:
    """Every path under root (what a failed run must leave unchanged)."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def run_main(argv: list[str], cwd: Path) -> tuple[int, str]:
    """(exit code, stderr) of main(argv) run in `cwd`."""
    err = io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(old)
    return code, err.getvalue()


def assert_one_line(code: int, stderr: str, expected_code: int = 2, needle: str = "") -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == expected_code, f"exit {code}, expected {expected_code}: {stderr[-2000:]}"
    assert len(lines) == 1 and lines[0].startswith("tricorn: error: "), stderr[-2000:]
    assert "Traceback" not in stderr and "weights_only" not in stderr
    assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def assert_refused(argv: list[str], cwd: Path, expected_code: int = 2, needle: str = "") -> str:
    """main(argv) fails with one line and writes nothing under cwd."""
    before = snapshot(cwd)
    line = assert_one_line(*run_main(argv, cwd), expected_code=expected_code, needle=needle)
    assert snapshot(cwd) == before, f"a refused run wrote {sorted(snapshot(cwd) - before)}"
    return line
