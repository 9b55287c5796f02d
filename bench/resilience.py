"""Benchmark: what the hang watchdog costs and how fast a failure turns into a report and a resumed run.

Three figures (issue 32):

1. **Heartbeat overhead.** Two gloo ranks (DP 2) of one trainer run blocks of iterations with the heartbeat and
   watchdog on (tricorn/training/watchdog.py started) and off (not started), alternating on/off every block so a
   busy machine hits both alike; printed: the median over block pairs of median step on / off (goal <= 1.01),
   at the default hang timeout (10 min: a beat every 5 s) and at a 3 s one (a beat every 0.3 s, ~17x more store
   traffic); and the wall time one beat takes on rank 0 (publish, read all records, judge, publish the verdict)
   over the beat interval: the most of a step the heartbeat can take, whatever the load.
2. **SIGSTOP to the last exit.** Two real ranks with --hang-timeout-minutes 10 s; rank 1 SIGSTOPs itself at
   iteration 5 (TRICORN_TEST_FAULT): seconds from the stop to the survivor's exit (75).
3. **Requeue to resumed.** On the local SLURM (scripts/slurm_local/start.sh; root only), the CPU variant of a
   generated sbatch script, rank 1 SIGKILLed at iteration 10: seconds from the script's requeue line to the first
   iteration line of the requeued run (SLURM's requeue, the job's start, imports, loading the checkpoint).

    .venv/bin/python bench/resilience.py [--blocks 8] [--block-iters 10] [--skip-slurm]

Times are wall clock on a machine shared with other work: os.getloadavg() is printed with them. Not a test.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TINY = (
    "--device cpu --mock-data --num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 128 "
    "--max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 8 --lr 1e-4 --vocab-size 1000 "
    "--log-interval 10"
).split()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int, world: int, port: int, **extra: str) -> dict:
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ---------------------------------------------------------------- 1. overhead (run inside each rank)


def overhead_rank(blocks: int, block_iters: int, hang_minutes: float) -> None:
    from tricorn.config_args import config_from_args
    from tricorn.parallel.state import destroy_parallel, init_parallel
    from tricorn.training.logging import MetricsLogger
    from tricorn.training.main import build_trainer
    from tricorn.training.watchdog import Watchdog

    argv = TINY + ["--train-iters", str(10**6), "--hang-timeout-minutes", str(hang_minutes)]
    cfg = config_from_args(argv, world_size=int(os.environ["WORLD_SIZE"]))
    state = init_parallel(cfg)
    logger = MetricsLogger(cfg, state.rank, state.device)
    logger.console = lambda *a, **k: None  # no log lines in the timed loop
    trainer = build_trainer(cfg, state, logger, with_validation=False)
    for _ in range(3):  # warm-up: allocator, first-iteration costs
        trainer.run_iteration()
    times: dict[str, list[float]] = {"on": [], "off": []}
    pairs = []  # per pair of neighbouring blocks: median step on / off (the machine's load drifts slower than that)
    for b in range(blocks):
        medians = {}
        for mode in ("on", "off") if b % 2 == 0 else ("off", "on"):
            watchdog = None
            if mode == "on":
                watchdog = Watchdog(cfg, state).start()
                watchdog.iteration = lambda: trainer.iteration
            block = []
            for _ in range(block_iters):
                start = time.perf_counter()
                trainer.run_iteration()
                block.append(time.perf_counter() - start)
            if watchdog is not None:
                watchdog.stop()
            times[mode] += block
            medians[mode] = statistics.median(block)
        pairs.append(medians["on"] / medians["off"])
    trainer.optimizer.wait_all()
    beat = beat_cost(Watchdog(cfg, state), state.rank)  # both ranks: rank 0 judges, rank 1 reads the verdict
    if state.rank == 0:
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        print(f"RESULT {statistics.median(pairs):.4f} {on * 1e3:.2f} {off * 1e3:.2f} {beat * 1e6:.1f}", flush=True)
    trainer.optimizer.close()
    logger.close()
    destroy_parallel(clean_exit=True)


def beat_cost(watchdog, rank: int, beats: int = 200) -> float:
    """Seconds one beat holds its thread (and so, at worst, the GIL): publish, then judge (rank 0) or read."""
    start = time.perf_counter()
    for _ in range(beats):
        watchdog._publish()
        watchdog._judge_all() if rank == 0 else watchdog._read_verdict()
    return (time.perf_counter() - start) / beats


def overhead(blocks: int, block_iters: int, hang_minutes: float) -> str:
    port = _port()
    cmd = [sys.executable, __file__, "--overhead-rank", str(hang_minutes), "--blocks", str(blocks)]
    cmd += ["--block-iters", str(block_iters)]
    procs = [subprocess.Popen(cmd, env=_env(r, 2, port), stdout=subprocess.PIPE, text=True) for r in range(2)]
    out = [p.communicate(timeout=1800)[0] for p in procs]
    found = re.search(r"RESULT (\S+) (\S+) (\S+) (\S+)", out[0])
    if not found:
        raise SystemExit(f"overhead run failed: {out}")
    ratio, on, off, beat_us = found.groups()
    from tricorn.training.watchdog import beat_interval

    share = float(beat_us) * 1e-6 / beat_interval(hang_minutes * 60)
    return (
        f"hang timeout {hang_minutes:g} min: median step on / off {ratio} ({on} ms / {off} ms); one beat on rank 0 "
        f"{beat_us} us every {beat_interval(hang_minutes * 60):g} s = {share:.2e} of the wall time"
    )


# ---------------------------------------------------------------- 2. SIGSTOP -> last exit


def stop_to_exit(timeout_s: float = 10.0) -> str:
    port = _port()
    work = Path(tempfile.mkdtemp(prefix="tricorn-resilience-"))
    argv = [sys.executable, str(ROOT / "pretrain_gpt.py"), *TINY, "--train-iters", "50"]
    argv += ["--hang-timeout-minutes", f"{timeout_s / 60:.6f}"]
    env = {"TRICORN_TEST_FAULT": "1:5:stop"}
    errs = [open(work / f"{r}.err", "w+") for r in range(2)]
    procs = [
        subprocess.Popen(argv, env=_env(r, 2, port, **env), cwd=work, stdout=subprocess.DEVNULL, stderr=errs[r]) for r in range(2)
    ]
    code0 = procs[0].wait(timeout=600)
    ended = time.time()
    procs[1].wait(timeout=60)  # the fault's reaper kills the stopped rank once rank 0 is gone
    text1 = (work / "1.err").read_text()
    stopped = float(re.search(r"test fault: rank 1 stop at iteration 5 \(([\d.]+)\)", text1).group(1))
    shutil.rmtree(work, ignore_errors=True)
    return f"SIGSTOP of rank 1 -> rank 0's exit ({code0}), hang timeout {timeout_s:g} s: {ended - stopped:.1f} s"


# ---------------------------------------------------------------- 3. requeue -> first resumed iteration


def requeue_to_resumed() -> str:
    from tricorn.planning import sbatch

    if os.geteuid() != 0:
        return "requeue -> resumed: skipped (the local SLURM needs root)"
    cluster = Path(f"/run/tricorn-slurm-bench-{os.getpid()}")
    env = {**os.environ, "PATH": os.environ.get("PATH", "") + ":/usr/sbin"}
    env.update(TRICORN_SLURMCTLD_PORT=str(_port()), TRICORN_SLURMD_PORT=str(_port()))
    up = subprocess.run(
        ["bash", str(ROOT / "scripts/slurm_local/start.sh"), str(cluster)], env=env, capture_output=True, text=True
    )
    if up.returncode != 0:
        return f"requeue -> resumed: skipped (start.sh failed: {up.stderr.strip()[-200:]})"
    env["SLURM_CONF"] = up.stdout.strip().splitlines()[-1].split("=", 1)[1]
    work = Path(tempfile.mkdtemp(prefix="tricorn-resilience-slurm-"))
    try:
        args = "--model-preset tiny --seq-length 64 --micro-batch-size 1 --global-batch-size 2 --lr 1e-3 "
        args += "--log-interval 1 --train-iters 40 --save-interval 4"
        job = sbatch.SbatchJob("tricorn-cpu", 1, 2, args.split(), gpus_per_node=0, exclusive=False, device="cpu", time="00:10:00")
        script = work / "cpu.sbatch"
        script.write_text(sbatch.render(job))
        job_env = {**env, "TRICORN_DIR": str(ROOT), "PYTHON": sys.executable, "RUN_DIR": str(work / "run")}
        job_env.update(DATA_ARGS="--mock-data --vocab-size 512", TRICORN_TEST_FAULT="1:10:kill:0")
        sub = subprocess.run(["sbatch", "--parsable", str(script)], env=job_env, cwd=work, capture_output=True, text=True)
        job_id = int(sub.stdout.strip().split(";")[0])
        out = work / f"tricorn-cpu-{job_id}.out"
        requeued = resumed = None
        deadline = time.monotonic() + 300
        while resumed is None and time.monotonic() < deadline:
            text = out.read_text(errors="replace") if out.exists() else ""
            if requeued is None and f"job {job_id} requeue 1/" in text:
                requeued = time.monotonic()
            if requeued is not None and re.search(r"restart 1 on[\s\S]*?^ iteration +\d+/", text, re.M):
                resumed = time.monotonic()
            time.sleep(0.05)
        if resumed is None:
            return f"requeue -> resumed: no resumed iteration within 300 s; see {out}"
        return f"requeue (SIGKILLed rank 1) -> first resumed iteration on the local SLURM: {resumed - requeued:.1f} s"
    finally:
        subprocess.run(["bash", str(ROOT / "scripts/slurm_local/stop.sh"), str(cluster)], env=env, capture_output=True)
        shutil.rmtree(cluster, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--block-iters", type=int, default=10)
    ap.add_argument("--skip-slurm", action="store_true")
    ap.add_argument("--overhead-rank", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.overhead_rank is not None:
        overhead_rank(args.blocks, args.block_iters, args.overhead_rank)
        return
    print(f"load average {os.getloadavg()}", flush=True)
    for minutes in (10.0, 0.05):
        print(overhead(args.blocks, args.block_iters, minutes), flush=True)
    print(stop_to_exit(), flush=True)
    if not args.skip_slurm:
        print(requeue_to_resumed(), flush=True)
    print(f"load average {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
