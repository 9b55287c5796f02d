"""The hang watchdog (tricorn/training/watchdog.py): a stopped, dead or stuck rank is named, every rank exits 75.

The judge is tested in-process on made-up records; two real launches (forked gloo ranks, a 6 s hang timeout) fail
ranks through $TRICORN_TEST_FAULT (tricorn/training/faults.py): 2 ranks with rank 1 SIGSTOPped, whose last
checkpoint then resumes bitwise, and TP2 x DP2 with rank 2 stuck in time.sleep and rank 3 SIGKILLed at once. The
NCCL lines are recorded from real runs (torch's ProcessGroupNCCL.cpp watchdog, checkTimeout).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

from harness import BASE_FLAGS, ENTRY, run_layout, spawn_ranks, with_flag

from tricorn.launch_errors import HANG_ERROR
from tricorn.parallel.failures import collective_failure
from tricorn.training.watchdog import Judge, Record, Sample, beat_interval

T_MIN = 0.1  # the hang timeout of the launches: 6 s
FLAGS = with_flag(BASE_FLAGS, "--train-iters", "6") + ["--hang-timeout-minutes", str(T_MIN)]


# ---------------------------------------------------------------- the judge, in-process


def _judge(records: dict[int, Record], timeout: float = 60.0) -> Judge:
    judge = Judge(len(records), timeout, {r: f"host:/logs/rank-{r}.log" for r in records})
    for r, rec in records.items():
        judge.observe(r, rec, now=0.0)
    return judge


def _advance(judge: Judge, now: float, moving: set[int], beating: set[int]) -> None:
    """Ranks in `moving` progress and beat at `now`, those in `beating` only beat; the others are silent."""
    for r, seen in judge.seen.items():
        rec = seen.record
        if r in moving or r in beating:
            it = rec.iteration + (r in moving)
            judge.observe(r, Record(rec.beat + 1, it, rec.sample, rec.done, rec.failed), now)


def test_stuck_in_python_is_named_with_the_group_that_waits() -> None:
    waiting = Sample("tricorn/training/loop.py:210 _global_tokens", "all_reduce", "dp 0,2")
    records = {
        0: Record(1, 7, waiting),
        1: Record(1, 7, Sample("tricorn/training/loop.py:210 _global_tokens", "all_reduce", "dp 1,3")),
        2: Record(1, 7, Sample("tricorn/data/loader.py:88 next")),  # not in a collective
        3: Record(1, 7, Sample("tricorn/parallel/tensor.py:60 forward", "all_reduce", "tp 2,3")),
    }
    judge = _judge(records)
    _advance(judge, 59.0, moving=set(), beating={0, 1, 2, 3})
    assert judge.verdict(59.0) is None  # not yet the timeout
    _advance(judge, 61.0, moving=set(), beating={0, 1, 2, 3})
    line = judge.verdict(61.0)
    assert line.startswith("hang: rank 2 (iteration 7, tricorn/data/loader.py:88 next) made no progress for 61s"), line
    assert "the dp group [0, 2] in all_reduce" in line and "the tp group [2, 3] in all_reduce" in line, line
    assert "ranks 1 (waiting in collectives" in line and "rank 2: host:/logs/rank-2.log" in line, line
    assert f"every rank exits {HANG_ERROR}" in line and "rank 0 (" not in line and "rank 3 (" not in line, line


def test_silent_rank_is_named_sooner_once_a_collective_failed_and_leaving_ranks_are_not() -> None:
    records = {r: Record(1, 3, Sample("p", "all_reduce", "dp 0,1,2")) for r in range(3)}
    records[2] = Record(1, 3, Sample("p"), done=True)  # finished and stopped its watchdog: not a hang
    judge = _judge(records, timeout=60.0)
    _advance(judge, 20.0, moving=set(), beating={0})  # rank 1 silent for 20 s: under the timeout
    assert judge.verdict(20.0) is None
    judge.observe(0, Record(3, 3, Sample("main.py"), failed=True), 20.0)  # rank 0's collective failed
    limit = 3 * beat_interval(60.0) + 1.0  # a few beats, not the whole timeout
    assert limit < 20.0
    line = judge.verdict(20.0)
    assert line.startswith("hang: rank 1 (iteration 3, p, in all_reduce over dp 0,1,2) sent no heartbeat for 20s"), line
    assert "ranks 0 (their collective failed" in line and "rank 2" not in line, line


def test_when_every_rank_waits_the_ones_behind_are_named() -> None:
    records = {r: Record(1, 5 if r else 4, Sample("p", "all_reduce", "world 0-2")) for r in range(3)}
    judge = _judge(records, timeout=5.0)
    _advance(judge, 6.0, moving=set(), beating={0, 1, 2})
    line = judge.verdict(6.0)
    assert line.startswith("hang: rank 0 (iteration 4") and "furthest behind" in line and "rank 1 (" not in line, line
    _advance(judge, 6.5, moving={1}, beating={0, 2})  # rank 1 moves: not everyone waits, so nobody is named
    assert judge.verdict(6.5) is None


def test_a_rank_that_left_while_the_others_wait_is_named() -> None:
    records = {r: Record(1, 5, Sample("p", "all_reduce", "world 0-2")) for r in range(2)}
    records[2] = Record(1, 4, Sample("tricorn/training/main.py:250 _train"), done=True)  # a bug ended its run
    judge = _judge(records, timeout=5.0)
    _advance(judge, 6.0, moving=set(), beating={0, 1})
    line = judge.verdict(6.0)
    assert line.startswith("hang: rank 2 (iteration 4, tricorn/training/main.py:250 _train) left the run"), line


def test_a_rank_that_left_on_its_own_error_is_named_once_a_peers_collective_fails() -> None:
    """Rank 1 ran out of memory and left (one line of its own); rank 0's TP all-reduce then failed: rank 1 is named
    at once, not rank 0 after the whole timeout (rank 0 waits for the verdict outside any collective)."""
    records = {0: Record(1, 3, Sample("p", "all_reduce", "tp 0,1")), 1: Record(1, 3, Sample("p", "all_reduce", "tp 0,1"))}
    judge = _judge(records, timeout=60.0)
    judge.observe(1, Record(2, 3, Sample("tricorn/training/main.py:280 _train"), done=True), 1.0)
    assert judge.verdict(1.0) is None  # not before a collective failed: a peer finishing first is no hang
    judge.observe(0, Record(2, 3, Sample("tricorn/training/main.py:286 _train"), failed=True), 2.0)
    line = judge.verdict(2.0)
    assert line.startswith("hang: rank 1 (iteration 3, tricorn/training/main.py:280 _train) left the run"), line


def test_record_round_trip() -> None:
    rec = Record(12, 40, Sample("tricorn/x.py:3 f", "all_gather_into_tensor", "tp 0,1"), done=False, failed=True)
    assert Record.decode(rec.encode()) == rec


# ---------------------------------------------------------------- NCCL's messages, as real runs printed them

# torch's ProcessGroupNCCL watchdog (WorkNCCL::checkTimeout): the shapes real jobs print.
NCCL_TIMEOUTS = [
    (
        "[PG ID 0 PG GUID 0(default_pg) Rank 1] Process group watchdog thread terminated with exception: [Rank 1] "
        "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=2415, OpType=ALLREDUCE, NumelIn=8192, "
        "NumelOut=8192, Timeout(ms)=1800000) ran for 1800058 milliseconds before timing out.",
        "allreduce",
    ),
    (
        "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=BROADCAST, "
        "NumelIn=131072000, NumelOut=131072000, Timeout(ms)=600000) ran for 600081 milliseconds before timing out.",
        "broadcast",
    ),
    (
        "[PG ID 0 PG GUID 0(default_pg) Rank 5] Process group watchdog thread terminated with exception: [Rank 5] "
        "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=77, OpType=SCATTER, NumelIn=29360128, "
        "NumelOut=0, Timeout(ms)=1800000) ran for 1800047 milliseconds before timing out.",
        "scatter",
    ),
    # Lines as public bug reports quote them (torch 2.x; the first from hiyouga/LlamaFactory#6269, the second,
    # torch 1.x's shorter form without the element counts, from OFA-Sys/OFA#271).
    (
        "[rank0]:[E1206 18:44:12.715298746 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=7753, OpType=_REDUCE_SCATTER_BASE, NumelIn=544997376, NumelOut=68124672, "
        "Timeout(ms)=600000) ran for 600061 milliseconds before timing out.",
        "_reduce_scatter_base",
    ),
    (
        "[E ProcessGroupNCCL.cpp:737] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=469508, "
        "OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 1802212 milliseconds before timing out.",
        "allreduce",
    ),
]


def test_nccl_timeouts_become_one_line_naming_the_collective() -> None:
    for text, op in NCCL_TIMEOUTS:
        line = collective_failure(RuntimeError(text), 0, 8, 30)
        assert line == (
            f"rank 0: a peer rank did not answer in {op} within --distributed-timeout-minutes 30; it died or is "
            "stopped (see its log), resume from the last checkpoint with --load"
        ), line
    # Not a collective that timed out: left to the caller (a traceback, or its own line).
    assert collective_failure(RuntimeError("CUDA error: an illegal memory access was encountered"), 0, 8, 30) is None


# ---------------------------------------------------------------- real launches


def _launch(flags: list[str], nproc: int, workdir: Path, fault: str) -> tuple[list[tuple[int, str, str]], float]:
    workdir.mkdir(parents=True, exist_ok=True)
    ranks = spawn_ranks([sys.executable, str(ENTRY), *flags], nproc, 180, cwd=workdir, env={"TRICORN_TEST_FAULT": fault})
    return ranks, time.time()


def _fault_time(err: str) -> float:
    return float(re.search(r"tricorn: test fault: rank \d+ \w+ at iteration \d+ \(([\d.]+)\)", err).group(1))


def _hang_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("tricorn: error: hang:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def test_stopped_rank_is_named_and_the_last_checkpoint_resumes_bitwise(tmp_path: Path) -> None:
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    flags = FLAGS + ["--save", str(ckpt), "--save-interval", "3", "--metrics-file", str(metrics)]
    ranks, ended = _launch(flags, 2, tmp_path / "hang", "1:5:stop")
    (code0, _, err0), (code1, _, err1) = ranks
    assert code0 == HANG_ERROR and code1 == -9, (code0, code1, err0[-2000:])  # rank 1: SIGKILLed by the reaper
    # The survivor left within the timeout and 30 s of the stop (the heartbeats stopped then).
    assert ended - _fault_time(err1) < T_MIN * 60 + 30
    line = _hang_line(err0)
    assert re.search(r"hang: rank 1 \(iteration \d, .*\) sent no heartbeat for \d+s", line), line
    assert "waiting on it: the dp group [0, 1] in all_reduce" in line and "logs: rank 1: " in line, line
    # The checkpoint of iteration 3 is the last complete one; resumed from it, iteration 4 is the interrupted
    # run's own iteration 4, bitwise (model, optimizer, data position and RNG all came back).
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    first = [json.loads(x) for x in metrics.read_text().splitlines()]
    shorter = with_flag(FLAGS, "--train-iters", "4") + ["--lr-decay-iters", "6"]  # the saved run's lr schedule
    resumed = run_layout(shorter + ["--load", str(ckpt)], 2, tmp_path / "resumed")
    assert [r["iteration"] for r in first] == [1, 2, 3, 4] and len(resumed.records) == 1
    assert (resumed.losses[0], resumed.grad_norms[0]) == (first[3]["loss"], first[3]["grad_norm"])


def test_rank_stuck_in_python_of_tp2_dp2_is_named_with_its_groups(tmp_path: Path) -> None:
    dumps = tmp_path / "fr"
    flags = FLAGS + ["--tensor-model-parallel-size", "2", "--flight-recorder-dump-path", str(dumps)]
    ranks, ended = _launch(flags, 4, tmp_path, "2:3:sleep")
    codes = [rc for rc, _, _ in ranks]
    # Every rank exits 75, rank 2 too: its main thread sleeps, its watchdog thread reads the verdict and ends it.
    assert codes == [HANG_ERROR] * 4, (codes, ranks[0][2][-3000:])
    assert ended - _fault_time(ranks[2][2]) < T_MIN * 60 + 30
    line = _hang_line(ranks[0][2])
    assert re.search(r"hang: rank 2 \(iteration 3, tricorn/training/faults\.py:\d+ maybe_inject\) made no progress", line), line
    assert "the dp group [0, 2] in all_reduce" in line and "the tp group [2, 3] in" in line, line
    assert "rank 1 (" not in line and "rank 3 (" not in line, line
    # One line from the whole job: rank 0 prints it, the others only record it.
    assert all("tricorn: error: hang:" not in err for _, _, err in ranks[1:])
    # Every live rank (all four: rank 2's watchdog thread runs while its main thread sleeps) dumped its flight
    # recorder, and the line says where; the analysis names rank 2 and its last collective.
    assert line.endswith(f"; flight recorder dumps in {dumps} (tricorn fr-trace {dumps})"), line
    assert sorted(p.name for p in dumps.iterdir()) == ["rank_0", "rank_1", "rank_2", "rank_3"]
    check_flight_recorder_summary(dumps)


def check_flight_recorder_summary(dumps: Path) -> None:
    """Rank 2 slept at the start of iteration 3: every peer waits in a collective it never joined."""
    from torch.distributed.flight_recorder.components.builder import build_db
    from torch.distributed.flight_recorder.components.config_manager import JobConfig
    from torch.distributed.flight_recorder.components.loader import read_dir

    from tricorn import fr_trace

    summary = fr_trace.summarize(fr_trace.read_dir(dumps))
    assert summary[0] == "flight recorder: dumps of 4 of 4 ranks", summary
    behind = [line for line in summary if line.startswith("behind: ")]
    assert len(behind) == 1, summary
    assert re.match(
        r"behind: rank 2 \(in no collective; its last collective \w+ #\d+ over [\w-]+ [\d,-]+, completed\) holds up ", behind[0]
    )
    assert "dp 0,2 (at #" in behind[0] and "tp 2,3 (at #" in behind[0], behind
    assert re.match(r"rank 0: waits in all_reduce #\d+ over dp 0,2", summary[1]), summary
    assert summary[3].startswith("rank 2: in no collective; last completed "), summary
    # torch's own analyser reads the same dumps (each group's ranks filled in as NCCL writes them) and finds the
    # collectives rank 2 never joined.
    args = JobConfig().parse_args([str(dumps), "-p", "rank_"])
    details, version = read_dir(args)
    db = build_db(details, args, version)
    assert any(2 in (c.missing_ranks or ()) for c in db.collectives)


def test_killed_rank_is_named_a_few_beats_after_its_peer_sees_the_connection_close(tmp_path: Path) -> None:
    ranks, ended = _launch(FLAGS, 2, tmp_path, "1:3:kill")
    (code0, _, err0), (code1, _, err1) = ranks
    assert code0 == HANG_ERROR and code1 == -9, (code0, code1, err0[-2000:])
    # gloo reports the closed connection at once; the watchdog then needs a few beats, not the whole timeout.
    assert ended - _fault_time(err1) < T_MIN * 60 + 30
    line = _hang_line(err0)
    assert re.search(r"hang: rank 1 \(iteration \d, .*\) sent no heartbeat for \ds", line), line
    assert "ranks 0 (their collective failed: a peer is gone)" in line, line


def test_stopped_rank_0_is_named_by_rank_1_from_the_silence_of_its_store(tmp_path: Path) -> None:
    ranks, ended = _launch(FLAGS, 2, tmp_path, "0:3:stop")
    (code0, _, err0), (code1, _, err1) = ranks
    assert code0 == -9 and code1 == HANG_ERROR, (code0, code1, err1[-2000:])
    assert ended - _fault_time(err0) < T_MIN * 60 + 30
    line = _hang_line(err1)  # rank 0 cannot print: rank 1 does
    assert line.startswith("tricorn: error: hang: rank 0 sent no heartbeat for "), line
    assert re.search(r"rank 1 at iteration 3, tricorn/\S+ \w+, waiting in all_reduce over dp 0,1;", line), line
