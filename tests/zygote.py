"""A fork server for the test harness: import torch and tricorn once, then fork every rank from that state.

Importing torch and the trainer costs ~1.7 CPU-seconds per process, about 40% of a tiny two-rank run, and the
suite launches ~1,000 ranks on a 2-core machine. The harness (tests/harness.py) asks this server to start the
ranks of a launch instead: each is a fork of a process that has imported everything and run nothing (no
thread, no OpenMP pool, no process group), given its own environment, working directory, argv and output
files, then running the script exactly as ``python script.py args`` would, and leaving through the interpreter's normal exit.

What a fork does not reproduce, and where the suite keeps real processes: interpreter start-up and shutdown
(tests/test_clean_exit.py launches real processes: it tests what happens at exit), and a different
interpreter or PYTHONPATH (the harness falls back to a real process). TRICORN_TEST_NO_FORK=1 turns the server
off for a whole run.

Protocol (one request at a time over a Unix socket, one JSON line each way): the request lists the ranks'
argv/env/cwd/output paths; the server answers with the pids, then, once all have exited, their exit codes
(negative: killed by that signal, like ``Popen.returncode``).
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import socket
import sys
import threading
import traceback

import torch  # noqa: F401 - the point: imported once, before any fork
import torch.distributed  # noqa: F401

import tricorn.training.main  # noqa: F401 - the trainer and everything it imports


def _warm_imports() -> None:
    """Import here, once, what a run imports lazily: each fork would otherwise import it again. A tiny run
    imports ~1,100 modules after the trainer's own (measured: sys.modules before and after), 1.4 of a rank's
    1.8 CPU-seconds: dynamo and sympy (torch.optim's constructor imports them), DCP (checkpoints),
    TensorBoard; inductor for --torch-compile. Importing starts no thread and no pool."""
    import importlib
    import pkgutil

    import tricorn

    for mod in pkgutil.walk_packages(tricorn.__path__, "tricorn."):
        importlib.import_module(mod.name)
    for name in (
        "torch._dynamo",
        "torch._refs",
        "torch._inductor.compile_fx",  # --torch-compile runs
        "torch.distributed.checkpoint",
        "torch.utils.tensorboard",
    ):
        importlib.import_module(name)


_warm_imports()
# Move everything imported so far into the collector's permanent generation: a fork's gc.collect() (the
# trainer runs one at teardown, tricorn/parallel/state.py) then skips torch's ~1M objects instead of
# walking them, and touching their headers no longer copies the server's pages into every rank.
# Measured on a forked tiny run: 0.59 -> 0.28 CPU-seconds.
gc.freeze()


def _child(req: dict) -> int:
    """Run `python argv...` in the request's environment; its exit code. The caller then leaves the
    interpreter normally (atexit, finalisation), as the script's own process would."""
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    # Line-buffered, as PYTHONUNBUFFERED asks: a rank killed at a timeout still leaves what it printed.
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    script = req["argv"][0]
    sys.argv = list(req["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` sets it
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)  # sys.exit("message"): printed, exit 1, as the interpreter does
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _serve_one(conn: socket.socket) -> None:
    with conn, conn.makefile("rw") as f:
        req = json.loads(f.readline())
        pids = []
        for rank in req["ranks"]:
            pid = os.fork()
            if pid == 0:  # the rank: leave through the interpreter's normal exit, whatever happens
                code = 1
                try:
                    code = _child(rank)
                finally:
                    raise SystemExit(code)
            pids.append(pid)
        f.write(json.dumps({"pids": pids}) + "\n")
        f.flush()
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        f.write(json.dumps({"codes": codes}) + "\n")
        f.flush()


def main() -> None:
    path = sys.argv[1]
    assert threading.active_count() == 1, "the fork server must hold no thread when it forks"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        try:
            _serve_one(conn)
        except (OSError, ValueError):  # the harness gave up on a launch (timeout, interrupted test): next one
            traceback.print_exc()


if __name__ == "__main__":
    main()
