"""Shared by the bad-input tests: run the real entry point in this process and check the one-line contract.

A bad input must end with exit code 2 (config) or 1 (damaged checkpoint or data), exactly one
non-empty stderr line starting `tricorn: error:`, no traceback, and nothing written in the working
directory. Running `main()` in-process (argv given, stderr captured, SystemExit caught) costs
milliseconds, so hundreds of cases fit in a test; any other exception escapes and fails the test.
Under torchrun (run_torchrun) the workers' output must end with that line, and torchrun's failure summary
must name it as the root cause (docs/launch-errors.md).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from harness import ENTRY, ROOT

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


# ---------------------------------------------------------------- the same contract under torchrun

# torchrun's own log lines (glog style: level, date, time, pid, file:line]).
_AGENT_LOG = re.compile(r"^[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")
_TORCHRUN_TRACEBACK = "Traceback (most recent call last):"


@dataclass
class TorchrunFailure:
    returncode: int
    output: str  # torchrun's stdout and stderr together, as a terminal shows them
    child_lines: list[str]  # the workers' non-empty lines, torchrun's own left out
    root_exitcode: int  # what the summary's "Root Cause" says
    root_traceback: str


def run_torchrun(flags: list[str], cwd: Path, tmp: Path, nproc: int = 2, timeout: float = 180) -> TorchrunFailure:
    """`torchrun --nproc-per-node nproc pretrain_gpt.py flags` in cwd (torchrun's log dir under tmp), parsed."""
    tmp.mkdir(exist_ok=True)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), str(ENTRY), *flags]
    run = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    lines = run.stdout.splitlines()
    assert _TORCHRUN_TRACEBACK in lines, f"torchrun did not report a failure (exit {run.returncode}):\n{run.stdout[-3000:]}"
    start = len(lines) - 1 - lines[::-1].index(_TORCHRUN_TRACEBACK)  # torchrun's own traceback: the last one
    child = [line for line in lines[:start] if line.strip() and not _AGENT_LOG.match(line)]
    root = lines[lines.index("Root Cause (first observed failure):") :]
    field = {
        line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in root if line.startswith("  ") and ":" in line
    }
    return TorchrunFailure(run.returncode, run.stdout, child, int(field["exitcode"].split()[0]), field["traceback"])


def assert_torchrun_refused(flags: list[str], cwd: Path, tmp: Path, expected_code: int, needle: str) -> TorchrunFailure:
    """Under a 2-rank torchrun: the workers' output ends with one `tricorn: error:` line (printed once), the
    summary's root cause is that line with the worker's exit code, and nothing under cwd changed."""
    before = snapshot(cwd)
    failure = run_torchrun(flags, cwd, tmp)
    tail = failure.output[-3000:]
    assert failure.returncode == 1, tail  # torchrun's own exit code for any failed worker
    assert failure.child_lines and failure.child_lines[-1].startswith("tricorn: error: "), tail
    line = failure.child_lines[-1]
    assert needle in line, f"{needle!r} not in {line!r}"
    assert "Traceback" not in "\n".join(failure.child_lines) and failure.child_lines.count(line) == 1, tail
    assert (failure.root_exitcode, failure.root_traceback) == (expected_code, line), tail
    assert failure.output.rstrip().splitlines()[-1] == "=" * 60, tail  # torchrun's summary closes the output
    assert snapshot(cwd) == before, f"a refused run wrote {sorted(snapshot(cwd) - before)}"
    return failure
