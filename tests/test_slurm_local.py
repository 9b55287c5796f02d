"""A real single-node SLURM on this machine: sbatch jobs, and the generated script's signal -> save -> requeue path.

The module fixture runs scripts/slurm_local/start.sh (installing Debian's slurm-wlm and munge with apt-get when
they are missing) and stops the daemons at the end. The tests are skipped - loudly, with the reason - only where
the machine cannot run slurmd at all (not Linux, not root, or the packages can be neither found nor installed).

``LocalSlurm`` is the handle later tests use: submit an sbatch script with an environment, wait for states,
read ``scontrol show job`` fields, signal the batch shell, requeue.
"""

from __future__ import annotations

import os
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


# A stand-in for pretrain_gpt.py with the contract the generated script relies on: it resumes from --load,
# and on SIGUSR1 (--exit-signal-handler --exit-signal SIGUSR1) it saves to --save and exits 0.
FAKE_TRAINER = r"""
import os, signal, sys, time
args = sys.argv[1:]
save, load = args[args.index("--save") + 1], args[args.index("--load") + 1]
iters = int(args[args.index("--train-iters") + 1])
assert "--exit-signal-handler" in args and args[args.index("--exit-signal") + 1] == "SIGUSR1"
rank = int(os.environ["SLURM_PROCID"])
latest = os.path.join(load, "latest")
it = int(open(latest).read()) if os.path.exists(latest) else 0
print(f"rank {rank} starts at iteration {it}, restart {os.environ.get('SLURM_RESTART_COUNT', '0')}", flush=True)
stop = []
signal.signal(signal.SIGUSR1, lambda *a: stop.append(True))

def checkpoint():
    if rank == 0:
        with open(os.path.join(save, "latest.tmp"), "w") as fh:
            fh.write(str(it))
        os.replace(os.path.join(save, "latest.tmp"), os.path.join(save, "latest"))

while it < iters:
    time.sleep(0.1)
    it += 1
    if stop:
        checkpoint()
        print(f"rank {rank} saved iteration {it} on SIGUSR1", flush=True)
        sys.exit(0)
checkpoint()
print(f"rank {rank} finished at iteration {it}", flush=True)
"""


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


def test_generated_script_saves_requeues_and_resumes_on_usr1(slurm: LocalSlurm, tmp_path: Path) -> None:
    fake_dir = tmp_path / "checkout"
    fake_dir.mkdir()
    (fake_dir / "pretrain_gpt.py").write_text(FAKE_TRAINER)
    script = tmp_path / "cpu.sbatch"
    script.write_text(sbatch.render(cpu_job(["--model-preset", "tiny", "--train-iters", "60"])))
    env = {"TRICORN_DIR": str(fake_dir), "PYTHON": sys.executable, "RUN_DIR": str(tmp_path / "run"), "DATA_ARGS": "--mock-data"}
    job = slurm.submit(script, env=env)
    out_file = tmp_path / f"tricorn-cpu-{job}.out"
    wait_for_text(out_file, "rank 1 starts at iteration 0", timeout=60)
    time.sleep(1.0)
    slurm.signal_batch(job, "USR1")
    wait_for_text(out_file, "requeueing job", timeout=30)
    info = slurm.wait(job, states=("COMPLETED", "FAILED", "CANCELLED"), timeout=120)
    text = out_file.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", text
    saved = int(text.split("rank 0 saved iteration ")[1].split()[0])
    assert 0 < saved < 60
    assert f"rank 0 starts at iteration {saved}, restart 1" in text  # resumed from the same checkpoint dir
    assert "rank 0 finished at iteration 60" in text
    assert text.count("restart 0 on") == 1 and text.count("restart 1 on") == 1  # --open-mode=append kept both runs
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "60"
    assert (tmp_path / "run" / "tensorboard" / str(job)).is_dir()
