"""Profiler windows, nsys ranges, memory history and the out-of-memory line (tricorn/profiling.py, training/oom.py).

- A TP2 x PP2 run with a torch-profiler window on ranks 0 and 3 writes exactly two traces, each with its stage's
  pipeline actions (F/B per microbatch) in the window's iterations and nothing of the iterations outside it.
- nsys and the allocator's history on the CPU, by contract: the real trainer (main()) calls a stand-in of
  torch.cuda's functions (tests/cuda_standin.py, its signatures checked against torch's here); the journal says
  which rank called what, and when relative to the iterations.
- An injected out-of-memory at TP2 (tricorn/training/faults.py: the next module forward raises CUDA's error)
  prints one line per rank, exits 3 and leaves the last checkpoint as it was.
"""

from __future__ import annotations

import gzip
import inspect
import json
import re
import sys
from pathlib import Path

import cuda_standin
import torch
from harness import BASE_FLAGS, ROOT, run_layout, spawn_ranks, with_flag

from tricorn import profiling
from tricorn.checkpoint import io
from tricorn.config_args import config_from_args
from tricorn.launch_errors import HANG_ERROR, OOM_ERROR
from tricorn.validation import output_path_errors, validate

WORKER = ROOT / "tests" / "workers" / "profiled_run.py"


def _errors(argv: list[str], world: int = 1) -> str:
    cfg = config_from_args(BASE_FLAGS + argv, world_size=world)
    return "; ".join(output_path_errors(cfg) + validate(cfg))


# ---------------------------------------------------------------- the stand-in is torch's API


def _resolve(dotted: str):
    obj = __import__(dotted.split(".")[0])
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def test_stand_in_has_the_signatures_of_torchs_cuda_functions() -> None:
    """Every parameter of every stand-in function exists in torch 2.13's function with the same kind and default
    (torch's may have more): a call tricorn makes that the stand-in accepts is one torch accepts."""
    problems = []
    for ours, dotted in cuda_standin.REAL.items():
        real = _resolve(dotted)
        sig_ours = inspect.signature(ours.__init__ if inspect.isclass(ours) else ours)
        sig_real = inspect.signature(real.__init__ if inspect.isclass(real) else real)
        for p in sig_ours.parameters.values():
            theirs = sig_real.parameters.get(p.name)
            if theirs is None or theirs.kind != p.kind or theirs.default != p.default:
                problems.append(f"{dotted}: stand-in {p} vs torch's {theirs}")
        missing = [
            p for p in sig_real.parameters.values() if p.default is inspect.Parameter.empty and p.name not in sig_ours.parameters
        ]
        problems += [f"{dotted}: torch requires {p.name}, the stand-in lacks it" for p in missing]
    assert not problems, problems
    # The real API tricorn builds on a CUDA machine names these same functions.
    real = profiling.CudaApi.real()
    assert real.range_push is torch.cuda.nvtx.range_push and real.dump_snapshot is torch.cuda.memory._dump_snapshot


def test_outside_the_window_a_range_is_one_shared_no_op() -> None:
    cuda_standin.install()
    try:
        assert not profiling.window_open()
        made = []
        assert profiling.span("F stage%d mb%d", 0, 1) is profiling.span(lambda: made.append(1) or "x")
        assert made == [] and cuda_standin.JOURNAL == []  # no name built, no NVTX call
    finally:
        cuda_standin.uninstall()


# ---------------------------------------------------------------- bad input, before launch


def test_bad_profile_flags_are_one_line_each(tmp_path: Path) -> None:
    base = ["--profile", "--use-pytorch-profiler", "--tensorboard-dir", str(tmp_path / "tb")]
    assert _errors(base + ["--profile-step-start", "1", "--profile-step-end", "3"]) == ""
    # Megatron's defaults (10, 12) lie past this 5-iteration run
    assert "the profile window (iterations 11-12) ends after the run's 5 iterations" in _errors(base)
    assert "--profile-step-end 2 must be after --profile-step-start 3" in _errors(
        base + ["--profile-step-start", "3", "--profile-step-end", "2"]
    )
    window = ["--profile-step-start", "1", "--profile-step-end", "2"]
    assert "--profile-ranks 2 5 outside the world of 2 ranks (0-1)" in _errors(
        base + window + ["--profile-ranks", "0", "2", "5"], world=2
    )
    assert "writes its traces under --tensorboard-dir" in _errors(["--profile", "--use-pytorch-profiler"] + window)
    assert "needs --device cuda" in _errors(["--profile"] + window)  # nsys, on a CPU
    assert "needs --device cuda" in _errors(["--record-memory-history"])
    assert "only configure the profile window: add --profile" in _errors(["--profile-memory"])
    assert "configure the torch profiler: add --use-pytorch-profiler" in _errors(
        ["--profile", "--profile-memory"] + window, world=1
    ).replace("needs --device cuda", "")
    cuda_standin.install()  # a snapshot path that cannot be written: found before launch
    try:
        blocker = tmp_path / "file"
        blocker.write_text("x")
        line = _errors(["--record-memory-history", "--memory-snapshot-path", str(blocker / "snap.pickle")])
        assert line.startswith(f"--memory-snapshot-path {blocker}/snap.pickle cannot be created"), line
    finally:
        cuda_standin.uninstall()


# ---------------------------------------------------------------- the torch-profiler window (acceptance)


def _annotations(path: Path) -> list[dict]:
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    return [e for e in events if e.get("cat") == "user_annotation"]


def test_tp2_pp2_window_on_ranks_0_and_3_writes_two_traces_of_their_stages(tmp_path: Path) -> None:
    tb = tmp_path / "tb"
    flags = with_flag(with_flag(BASE_FLAGS, "--train-iters", "4"), "--global-batch-size", "6")
    flags += ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--tensorboard-dir", str(tb)]
    flags += ["--profile", "--use-pytorch-profiler", "--profile-step-start", "1", "--profile-step-end", "3"]
    run = run_layout(flags + ["--profile-ranks", "0", "3", "--record-shapes"], 4, tmp_path / "run")
    traces = sorted((tb / "torch_profile").iterdir())
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank3"], traces  # the plugin's <worker>.<time>.pt.trace.json.gz
    assert all(t.name.endswith(".pt.trace.json.gz") for t in traces)
    assert "tricorn: profile: iterations 2-3 on rank 0: trace in" in run.stdout
    for trace, stage in zip(traces, (0, 1)):  # rank 0 holds stage 0 (TP rank 0), rank 3 stage 1 (TP rank 1)
        events = _annotations(trace)
        windows = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("iteration ")}
        assert sorted(windows) == ["iteration 2", "iteration 3"], sorted(windows)  # none of iterations 1 and 4
        actions = [e for e in events if re.fullmatch(r"[FBW] stage\d+ mb\d+", e["name"])]
        expected = sorted(f"{k} stage{stage} mb{m}" for k in "FB" for m in range(3)) * 2  # 3 microbatches, 2 iterations
        assert sorted(e["name"] for e in actions) == sorted(expected), sorted(e["name"] for e in actions)
        for e in actions:  # each action lies inside one of the window's iterations
            assert any(lo <= e["ts"] and e["ts"] + e["dur"] <= hi for lo, hi in windows.values()), e
        assert sum(e["name"] == "optimizer step" for e in events) == 2
        assert any(e["name"].startswith("p2p ") for e in events)
        assert any(e.get("args", {}).get("Input Dims") for e in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"])


# ---------------------------------------------------------------- nsys and the allocator's history, by contract


def _journal(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _index(journal: list[dict], call: str, **match) -> int:
    return next(i for i, e in enumerate(journal) if e["call"] == call and all(e.get(k) == v for k, v in match.items()))


def test_nsys_window_and_memory_history_calls_by_contract(tmp_path: Path) -> None:
    """DP 2 with the distributed optimizer, window (1, 3] on rank 1 only, a checkpoint saved at 3 (in the window)."""
    journals, snapshot = tmp_path / "journal", tmp_path / "mem" / "snap.pickle"
    journals.mkdir()
    flags = with_flag(BASE_FLAGS, "--train-iters", "4") + ["--use-distributed-optimizer", "--save", str(tmp_path / "ckpt")]
    flags += ["--save-interval", "3", "--profile", "--profile-step-start", "1", "--profile-step-end", "3", "--profile-ranks", "1"]
    flags += ["--record-memory-history", "--memory-snapshot-path", str(snapshot), "--record-shapes"]
    ranks = spawn_ranks([sys.executable, str(WORKER), str(journals), *flags], 2, 180)
    assert [rc for rc, _, _ in ranks] == [0, 0], ranks[0][2][-3000:] + ranks[1][2][-3000:]
    assert [e["call"] for e in _journal(journals / "rank0.jsonl") if e["call"] != "mark"] == []  # not profiled: no call
    j = _journal(journals / "rank1.jsonl")
    marks = {e["text"]: i for i, e in enumerate(j) if e["call"] == "mark"}
    history = _index(j, "record_memory_history", enabled="all")
    assert history < marks["build"] and j[history]["stacks"] == "python"  # recording from before the model exists
    start, stop = _index(j, "profiler_start"), _index(j, "profiler_stop")
    assert marks["iteration 1"] < start < marks["iteration 2"] and marks["iteration 3"] < stop < marks["iteration 4"]
    assert j[_index(j, "emit_nvtx")]["record_shapes"] is True
    assert start < _index(j, "emit_nvtx.__enter__") < _index(j, "emit_nvtx.__exit__") < stop
    pushes = [i for i, e in enumerate(j) if e["call"] == "range_push"]
    pops = [i for i, e in enumerate(j) if e["call"] == "range_pop"]
    assert pushes and len(pushes) == len(pops) and start < min(pushes) and max(pops) < stop  # no NVTX outside the window
    names = [j[i]["msg"] for i in pushes]
    assert [n for n in names if n.startswith("iteration")] == ["iteration 2", "iteration 3"]
    for n in ("forward mb0", "backward mb0", "dp reduce bucket 0", "dp gather bucket 0", "optimizer step", "checkpoint save"):
        assert names.count(n) >= (1 if n == "checkpoint save" else 2), (n, names)
    # The window's end writes the history and stops recording: once, after the last iteration of the window.
    dump = _index(j, "dump_snapshot")
    assert stop < dump < marks["iteration 4"] and j[dump]["filename"] == str(snapshot.with_name("snap.rank1.pickle"))
    assert _index(j, "record_memory_history", enabled=None) > dump and snapshot.with_name("snap.rank1.pickle").is_file()
    assert sum(e["call"] == "dump_snapshot" for e in j) == 1


# ---------------------------------------------------------------- out of memory (acceptance)


def test_injected_oom_at_tp2_prints_one_line_exits_3_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    """Rank 1 runs out of memory in iteration 3's forward: its line, exit 3; its TP peer's all-reduce fails and the
    watchdog names rank 1 (exit 75) within a few beats; the checkpoint of iteration 2 stays the last one, intact."""
    ckpt, snapshot = tmp_path / "ckpt", tmp_path / "snap.pickle"
    flags = with_flag(BASE_FLAGS, "--train-iters", "4") + ["--tensor-model-parallel-size", "2", "--save", str(ckpt)]
    flags += ["--save-interval", "2", "--record-memory-history", "--memory-snapshot-path", str(snapshot)]
    flags += ["--hang-timeout-minutes", "0.05"]  # beats every 0.3 s: the peer's line comes within about a second
    ranks = spawn_ranks([sys.executable, str(WORKER), str(tmp_path), *flags], 2, 180, env={"TRICORN_TEST_FAULT": "1:3:oom"})
    assert [rc for rc, _, _ in ranks] == [HANG_ERROR, OOM_ERROR], ranks[1][2][-3000:] + ranks[0][2][-3000:]
    lines = [line for line in ranks[1][2].splitlines() if line.startswith("tricorn: error: ")]
    assert len(lines) == 1, ranks[1][2][-3000:]
    line = lines[0]
    assert line.startswith("tricorn: error: rank 1 ran out of device memory in forward of iteration 3 (tricorn/"), line
    assert ": tried to allocate 2.00 GiB; allocator: 71.00 GiB allocated, 78.00 GiB reserved (peak allocated 75.00 GiB)" in line
    assert "; estimate for stage 0 (tricorn estimate): params " in line and " = " in line
    path = snapshot.with_name("snap.rank1.pickle")
    assert f"; memory history: {path} (drop it on https://pytorch.org/memory_viz)" in line and path.is_file()
    (peer,) = [line for line in ranks[0][2].splitlines() if line.startswith("tricorn: error: ")]
    assert peer.startswith("tricorn: error: hang: rank 1 (iteration 3, ") and ") left the run while the others wait" in peer
    # The checkpoint of iteration 2 is the last one, complete and intact; nothing of iteration 3 was written.
    assert (ckpt / io.LATEST_FILE).read_text().strip() == "2"
    assert [p.name for p in ckpt.iterdir() if p.name.startswith("iter_")] == [io.iter_name(2)]
    cfg = config_from_args(flags + ["--load", str(ckpt)], world_size=2)
    assert io.load_errors(cfg) == []
    manifest = io.read_manifest(ckpt / io.iter_name(2))
    assert io.checksum_errors(ckpt / io.iter_name(2), manifest, sorted(manifest)) == []


def test_device_and_host_allocator_failures_are_out_of_memory() -> None:
    from tricorn.training import oom

    assert oom.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    host = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"
    )
    assert oom.is_out_of_memory(host) and not oom.is_out_of_memory(RuntimeError("Connection closed by peer"))
