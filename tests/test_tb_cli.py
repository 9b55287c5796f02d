"""`tricorn tb DIR` answers HTTP 200 on the URL it prints, on 127.0.0.1, and stops TensorBoard when terminated."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tricorn.training.tb import answers, main

ROOT = Path(__file__).resolve().parent.parent


def test_tb_serves_the_printed_url(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path / "run")) as w:
        w.add_scalar("lm loss", 1.0, 1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tricorn.cli", "tb", str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # printed only once TensorBoard answers
        m = re.search(r"(http://127\.0\.0\.1:(\d+)/)", line)
        assert m, f"no URL in {line!r}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
        url = m.group(1)
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
            assert b"TensorBoard" in response.read()
        assert "ssh -N -L" in proc.stdout.readline()
        proc.terminate()
        assert proc.wait(timeout=20) == 0
        deadline = time.monotonic() + 10
        while answers(url, timeout=0.5) and time.monotonic() < deadline:  # the child TensorBoard is gone too
            time.sleep(0.2)
        assert not answers(url, timeout=0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_tb_refuses_a_missing_directory(tmp_path: Path, capsys) -> None:
    assert main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a directory" in err[0]
