"""Pipeline schedules as data: simulated bubble, activation memory, deadlock freedom, layer split, CLI."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest

from tricorn.config_args import config_from_args
from tricorn.parallel.pipeline import cli
from tricorn.parallel.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    RECV_BACKWARD,
    RECV_FORWARD,
    SEND_BACKWARD,
    SEND_FORWARD,
    Action,
    ScheduleError,
    check_schedule,
    counterpart,
    group_steps,
    schedule_for,
)
from tricorn.parallel.pipeline.simulator import Costs, simulate
from tricorn.parallel.pipeline.stages import StageSplitError, stage_layout, validate_pipeline


def _valid_layouts():
    """(pp, vpp, m, kind) for p in 1..8, m in p..4p, v in 1..4 wherever the schedule is defined."""
    for p in range(1, 9):
        for m in range(p, 4 * p + 1):
            for v in range(1, 5):
                if v == 1:
                    yield from ((p, 1, m, k) for k in ("1f1b", "gpipe", "forward-only"))
                elif p > 1 and m % p == 0:
                    yield from ((p, v, m, k) for k in ("interleaved", "forward-only"))


def test_no_schedule_deadlocks_and_each_rank_runs_every_microbatch_once():
    checked = Counter()
    for p, v, m, kind in _valid_layouts():
        schedule = schedule_for(p, v, m, kind)
        result = simulate(schedule, p, v)
        where = f"{kind} pp={p} vpp={v} m={m}"
        assert not result.deadlocked, f"{where}: {result.report()}"
        assert not result.mismatches, f"{where}: {result.report()}"
        assert check_schedule(schedule, p, v, m) == [], where
        expected = Counter({(mb, c): 1 for mb in range(m) for c in range(v)})
        for r in range(p):
            assert result.order[r] == schedule[r], f"{where}: rank {r} did not run its whole list"
            fwd = Counter((a.microbatch, a.chunk) for a in schedule[r] if a.kind is FORWARD)
            bwd = Counter((a.microbatch, a.chunk) for a in schedule[r] if a.kind is BACKWARD)
            assert fwd == expected, f"{where}: rank {r} forwards"
            assert bwd == (Counter() if kind == "forward-only" else expected), f"{where}: rank {r} backwards"
        checked[kind] += 1
    assert checked == {"1f1b": 116, "gpipe": 116, "forward-only": 200, "interleaved": 84}


@pytest.mark.parametrize("p", range(1, 9))
def test_1f1b_bubble_fraction_is_exact(p):
    for m in range(1, 4 * p + 1):
        result = simulate(schedule_for(p, 1, m, "1f1b"), p, 1, Costs(1, 2, 0))
        assert result.makespan == 3 * (m + p - 1)
        assert result.bubble_fraction == [Fraction(p - 1, m + p - 1)] * p


@pytest.mark.parametrize("p", range(2, 9))
def test_interleaving_cuts_the_bubble_by_v(p):
    for v in range(2, 5):
        for m in range(p, 4 * p + 1, p):
            result = simulate(schedule_for(p, v, m), p, v, Costs(1, 2, 0))
            assert result.bubble_fraction == [Fraction(p - 1, v * m + p - 1)] * p, (p, v, m)


def test_1f1b_holds_at_most_p_microbatches_gpipe_holds_m():
    for p in range(1, 9):
        for m in (p, 2 * p, 4 * p):
            one_f_one_b = simulate(schedule_for(p, 1, m, "1f1b"), p).peak_in_flight
            assert one_f_one_b[0] == p
            assert one_f_one_b == [min(p - r, m) for r in range(p)]
            assert simulate(schedule_for(p, 1, m, "gpipe"), p).peak_in_flight == [m] * p
            assert simulate(schedule_for(p, 1, m, "forward-only"), p).peak_in_flight == [0] * p


def test_interleaved_holds_megatron_warmup_plus_one():
    p, v, m = 4, 2, 8
    peaks = simulate(schedule_for(p, v, m), p, v).peak_in_flight
    assert peaks == [2 * (p - r - 1) + (v - 1) * p + 1 for r in range(p)]


def test_interleaved_follows_megatron_order():
    rank0 = [a for a in schedule_for(2, 2, 4)[0] if a.kind.is_compute]
    f = lambda mb, c: Action(FORWARD, mb, c)  # noqa: E731
    b = lambda mb, c: Action(BACKWARD, mb, c)  # noqa: E731
    assert rank0 == [
        f(0, 0), f(1, 0), f(0, 1), f(1, 1),
        f(2, 0), b(0, 1), f(3, 0), b(1, 1), f(2, 1), b(0, 0), f(3, 1), b(1, 0),
        b(2, 1), b(3, 1), b(2, 0), b(3, 0),
    ]  # fmt: skip
    # With as many microbatches as stages Megatron runs every forward first, on every rank.
    for actions in schedule_for(4, 2, 4):
        kinds = [a.kind for a in actions if a.kind.is_compute]
        assert kinds == [FORWARD] * 8 + [BACKWARD] * 8


def test_peers_wrap_across_chunks():
    # Chunk 0 on the last rank feeds chunk 1 on rank 0; rank 0 chunk 1 sends its gradient back there.
    assert counterpart(Action(SEND_FORWARD, 3, 0), 3, 4, 2) == (0, Action(RECV_FORWARD, 3, 1))
    assert counterpart(Action(SEND_BACKWARD, 3, 1), 0, 4, 2) == (3, Action(RECV_BACKWARD, 3, 0))
    assert counterpart(Action(RECV_BACKWARD, 5, 0), 1, 4, 1) == (2, Action(SEND_BACKWARD, 5, 0))
    with pytest.raises(ScheduleError, match="no peer"):
        counterpart(Action(SEND_FORWARD, 0, 1), 3, 4, 2)


def test_consecutive_communication_is_one_batched_step():
    actions = schedule_for(3, 1, 4)[1]
    steps = group_steps(actions)
    assert [a for s in steps for a in s] == actions
    assert (Action(SEND_FORWARD, 1, 0), Action(RECV_BACKWARD, 0, 0)) in steps
    assert all(len(s) == 1 for s in steps if s[0].kind.is_compute)
    assert all(steps[i][0].kind.is_compute or steps[i + 1][0].kind.is_compute for i in range(len(steps) - 1))


def test_broken_schedule_is_reported_as_deadlocked():
    f, b, sf, rf, sb, rb = (
        lambda mb, k=k: Action(k, mb) for k in (FORWARD, BACKWARD, SEND_FORWARD, RECV_FORWARD, SEND_BACKWARD, RECV_BACKWARD)
    )
    # Rank 0 waits for the gradient of microbatch 0 before sending microbatch 1, but rank 1
    # only runs its first backward after receiving microbatch 1: a cycle.
    rank0 = [f(0), sf(0), rb(0), b(0), f(1), sf(1), rb(1), b(1)]
    rank1 = [rf(0), f(0), rf(1), f(1), b(0), sb(0), b(1), sb(1)]
    result = simulate([rank0, rank1], 2)
    assert result.deadlocked
    waits = {(w.rank, str(w.action), w.peer, str(w.expected)) for w in result.deadlock}
    assert waits == {(0, "RB0", 1, "SB0"), (1, "RF1", 0, "SF1")}
    assert "rank 1 RF1 waits for rank 0 to post SF1; rank 0 is blocked at [SF0 RB0]" in result.report()
    assert len(result.order[1]) < len(rank1)


def test_reordered_messages_are_reported():
    # Rank 1 receives microbatch 1 first; rank 0 sends microbatch 0 first: NCCL would hand over the wrong tensor.
    rank0 = [Action(FORWARD, 0), Action(SEND_FORWARD, 0), Action(FORWARD, 1), Action(SEND_FORWARD, 1)]
    rank1 = [Action(RECV_FORWARD, 1), Action(RECV_FORWARD, 0), Action(FORWARD, 0), Action(FORWARD, 1)]
    result = simulate([rank0, rank1], 2)
    assert not result.deadlocked
    assert len(result.mismatches) == 2 and "rank 1 posted RF1" in result.mismatches[0]


def test_p2p_latency_lengthens_the_run_without_deadlock():
    for kind, v in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2)):
        base = simulate(schedule_for(4, v, 8, kind), 4, v, Costs(1, 2, 0))
        slow = simulate(schedule_for(4, v, 8, kind), 4, v, Costs(1, 2, Fraction(1, 2)))
        assert not slow.deadlocked and slow.makespan > base.makespan
        assert slow.busy == base.busy
    # One stage sends nothing: latency costs nothing.
    assert simulate(schedule_for(1, 1, 4), 1, 1, Costs(1, 2, 5)).makespan == 12


def test_schedule_errors_name_the_numbers():
    with pytest.raises(ScheduleError, match="6 microbatches is not a multiple of pp 4"):
        schedule_for(4, 2, 6)
    with pytest.raises(ScheduleError, match="at least 2"):
        schedule_for(1, 2, 4)
    with pytest.raises(ScheduleError, match="interleaved"):
        schedule_for(4, 2, 8, "gpipe")
    with pytest.raises(ScheduleError, match="unknown pipeline schedule"):
        schedule_for(4, 1, 8, "zb")
    assert schedule_for(4, 2, 8) == schedule_for(4, 2, 8, "interleaved")
    assert schedule_for(4, 1, 8) == schedule_for(4, 1, 8, "1f1b")
    assert schedule_for(4, 1, 8, forward_only=True) == schedule_for(4, 1, 8, "forward-only")


# ------------------------------------------------------------------ stage splitting


def test_even_and_interleaved_layer_split():
    layout = stage_layout(8, 2)
    assert [layout.rank_layers(r) for r in range(2)] == [[range(0, 4)], [range(4, 8)]]
    # Model chunk c on rank r is virtual stage c * pp + r.
    layout = stage_layout(8, 2, 2)
    assert layout.rank_layers(0) == [range(0, 2), range(4, 6)]
    assert layout.rank_layers(1) == [range(2, 4), range(6, 8)]
    assert [layout.owner(i) for i in range(8)] == [(0, 0)] * 2 + [(1, 0)] * 2 + [(0, 1)] * 2 + [(1, 1)] * 2


def test_uneven_layer_split():
    layout = stage_layout(10, 4, first=1, last=3)
    assert [layout.layers(r) for r in range(4)] == [range(0, 1), range(1, 4), range(4, 7), range(7, 10)]
    layout = stage_layout(20, 4, 2, first=2, last=6)
    assert layout.counts == (1, 3, 3, 3, 1, 3, 3, 3)
    assert layout.rank_layers(3) == [range(7, 10), range(17, 20)]
    assert stage_layout(5, 2, last=2).counts == (3, 2)


@pytest.mark.parametrize(
    "args, message",
    [
        ((10, 4), "--num-layers 10 is not divisible by --pipeline-model-parallel-size 4"),
        ((12, 4, 2), "--num-layers 12 is not divisible by --pipeline-model-parallel-size 4 x 2 chunks per rank = 8"),
        ((9, 4, 1, 1, 3), "leaves 5"),
        ((10, 4, 2, 3, 3), "--decoder-first-pipeline-num-layers 3 is not divisible by the 2 model chunks"),
        ((8, 2, 1, 3, 4), "3 + --decoder-last-pipeline-num-layers 4 = 7 must equal --num-layers 8"),
        ((8, 1, 1, 4, None), "need --pipeline-model-parallel-size > 1"),
    ],
)
def test_layer_split_errors(args, message):
    with pytest.raises(StageSplitError, match=message.replace("+", r"\+")):
        stage_layout(*args)


def _cfg(*flags: str, world_size: int = 2):
    return config_from_args([*flags, "--mock-data", "--vocab-size", "128", "--device", "cpu"], world_size=world_size)


def test_validate_pipeline():
    pp2 = ("--num-layers", "8", "--pipeline-model-parallel-size", "2")
    assert validate_pipeline(_cfg(*pp2, "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "4")) == []
    errs = validate_pipeline(_cfg(*pp2, "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "6", world_size=4))
    assert errs == [
        "the interleaved schedule needs microbatches divisible by --pipeline-model-parallel-size 2: --global-batch-size 6 / "
        "(--micro-batch-size 1 x DP 2) = 3 microbatches; use global batch sizes that are multiples of 4"
    ]
    ramp = ("--global-batch-size", "8", "--rampup-batch-size", "2", "2", "64")
    errs = validate_pipeline(_cfg(*pp2, "--num-virtual-stages-per-pipeline-rank", "2", *ramp, world_size=4))
    assert len(errs) == 1 and "ramp-up global batch size 2" in errs[0] and "= 1 microbatches" in errs[0]
    assert validate_pipeline(_cfg("--num-layers", "10", "--pipeline-model-parallel-size", "4", world_size=4)) == [
        "--num-layers 10 is not divisible by --pipeline-model-parallel-size 4; change the layer count or give "
        "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers for an uneven split"
    ]
    both = ("--num-virtual-stages-per-pipeline-rank", "2", "--num-layers-per-virtual-pipeline-stage", "2")
    assert "not both" in validate_pipeline(_cfg(*pp2, *both))[0]
    assert (
        "gpipe" in validate_pipeline(_cfg(*pp2, "--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-schedule", "gpipe"))[0]
    )
    assert "> 1" in validate_pipeline(_cfg("--num-virtual-stages-per-pipeline-rank", "2", world_size=1))[0]
    uneven = ("--decoder-first-pipeline-num-layers", "2", "--num-layers-per-virtual-pipeline-stage", "1")
    assert "does not combine" in validate_pipeline(_cfg(*pp2, *uneven))[0]


# ------------------------------------------------------------------ CLI


def test_cli_prints_grid_and_bubble(capsys):
    assert cli.main(["--pp", "4", "--vpp", "2", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    grid = [line for line in out.splitlines() if line.startswith("rank ") and "|" in line]
    assert len(grid) == 4
    assert grid[0].split("|")[1].split()[:3] == ["F0a", "F1a", "F2a"]
    assert grid[3].split("|")[1].split()[:4] == [".", ".", ".", "F0a"]
    assert out.count("bubble 0.1579 (3/19)") == 4


def test_cli_refuses_bad_interleaving(capsys):
    assert cli.main(["--pp", "4", "--vpp", "2", "--microbatches", "6"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "6 microbatches is not a multiple of pp 4" in err
