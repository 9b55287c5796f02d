"""Shared by the data-parallel / distributed-optimizer tests: flags, and one cached reference per session.

The single-process reference runs write memory_report.json into a session-wide
TensorBoard dir; every test passes the same reference flags, so the harness
computes each reference once per session.
"""

from pathlib import Path

from harness import BASE_FLAGS, with_flag

MBS1 = with_flag(BASE_FLAGS, "--micro-batch-size", "1")  # DP=4 needs global batch 4 = 1 x 4
DIST = ["--use-distributed-optimizer"]


def reference_tb(tmp_path_factory, flags: list[str]) -> Path:
    return tmp_path_factory.getbasetemp() / "distopt_reference_tb" / ("mbs1" if flags == MBS1 else "base")


def reference_extra(tmp_path_factory, flags: list[str]) -> list[str]:
    return ["--tensorboard-dir", str(reference_tb(tmp_path_factory, flags))]
