"""--distributed-timeout-minutes reaches every process group (issue 26, item 4).

torch's new_group() and DeviceMesh default to the backend's timeout (10 min NCCL, 30 gloo), not the world
group's, so a user's 60 minutes used to become 10 on every TP/PP/DP/CP, embedding and expert group. The
worker lists every group of the process with its timeout; each must equal the flag (7 minutes here: neither
backend default)."""

import json
from pathlib import Path

import pytest
from harness import run_script

WORKER = Path(__file__).parent / "workers" / "group_timeouts.py"
MINUTES = 7


@pytest.mark.parametrize(
    "nproc, flags",
    [
        # TP spans the world: DeviceMesh reuses the world group for it, every other dimension is a 1-rank group.
        (2, "--tensor-model-parallel-size 2 --sequence-parallel"),
        # PP2 x DP2 with EP2: embedding groups, ep and expert-DP groups, flattened dp_cp and pp_tp of 2 ranks.
        (4, "--pipeline-model-parallel-size 2 --num-experts 4 --expert-model-parallel-size 2 --disable-bias-linear"),
    ],
    ids=["tp2", "pp2-dp2-ep2"],
)
def test_every_group_has_the_configured_timeout(nproc: int, flags: str) -> None:
    out = run_script(WORKER, nproc, flags.split() + ["--distributed-timeout-minutes", str(MINUTES)], timeout=180)
    minutes = json.loads(out.strip().splitlines()[-1])
    descriptions = {name.split("#")[0] for name in minutes}
    assert {"default_pg", "mesh_pp", "mesh_dp", "mesh_cp"} <= descriptions, minutes  # mesh_tp is the world at TP2
    assert len(minutes) >= (8 if nproc == 4 else 5), minutes
    wrong = {name: m for name, m in minutes.items() if m != MINUTES}
    assert not wrong, f"groups without --distributed-timeout-minutes {MINUTES}: {wrong}"
