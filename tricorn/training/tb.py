"""`tricorn tb DIR`: TensorBoard on 127.0.0.1 at a free port, its URL printed, running until Ctrl-C.

TensorBoard runs as a child process (``python -m tensorboard.main``) bound to the loopback
interface only, so nothing is exposed on a shared login node; reach it through an SSH tunnel
(the printed hint). The command waits until TensorBoard answers HTTP before printing the URL,
retries on another port if the one picked was taken in the meantime, and stops TensorBoard
when it is interrupted (Ctrl-C) or terminated. Its own output goes to a log file whose tail
is shown if it fails to start. No collectives, no device work.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Optional

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def answers(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: str, lines: int = 15) -> str:
    with open(path, errors="replace") as fh:
        return "".join(fh.readlines()[-lines:])


def start(logdir: str, port: Optional[int], wait_s: float, log_path: str) -> tuple[subprocess.Popen, str]:
    """Start TensorBoard and return (process, URL) once it answers; raise RuntimeError with its log tail otherwise."""
    for _attempt in range(1 if port else 3):
        p = port or free_port()
        url = f"http://{HOST}:{p}/"
        cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", logdir, "--host", HOST, "--port", str(p)]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + wait_s
        while proc.poll() is None and time.monotonic() < deadline:
            if answers(url):
                return proc, url
            time.sleep(0.2)
        if proc.poll() is None:  # alive but silent: do not leave it behind
            stop(proc)
            raise RuntimeError(f"TensorBoard did not answer on {url} within {wait_s:.0f} s:\n{_tail(log_path)}")
        if "could not bind" not in _tail(log_path).lower():
            break
    raise RuntimeError(f"TensorBoard exited (code {proc.returncode}) before answering:\n{_tail(log_path)}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _raise_interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="tricorn tb", description="Start TensorBoard on 127.0.0.1 and print its URL.")
    ap.add_argument("logdir", help="a --tensorboard-dir (or a folder of them: each run shows as its own curve)")
    ap.add_argument("--port", type=int, default=None, help="port to use (default: a free one)")
    ap.add_argument("--wait", type=float, default=120.0, help="seconds to wait for TensorBoard to answer")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.logdir):
        print(f"tricorn tb: error: '{args.logdir}' is not a directory; pass the run's --tensorboard-dir", file=sys.stderr)
        return 2
    try:
        import tensorboard  # noqa: F401  (only to fail early with a clear message)
    except ImportError:
        print("tricorn tb: error: the tensorboard package is not installed; pip install tensorboard", file=sys.stderr)
        return 2
    log_path = os.path.join(tempfile.gettempdir(), f"tricorn-tb-{os.getpid()}.log")
    signal.signal(signal.SIGTERM, _raise_interrupt)  # `kill` stops the child too, not only Ctrl-C
    proc = None
    try:
        proc, url = start(os.path.abspath(args.logdir), args.port, args.wait, log_path)
        port = url.rsplit(":", 1)[1].strip("/")
        print(f"TensorBoard for {args.logdir}: {url}", flush=True)
        print(
            f"From your machine: ssh -N -L {port}:{HOST}:{port} {os.environ.get('USER', 'you')}@{socket.gethostname()}  "
            f"then open http://localhost:{port}/  (Ctrl-C here stops TensorBoard)",
            flush=True,
        )
        proc.wait()
        print(f"tricorn tb: TensorBoard exited (code {proc.returncode}); its log: {log_path}", file=sys.stderr)
        return 1
    except RuntimeError as e:
        print(f"tricorn tb: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        if proc is not None:
            stop(proc)


if __name__ == "__main__":
    sys.exit(main())
