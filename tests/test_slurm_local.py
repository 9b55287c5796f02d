"""A real single-node SLURM on this machine: sbatch jobs, and the generated script's signal -> save -> requeue path.

The module fixture runs scripts/slurm_local/start.sh (installing Debian's slurm-wlm and munge with apt-get when
they are missing) and stops the daemons at the end. The tests are skipped - loudly, with the reason - only where
the machine cannot run slurmd at all (not Linux, not root, or the packages can be neither found nor installed).

``LocalSlurm`` is the handle the tests use: submit an sbatch script with an environment, wait for states,
read ``scontrol show job`` fields, signal the batch shell, requeue. The main test sbatches the CPU variant of
a generated script running the real pretrain_gpt.py on 2 tasks, signals it with ``scancel --batch
--signal=USR1`` (what ``--signal=B:USR1@180`` does before the time limit) and checks the whole cycle: trained
and checkpointed, saved on the signal, requeued, resumed from that checkpoint; then rank 1 is SIGKILLed
(tricorn/training/faults.py), the script requeues on the failure with its cause, and the third run resumes from
the last checkpoint and finishes. About 40 s before the kill cycle was added; 107 s with it on a loaded
machine (load average 8 on 2 cores).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from tricorn.planning import sbatch

REPO = Path(__file__).resolve().parent.parent
START, STOP = REPO / "scripts/slurm_local/start.sh", REPO / "scripts/slurm_local/stop.sh"
# The first test also pays for apt-get installing slurm-wlm on a fresh machine.
pytestmark = pytest.mark.timeout(900)
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED")


@dataclass
class LocalSlurm:
    dir: Path
    env: dict

    def run(self, *cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60, **kw)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}\n{self.logs()}")
        return proc

    def submit(self, script: Path, env: Optional[dict] = None, cwd: Optional[Path] = None) -> int:
        out = subprocess.run(
            ["sbatch", "--parsable", str(script)],
            env={**self.env, **(env or {})},
            cwd=cwd or script.parent,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, f"sbatch failed: {out.stderr}"
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job -o`` as a dict (JobState, Restarts, ExitCode, ...)."""
        text = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(tok.split("=", 1) for tok in text.split() if "=" in tok)

    def wait(self, job_id: int, states: tuple[str, ...] = FINAL, timeout: float = 90.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {info.get('JobState')} after {timeout}s\n{self.logs()}")
            time.sleep(0.3)

    def signal_batch(self, job_id: int, signal: str = "USR1") -> None:
        """Deliver ``signal`` to the job's batch shell (what --signal=B:USR1@N does before the time limit)."""
        self.run("scancel", "--batch", f"--signal={signal}", str(job_id))

    def requeue(self, job_id: int) -> None:
        self.run("scontrol", "requeue", str(job_id))

    def logs(self) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.dir / "log" / name
            if path.exists():
                out.append(f"--- {name} (tail)\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(out)


def wait_for_text(path: Path, text: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in (content := path.read_text(errors="replace")):
            return content
        time.sleep(0.2)
    raise AssertionError(
        f"'{text}' did not appear in {path} within {timeout}s:\n{path.read_text() if path.exists() else '(none)'}"
    )


def _cannot_run_slurmd() -> Optional[str]:
    if not sys.platform.startswith("linux"):
        return f"slurmd needs Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "starting slurmd and munged needs root"
    have = all(shutil.which(t, path=os.environ.get("PATH", "") + ":/usr/sbin") for t in ("slurmd", "slurmctld", "munged"))
    if not have and shutil.which("apt-get") is None:
        return "slurm-wlm is not installed and there is no apt-get to install it"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loud(request, message: str) -> None:
    reporter = request.config.pluginmanager.getplugin("terminalreporter")
    banner = "!" * 78
    if reporter is not None:
        reporter.write_line(f"\n{banner}\nLOCAL SLURM TESTS SKIPPED: {message}\n{banner}", red=True, bold=True)


@pytest.fixture(scope="module")
def slurm(request) -> Iterator[LocalSlurm]:
    reason = _cannot_run_slurmd()
    if reason:
        _loud(request, reason)
        pytest.skip(f"this machine cannot run slurmd: {reason}")
    cluster_dir = Path(f"/run/tricorn-slurm-test-{os.getpid()}")
    env = {
        **os.environ,
        "PATH": os.environ.get("PATH", "") + ":/usr/sbin",
        "TRICORN_SLURMCTLD_PORT": str(_free_port()),
        "TRICORN_SLURMD_PORT": str(_free_port()),
    }
    proc = subprocess.run(["bash", str(START), str(cluster_dir)], env=env, capture_output=True, text=True, timeout=900)
    try:
        if proc.returncode != 0:
            if shutil.which("slurmd", path=env["PATH"]) is None:  # apt-get could not install it here
                _loud(request, f"installing slurm-wlm failed: {proc.stderr.strip().splitlines()[-1:]}")
                pytest.skip("this machine cannot install slurmd: " + proc.stderr.strip()[-500:])
            pytest.fail(f"scripts/slurm_local/start.sh failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        conf = proc.stdout.strip().splitlines()[-1]
        assert conf.startswith("SLURM_CONF="), proc.stdout
        env["SLURM_CONF"] = conf.split("=", 1)[1]
        yield LocalSlurm(cluster_dir, env)
    finally:
        subprocess.run(["bash", str(STOP), str(cluster_dir)], env=env, capture_output=True, timeout=120)
        shutil.rmtree(cluster_dir, ignore_errors=True)


def test_two_task_job_runs(slurm: LocalSlurm, tmp_path: Path) -> None:
    script = tmp_path / "hello.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --output=%x-%j.out\n"
        f'srun {sys.executable} -c \'import os; print("hello from rank", os.environ["SLURM_PROCID"], '
        '"of", os.environ["SLURM_NTASKS"], "local", os.environ["SLURM_LOCALID"])\'\n'
    )
    job = slurm.submit(script)
    info = slurm.wait(job, timeout=60)
    out = (tmp_path / f"hello.sbatch-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out
    assert "hello from rank 0 of 2 local 0" in out and "hello from rank 1 of 2 local 1" in out


# The CPU variant of a generated script trains the tiny preset (shrunk to seq 64, one sample per rank) on mock
# data. TRAIN_ITERS is far more than run 1 can reach before the test signals it (a checkpoint at SAVE_INTERVAL,
# then USR1 within ~1 s, at ~40 ms an iteration), and few enough that run 2 finishes them in seconds.
TRAIN_ITERS, SAVE_INTERVAL = 150, 4
TRAIN_ARGS = (
    "--model-preset tiny --seq-length 64 --micro-batch-size 1 --global-batch-size 2 --lr 1e-3 --log-interval 1 "
    f"--train-iters {TRAIN_ITERS} --save-interval {SAVE_INTERVAL} --keep-last-n-checkpoints 2"
).split()


def cpu_job(train_args: list[str]) -> sbatch.SbatchJob:
    """The CPU variant of a generated script: 1 node, 2 tasks, no GPUs, --device cpu."""
    return sbatch.SbatchJob(
        job_name="tricorn-cpu",
        nodes=1,
        tasks_per_node=2,
        gpus_per_node=0,
        exclusive=False,
        device="cpu",
        time="00:10:00",
        train_args=train_args,
    )


def _iterations_logged(text: str) -> list[int]:
    """Iteration numbers of the trainer's console lines (` iteration   12/  150 | ...`), in order."""
    return [int(m) for m in re.findall(r"^ iteration +(\d+)/", text, flags=re.M)]


# Run 2 (the first requeue) loses rank 1 to a SIGKILL at this iteration (tricorn/training/faults.py): the script
# requeues on the failure, and run 3 resumes from the last checkpoint before it (a multiple of SAVE_INTERVAL).
KILLED_AT = TRAIN_ITERS - 10


def test_generated_script_trains_saves_requeues_and_resumes_on_usr1(slurm: LocalSlurm, tmp_path: Path) -> None:
    """sbatch the real trainer; USR1 to the batch shell -> the tasks save and exit 0 -> requeue -> resume; then a
    SIGKILLed rank -> requeue with its cause logged -> resume from the last checkpoint -> finish."""
    script = tmp_path / "cpu.sbatch"
    script.write_text(sbatch.render(cpu_job(TRAIN_ARGS)))
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    env = {
        "TRICORN_DIR": str(REPO),
        "PYTHON": sys.executable,
        "RUN_DIR": str(run_dir),
        "DATA_ARGS": "--mock-data --vocab-size 512",
        "TRICORN_TEST_FAULT": f"1:{KILLED_AT}:kill:1",  # rank 1, in run 2 only
    }
    t0 = time.monotonic()
    job = slurm.submit(script, env=env)
    out_file = tmp_path / f"tricorn-cpu-{job}.out"
    phases: dict[str, float] = {}

    # Run 1 trains and writes its first checkpoint; then SLURM delivers USR1 to the batch shell.
    wait_for_text(out_file, f"saved checkpoint {ckpt}/iter_{SAVE_INTERVAL:07d}", timeout=90)
    phases["first checkpoint"] = time.monotonic() - t0
    assert int((ckpt / "latest_checkpointed_iteration.txt").read_text()) >= SAVE_INTERVAL  # published, not just begun
    slurm.signal_batch(job, "USR1")
    phases["signalled"] = time.monotonic() - t0
    wait_for_text(out_file, "requeueing job", timeout=60)
    phases["saved, requeued"] = time.monotonic() - t0
    wait_for_text(out_file, f"job {job} requeue 1/3", timeout=120)
    phases["rank killed, requeued"] = time.monotonic() - t0
    info = slurm.wait(job, states=("COMPLETED", "FAILED", "CANCELLED"), timeout=120)
    phases["completed"] = time.monotonic() - t0
    text = out_file.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "2", text
    print("local SLURM job " + ", ".join(f"{k} at {v:.1f}s" for k, v in phases.items()))

    run1, rest = text.split(f"tricorn: job {job} restart 1 on", 1)
    run2, run3 = rest.split(f"tricorn: job {job} restart 2 on", 1)
    assert f"tricorn: job {job} restart 0 on" in run1 and "tricorn: USR1 received" in run1, text
    # Run 1: trained, saved on the signal after iteration N < TRAIN_ITERS, exited 0, and the script requeued it.
    stop = re.search(r"exiting after iteration (\d+): received SIGUSR1 \(checkpoint saved\)", run1)
    assert stop, run1
    saved = int(stop.group(1))
    assert SAVE_INTERVAL <= saved < TRAIN_ITERS and _iterations_logged(run1) == list(range(1, saved + 1)), run1
    assert f"saved checkpoint {ckpt}/iter_{saved:07d}" in run1 and "trainer exited with status 0" in run1
    # Run 2 (SLURM_RESTART_COUNT=1, appended to the same file): loaded iteration N and continued until rank 1 was
    # SIGKILLed in iteration KILLED_AT; the script requeued the job once, naming the cause.
    assert f"checkpoint: loading {ckpt}/iter_{saved:07d} (latest_checkpointed_iteration.txt)" in run2, run2
    assert f"checkpoint: resuming after iteration {saved} ({2 * saved} samples consumed" in run2, run2
    assert _iterations_logged(run2) == list(range(saved + 1, KILLED_AT)), run2
    assert "tricorn: USR1 received" not in run2 and "checkpoint saved; requeueing" not in run2
    requeue = re.search(rf"tricorn: job {job} requeue 1/3 at \S+: (.*); resuming from the last checkpoint", run2)
    # srun stops the other task once one dies, so the watchdog may not get to name it: either cause is right.
    assert requeue and ("killed by a signal" in requeue.group(1) or "rank 1" in requeue.group(1)), run2
    assert "task 1: Killed" in run2, run2
    assert (run_dir / "requeues.log").read_text().count(f"job {job} requeue") == 1
    # Run 3: resumed from the last checkpoint before the kill and finished.
    last = (KILLED_AT - 1) // SAVE_INTERVAL * SAVE_INTERVAL
    assert f"checkpoint: loading {ckpt}/iter_{last:07d} (latest_checkpointed_iteration.txt)" in run3, run3
    assert _iterations_logged(run3) == list(range(last + 1, TRAIN_ITERS + 1)), run3
    assert "requeue" not in run3
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(TRAIN_ITERS)
    assert (ckpt / f"iter_{TRAIN_ITERS:07d}").is_dir() and (run_dir / "tensorboard" / str(job) / "memory_report.json").is_file()
