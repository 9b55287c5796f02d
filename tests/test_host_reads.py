"""No host synchronisation in a training iteration that does not log (issue 15, item 1).

A host read (.item(), float(), bool(), .tolist(), .numpy(), a blocking device-to-host copy) makes the
CPU wait for the GPU. tests/workers/host_reads.py counts them per iteration with
tricorn.host_reads.HostReadCounter inside Trainer.train(): 0 in iterations without a log line, at
most 3 in those with one, on each layout (TP, PP, DP with the distributed optimizer, ZeRO-3, fp16, and
one process with --torch-compile).
"""

from pathlib import Path

import pytest
import torch
from harness import run_script

from tricorn.host_reads import HostReadCounter

WORKER = Path(__file__).parent / "workers" / "host_reads.py"


def test_counter_catches_every_kind_of_read():
    t = torch.randn(4)
    with HostReadCounter() as reads:
        t.sum().item()
        float(t[0])
        bool(t[1] > 0)
        int(t[2])
        t.tolist()
        t.numpy()
    assert reads.count == 6, reads.where


def test_counter_ignores_host_scalars():
    step = torch.tensor(3.0)
    with HostReadCounter(host_tensors=[step]) as reads:
        step.item()
    assert reads.count == 0


@pytest.mark.parametrize(
    "nproc, flags",
    [
        (1, []),
        (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        (2, ["--pipeline-model-parallel-size", "2"]),
        (2, ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]),
        (2, ["--use-distributed-optimizer", "--zero-stage", "3"]),
        (2, ["--fp16", "--initial-loss-scale", "1024"]),
        (1, ["--torch-compile"]),
    ],
    ids=["single", "tp2-sp", "pp2", "dp2-zero1-overlap", "dp2-zero3", "dp2-fp16", "single-compiled"],
)
def test_no_host_reads_outside_logging_iterations(nproc, flags):
    assert run_script(WORKER, nproc, flags, timeout=300).strip().endswith("ok")


@pytest.mark.parametrize("interval, detected", [(None, 5), ("1", 2)])
def test_nan_stops_at_the_next_read(tmp_path, interval, detected):
    """The NaN record stays on the device: read at log lines (--log-interval 5) and every --nan-check-interval."""
    from harness import BASE_FLAGS, run_layout, with_flag

    flags = with_flag(with_flag(BASE_FLAGS, "--train-iters", "8"), "--log-interval", "5")
    flags += ["--nan-check-interval", interval] if interval else []
    env = {"TRICORN_TEST_INJECT_INF_AT_ITER": "2"}  # an inf gradient in iteration 2 (optimizer.py's test hook)
    run = run_layout(flags, 1, tmp_path, check=False, env=env)
    assert run.returncode == 1 and run.records == [], run.stderr[-2000:]
    line = "tricorn: error: iteration 2: loss "
    errors = [e for e in run.stderr.splitlines() if e.startswith(line)]
    assert len(errors) == 1 and f"(detected after iteration {detected};" in errors[0], run.stderr[-2000:]
