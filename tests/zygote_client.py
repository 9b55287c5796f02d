"""The harness's side of the fork server (tests/zygote.py): start it once, hand it a launch, collect the ranks."""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

SERVER = Path(__file__).with_name("zygote.py")
_server: Optional[subprocess.Popen] = None
_socket_path: Optional[str] = None
_broken = False


def usable(cmd: list[str], env: dict) -> bool:
    """A Python script run by this interpreter on this import path (what the server has imported applies), and
    the server is up (started on first use; if it cannot start, real processes for the rest of the session)."""
    if _broken or os.environ.get("TRICORN_TEST_NO_FORK") == "1":
        return False
    if len(cmd) < 2 or cmd[0] != sys.executable or not cmd[1].endswith(".py"):
        return False
    if env.get("PYTHONPATH") != os.environ.get("PYTHONPATH"):
        return False
    return _server is not None or _start()


def _start() -> bool:
    global _server, _socket_path, _broken
    home = tempfile.mkdtemp(prefix="tricorn-zygote-")
    _socket_path = os.path.join(home, "sock")
    log = open(os.path.join(home, "log"), "w")
    _server = subprocess.Popen(
        [sys.executable, str(SERVER), _socket_path],
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # OpenMP reads it when torch loads: before any fork
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    atexit.register(_stop, home)
    if _server.stdout.readline().strip() != "ready":  # it could not start: real processes for this session
        print(f"tests/zygote.py did not start (see {home}/log): launching real processes", file=sys.stderr)
        _broken = True
    return not _broken


def _stop(home: str) -> None:
    if _server is not None and _server.poll() is None:
        _server.kill()
        _server.wait()
    shutil.rmtree(home, ignore_errors=True)


def run(cmd: list[str], envs: list[dict], cwd: Path, timeout: float) -> list[tuple[int, str, str]]:
    """Fork one rank per environment; (exit code, stdout, stderr) per rank, as Popen would give them.
    Past `timeout` the ranks are killed and subprocess.TimeoutExpired raised, as Popen.communicate does."""
    outdir = tempfile.mkdtemp(prefix="tricorn-ranks-")
    files = [(os.path.join(outdir, f"{i}.out"), os.path.join(outdir, f"{i}.err")) for i in range(len(envs))]
    ranks = [{"argv": cmd[1:], "env": e, "cwd": str(cwd), "stdout": o, "stderr": r} for e, (o, r) in zip(envs, files)]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(_socket_path)
        f = sock.makefile("rw")
        f.write(json.dumps({"ranks": ranks}) + "\n")
        f.flush()
        pids = json.loads(f.readline())["pids"]
        codes = None
        try:
            if not select.select([sock], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(cmd, timeout)
            codes = json.loads(f.readline())["codes"]
        finally:
            if codes is None:  # timed out or interrupted: kill the ranks so the server can reap them and go on
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                f.readline()
    outs = []
    for o, r in files:
        outs.append(tuple(Path(p).read_text(errors="replace") for p in (o, r)))
    shutil.rmtree(outdir, ignore_errors=True)
    return [(code, out, err) for code, (out, err) in zip(codes, outs)]
