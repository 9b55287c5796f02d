"""Launch hygiene: an srun task takes its identity from SLURM alone, and a process imports DCP only to use it.

- launch_errors.srun_task / inherited_identity and state.launch_env: a RANK / WORLD_SIZE the submitting shell
  exported (sbatch hands its environment on) loses to SLURM_PROCID / SLURM_NTASKS inside an srun step, with
  one line; torchrun under srun keeps its own.
- The generated sbatch script, run by bash with stand-ins for srun and scontrol: the inherited RANK,
  WORLD_SIZE and MASTER_PORT do not reach the tasks, and the script says so in one line.
- Importing the trainer and the checkpoint modules does not import torch.distributed.checkpoint (a fresh
  interpreter: the pytest process has it already).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tricorn.launch_errors import inherited_identity, launch_rank
from tricorn.parallel import state
from tricorn.planning import sbatch

SLURM = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3", "SLURM_JOB_ID": "77"}


def test_an_srun_task_ignores_an_inherited_rank(monkeypatch) -> None:
    env = {**SLURM, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", *SLURM):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert launch_rank() == 3 and state.launch_env()["RANK"] == "3" and state.launch_env()["WORLD_SIZE"] == "8"
    line = inherited_identity()
    assert line == (
        "ignoring RANK=0 WORLD_SIZE=1 from the environment (exported by the shell that submitted the job): each srun task "
        "takes its rank from SLURM (this is task 3 of 8); unset them before sbatch"
    )
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # torchrun started by srun: its RANK is the right one
    assert launch_rank() == 0 and inherited_identity() is None
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert inherited_identity() is None  # agreeing values are no contradiction


def test_the_sbatch_script_drops_the_submitting_shells_launch_variables(tmp_path: Path) -> None:
    job = sbatch.SbatchJob(
        job_name="hygiene", nodes=1, tasks_per_node=2, gpus_per_node=0, exclusive=False, device="cpu", train_args=["--x"]
    )
    script = tmp_path / "job.sbatch"
    script.write_text(sbatch.render(job))
    bin_dir, seen = tmp_path / "bin", tmp_path / "srun-env.txt"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        f'#!/bin/bash\necho "RANK=${{RANK-unset}} WORLD_SIZE=${{WORLD_SIZE-unset}} MASTER_PORT=$MASTER_PORT" > {seen}\n'
    )
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node1\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "SLURM_JOB_ID": "123",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_JOB_NAME": "hygiene",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "DATA_ARGS": "--mock-data --vocab-size 100",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_PORT": "29500",
    }
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    warnings = [line for line in out.stdout.splitlines() if line.startswith("tricorn: warning: ")]
    assert warnings == [
        "tricorn: warning: ignoring RANK=0 WORLD_SIZE=1 MASTER_PORT=29500 from the submitting shell: each task takes its "
        "rank from SLURM and the rendezvous from the job (TRICORN_MASTER_PORT sets the port)"
    ], out.stdout
    assert seen.read_text().split() == ["RANK=unset", "WORLD_SIZE=unset", "MASTER_PORT=20123"]  # 20000 + job id


def test_the_trainer_imports_dcp_only_to_use_it() -> None:
    code = (
        "import sys\n"
        "import tricorn.training.main, tricorn.checkpoint.checkpointer, tricorn.validation\n"
        "from tricorn.checkpoint import io\n"
        "assert 'torch.distributed.checkpoint' not in sys.modules, 'imported at start-up'\n"
        "io.Writer\n"
        "assert 'torch.distributed.checkpoint' in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
