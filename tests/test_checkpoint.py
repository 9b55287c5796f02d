"""Checkpoints end to end: bitwise resume, resharding to other layouts (optimizer state included),
async == sync content, kill -9 during a save, SIGTERM, the NaN guard and a damaged checkpoint.

One uninterrupted TP=2 x PP=2 run (saving asynchronously at 3 and 6) is the reference; every
other run resumes from its iteration-3 checkpoint on some layout and must reproduce its losses.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import BASE_FLAGS, ENTRY, FP32_RTOL, RunResult, free_port, run_layout, run_script, with_flag

from tricorn.checkpoint.checksums import file_checksum
from tricorn.checkpoint.io import CHECKSUM_FILE, LATEST_FILE, RNG_DIR, decode_rng, encode_rng, iter_name, read_meta, read_tensors

FLAGS = with_flag(with_flag(with_flag(BASE_FLAGS, "--num-layers", "4"), "--train-iters", "6"), "--micro-batch-size", "1")
TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
DISTOPT = ["--use-distributed-optimizer"]
# A resumed run in another layout reorders its fp32 sums from there on: the harness's FP32_RTOL argument
# (tests/harness.py). 1e-6 was at the worst-case reorder error itself (~log2(N) * u on a loss of ~6).
RESHARD_RTOL = FP32_RTOL
WORKERS = Path(__file__).parent / "workers"


def losses(run: RunResult) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in run.records if "loss" in r}


def latest(root: Path) -> int:
    return int((root / LATEST_FILE).read_text())


def assert_losses(run: RunResult, ref: dict[int, float], iterations: range, rtol: float = 0.0) -> None:
    got = losses(run)
    assert sorted(got) == list(iterations), f"resumed run logged iterations {sorted(got)}, expected {list(iterations)}"
    for it in iterations:
        # rtol 0 (the default): a resume in the same layout runs the same ops in the same order, bit for bit.
        assert abs(got[it] - ref[it]) <= rtol * abs(ref[it]), f"iteration {it}: lm loss {got[it]!r} vs uninterrupted {ref[it]!r}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """The uninterrupted TP=2 x PP=2 run, saving asynchronously at iterations 3 and 6."""
    work = tmp_path_factory.mktemp("reference")
    run = run_layout(FLAGS + TP2PP2 + ["--save", str(work / "ckpt"), "--save-interval", "3", "--async-save"], 4, work)
    assert latest(work / "ckpt") == 6 and (work / "ckpt" / iter_name(3)).is_dir()
    return work / "ckpt", losses(run)


def test_resume_tp2pp2_is_bitwise_and_async_save_equals_sync(reference, tmp_path):
    ckpt, ref = reference
    run = run_layout(FLAGS + TP2PP2 + ["--load", str(ckpt), "--ckpt-step", "3", "--save", str(tmp_path / "ckpt")], 4, tmp_path)
    assert_losses(run, ref, range(4, 7))
    # The reference saved iteration 6 in the background, this run synchronously (its final save): same bytes.
    async_saved, sync_saved = read_tensors(ckpt / iter_name(6)), read_tensors(tmp_path / "ckpt" / iter_name(6))
    assert async_saved.keys() == sync_saved.keys() and any(k.endswith(".exp_avg_sq") for k in sync_saved)
    for key, value in sync_saved.items():
        assert torch.equal(async_saved[key], value), f"{key} differs between the async and the sync save"
    assert "model.output.weight" not in sync_saved, "the tied head copy of the last stage must not be saved"


def test_checkpoint_with_the_removed_rng_tracker_streams_resumes_bitwise(reference, tmp_path):
    """Checkpoints written before the RNG tracker was removed hold a "tracker.tensor-parallel" stream in every
    rank's RNG file: they still load (checksums and all) and the resume is bitwise, since nothing draws from it."""
    ckpt, ref = reference
    old = tmp_path / "old"
    shutil.copytree(ckpt / iter_name(3), old / iter_name(3))
    (old / LATEST_FILE).write_text("3")
    sums_file = old / iter_name(3) / CHECKSUM_FILE
    sums = json.loads(sums_file.read_text())
    rng_files = sorted((old / iter_name(3) / RNG_DIR).glob("*.json"))
    assert len(rng_files) == 4
    for f in rng_files:
        states = decode_rng(f)
        states["tracker.tensor-parallel"] = torch.Generator().manual_seed(7).get_state()
        f.write_text(encode_rng(states))
        name = f"{RNG_DIR}/{f.name}"
        assert name in sums["files"], f"checksums.json lists {sorted(sums['files'])}"
        sums["files"][name] = file_checksum(f)
    sums_file.write_text(json.dumps(sums))
    run = run_layout(FLAGS + TP2PP2 + ["--load", str(old)], 4, tmp_path)
    assert_losses(run, ref, range(4, 7))


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "4"], ["--pipeline-model-parallel-size", "4"]])
def test_reshard_tp2pp2_checkpoint(reference, tmp_path, layout):
    ckpt, ref = reference
    run = run_layout(FLAGS + layout + ["--load", str(ckpt), "--ckpt-step", "3"], 4, tmp_path)
    assert_losses(run, ref, range(4, 7), RESHARD_RTOL)
    assert "re-derived" in run.stdout, "a layout change must say that RNG states were re-derived"


@pytest.mark.parametrize(
    "layout",
    [
        ["--context-parallel-size", "2", "--use-distributed-optimizer"],
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    ],
    ids=["cp2_zero1", "pp2_vpp2"],
)
def test_reshard_to_context_and_virtual_pipeline_parallel(reference, tmp_path, layout):
    """TP2xPP2 -> CP=2 (optimizer state sharded over DP x CP) and -> PP=2 with 2 virtual stages per rank, and back:
    each resumes the reference's losses, and its own checkpoint loads again on the TP2xPP2 layout."""
    ckpt, ref = reference
    run = run_layout(FLAGS + layout + ["--load", str(ckpt), "--ckpt-step", "3", "--save", str(tmp_path / "ck")], 2, tmp_path)
    assert_losses(run, ref, range(4, 7), RESHARD_RTOL)
    # One iteration more, on the saved lr schedule (a longer --train-iters alone would stretch its decay: refused)
    longer = with_flag(FLAGS, "--train-iters", "7") + ["--lr-decay-iters", "6"]
    back = run_layout(longer + TP2PP2 + ["--load", str(tmp_path / "ck")], 4, tmp_path / "back")
    assert sorted(losses(back)) == [7]


def test_save_holds_at_most_one_bucket_beyond_the_state():
    """DP=2, ZeRO-1 and ZeRO-3, fp32 and bf16: the peak of a save's CPU allocations (profiler) is at most
    1.1 x the largest bucket; the streamed --log-params-norm equals the norm of the gathered parameters."""
    assert run_script(WORKERS / "checkpoint_memory.py", 2, timeout=600).strip().endswith("ok")


def test_distributed_optimizer_reshards_and_resumes_bitwise(reference, tmp_path):
    """TP2xPP2 (plain optimizer) -> DP=4 distributed optimizer -> DP=2 ZeRO-3 -> DP=2 ZeRO-3 again."""
    ckpt, ref = reference
    dp4, dp2 = tmp_path / "dp4", tmp_path / "dp2"
    run = run_layout(
        FLAGS + DISTOPT + ["--load", str(ckpt), "--ckpt-step", "3", "--save", str(dp4), "--save-interval", "1"], 4, dp4
    )
    assert_losses(run, ref, range(4, 7), RESHARD_RTOL)
    # The optimizer state itself, resharded into DP shards and assembled back, matches the reference's.
    theirs, ours = read_tensors(ckpt / iter_name(6), "optim."), read_tensors(dp4 / iter_name(6), "optim.")
    assert theirs.keys() == ours.keys() and len(ours) > 10
    for key, value in ours.items():
        # Adam moments after 3 iterations in another layout: each element is a sum of gradients whose reorder
        # error is ~1e-6 of the tensor's largest gradient (FP32_RTOL's argument), so the absolute part scales
        # with the tensor (exp_avg_sq, squared gradients x (1 - beta2), is tiny, where a fixed atol checks
        # little); a misplaced shard is off by O(1) of the tensor's scale.
        scale = theirs[key].abs().max().item()
        torch.testing.assert_close(value, theirs[key], rtol=1e-4, atol=1e-4 * scale, msg=lambda m, k=key: f"{k}: {m}")
    zero3 = DISTOPT + ["--zero-stage", "3"]
    run = run_layout(FLAGS + zero3 + ["--load", str(dp4), "--ckpt-step", "4", "--save", str(dp2), "--save-interval", "1"], 2, dp2)
    assert_losses(run, ref, range(5, 7), RESHARD_RTOL)
    again = run_layout(FLAGS + zero3 + ["--load", str(dp2), "--ckpt-step", "5"], 2, tmp_path / "again")
    assert_losses(again, losses(run), range(6, 7))


def test_kill_during_save_leaves_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = FLAGS + ["--tensor-model-parallel-size", "2", "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2"]
    flags += ["--distributed-timeout-minutes", "1"]
    killed = run_layout(flags, 2, tmp_path / "killed", check=False, env={"TRICORN_TEST_KILL_DURING_SAVE": "4:1"})
    assert killed.returncode != 0
    assert latest(ckpt) == 2 and not (ckpt / iter_name(4)).exists()
    assert any(p.name.startswith(iter_name(4) + ".tmp-") for p in ckpt.iterdir()), "the kill should hit a save in progress"
    again = run_layout(flags + ["--exit-interval", "4"], 2, tmp_path / "again")
    assert_losses(again, losses(killed), range(3, 5))
    assert latest(ckpt) == 4 and not [p for p in ckpt.iterdir() if ".tmp-" in p.name], "stale temp dirs are cleaned"


def _launch(flags: list[str], nproc: int, workdir: Path) -> list[subprocess.Popen]:
    workdir.mkdir(parents=True, exist_ok=True)
    port, procs = free_port(), []
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        cmd = [sys.executable, str(ENTRY), *flags, "--metrics-file", str(workdir / "metrics.jsonl")]
        procs.append(subprocess.Popen(cmd, cwd=workdir, env={**env, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE, text=True))
    return procs


def _terminate_after(procs: list[subprocess.Popen], metrics: Path, iterations: int, timeout: float = 120) -> list[int]:
    """SIGTERM every rank (as SLURM does) once `iterations` more iterations are logged; their exit codes."""
    deadline = time.time() + timeout
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < iterations):
        assert all(p.poll() is None for p in procs), "a rank ended before the signal"
        time.sleep(0.05)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=timeout) for p in procs]
    assert codes == [0] * len(procs), f"exit codes {codes} after SIGTERM:\n" + "".join(p.stderr.read()[-2000:] for p in procs)
    return codes


def test_sigterm_saves_and_the_same_command_continues(tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = FLAGS + ["--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2", "--keep-last-n-checkpoints", "2"]
    flags = with_flag(flags, "--train-iters", "100000") + ["--exit-signal-handler", "--async-save"]
    _terminate_after(_launch(flags, 2, tmp_path / "first"), tmp_path / "first" / "metrics.jsonl", 3)
    stopped = latest(ckpt)
    assert stopped >= 3 and read_meta(ckpt / iter_name(stopped))["iteration"] == stopped
    kept = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_"))
    assert len(kept) <= 2 and iter_name(stopped) in kept, f"--keep-last-n-checkpoints 2 left {kept}"
    _terminate_after(_launch(flags, 2, tmp_path / "second"), tmp_path / "second" / "metrics.jsonl", 1)
    first = (tmp_path / "second" / "metrics.jsonl").read_text().splitlines()[0]
    assert f'"iteration": {stopped + 1},' in first, f"the rerun should continue after {stopped}: {first}"


def test_nan_stops_before_saving_and_damaged_checkpoint_is_one_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = FLAGS + ["--save", str(ckpt), "--save-interval", "1"]
    run = run_layout(flags, 1, tmp_path / "nan", check=False, env={"TRICORN_TEST_INJECT_INF_AT_ITER": "3"})
    assert run.returncode == 1 and "iteration 3" in run.stderr
    assert latest(ckpt) == 2 and not (ckpt / iter_name(3)).exists(), "the poisoned state must never be saved"
    shard = next((ckpt / iter_name(2)).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    run = run_layout(FLAGS + ["--load", str(ckpt)], 1, tmp_path / "damaged", check=False)
    errors = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 1 and len(errors) == 1, run.stderr[-2000:]
    assert str(shard) in errors[0] and "truncated" in errors[0]
