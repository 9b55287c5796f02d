"""``tricorn schedule``: draw a pipeline schedule as a rank x time grid, with its bubble fraction.

    tricorn schedule --pp 4 --vpp 2 --microbatches 8
    tricorn schedule --pp 4 --microbatches 8 --schedule gpipe --f 1 --b 2 --p2p 0.5
    tricorn schedule --pp 4 --microbatches 8 --schedule zbv --f 1/2 --b 1 --w 1/2

Each cell is one time quantum (the greatest common divisor of the costs). ``F3`` is the
forward of microbatch 3, ``B3`` its backward (its input gradient only where a ``W3`` follows:
the zero-bubble schedules' deferred weight gradients); with more than one chunk per rank a
letter names the model chunk (``F3a`` chunk 0, ``F3b`` chunk 1, ...). ``.`` is idle time
(bubble or communication). zbv and dualpipev take 2 chunks per rank on the v placement.
Sends complete lazily, as in the executor (a rank waits for its receives only).
Pure Python; it imports no torch.
"""

from __future__ import annotations

import argparse
import math
import sys
from fractions import Fraction
from typing import Optional

from tricorn.parallel.pipeline.schedules import (
    SCHEDULES,
    V_SCHEDULES,
    Action,
    ScheduleError,
    check_schedule,
    placement_of,
    schedule_for,
)
from tricorn.parallel.pipeline.simulator import Costs, SimResult, simulate

_MAX_COLUMNS = 2000


def _cost(text: str) -> Fraction:
    try:
        value = Fraction(text).limit_denominator(1000)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"'{text}' is not a number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"costs cannot be negative, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tricorn schedule", description="Print a pipeline schedule grid and its bubble fraction.")
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks (default 4)")
    p.add_argument("--vpp", type=int, help="model chunks per rank, >1 for interleaved 1F1B (default 1; 2 for zbv, dualpipev)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per iteration (default 8)")
    p.add_argument("--schedule", choices=SCHEDULES, help="default: interleaved with --vpp > 1, else 1f1b")
    p.add_argument("--f", type=_cost, default=Fraction(1), help="time of one forward of one chunk (default 1)")
    p.add_argument("--b", type=_cost, default=Fraction(2), help="time of one backward of one chunk (default 2)")
    p.add_argument("--w", type=_cost, help="the weight-gradient part of --b, a W of zb-h1/zbv/dualpipev (default b/2)")
    p.add_argument("--p2p", type=_cost, default=Fraction(0), help="time of one P2P message (default 0)")
    p.add_argument("--actions", action="store_true", help="also print every rank's action list")
    return p


def _label(action: Action, vpp: int) -> str:
    return f"{action.kind.value}{action.microbatch}" + (chr(ord("a") + action.chunk) if vpp > 1 else "")


def _quantum(costs: Costs) -> Fraction:
    """Largest time step that divides every cost: all event times are sums of costs, so they fall on it."""
    values = [Fraction(c) for c in (costs.forward, costs.backward, costs.p2p, costs.w, costs.backward - costs.w) if c]
    if not values:
        return Fraction(0)
    denominator = math.lcm(*(v.denominator for v in values))
    return Fraction(math.gcd(*(int(v * denominator) for v in values)), denominator)


def render_grid(result: SimResult, vpp: int, costs: Costs) -> list[str]:
    """One line per rank; each column one quantum of time, a compute spanning several columns merged."""
    quantum = _quantum(costs)
    if not quantum or not result.makespan:
        return []
    columns = int(result.makespan / quantum)
    if columns > _MAX_COLUMNS:
        return [f"(grid of {columns} columns is too wide to print; use integer costs or fewer microbatches)"]
    width = max(len(_label(a, vpp)) for rank in result.timeline for (_, _, a) in rank) + 1
    lines = []
    for r, rank in enumerate(result.timeline):
        cells, col = [], 0
        for start, end, action in rank:
            first, last = int(start / quantum), int(end / quantum)
            cells += [".".ljust(width)] * (first - col)
            cells.append(_label(action, vpp).ljust(width * (last - first)))
            col = last
        cells += [".".ljust(width)] * (columns - col)
        lines.append(f"rank {r} | " + "".join(cells).rstrip())
    return lines


def _fmt(x: Fraction) -> str:
    x = Fraction(x)
    return f"{float(x):.4f}" + (f" ({x})" if x.denominator != 1 else "")


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.vpp is None:
        args.vpp = 2 if args.schedule in V_SCHEDULES else 1
    try:
        if args.pp < 1 or args.vpp < 1 or args.microbatches < 1:
            raise ScheduleError(
                f"--pp, --vpp and --microbatches must be at least 1, got {args.pp}, {args.vpp}, {args.microbatches}"
            )
        schedule = schedule_for(args.pp, args.vpp, args.microbatches, args.schedule)
    except ScheduleError as e:
        print(f"tricorn schedule: error: {e}", file=sys.stderr)
        return 2
    if args.w is not None and args.w > args.b:
        print(f"tricorn schedule: error: --w {args.w} cannot exceed --b {args.b} (W is part of the backward)", file=sys.stderr)
        return 2
    costs = Costs(args.f, args.b, args.p2p, args.w)
    placement = placement_of(args.schedule)
    result = simulate(schedule, args.pp, args.vpp, costs, placement, lazy_sends=True)
    problems = check_schedule(schedule, args.pp, args.vpp, args.microbatches, placement)
    name = args.schedule or ("interleaved" if args.vpp > 1 else "1f1b")
    print(
        f"{name}: pp={args.pp} vpp={args.vpp} microbatches={args.microbatches} "
        f"F={args.f} B={args.b} W={costs.w} P2P={args.p2p}; one column = one time quantum"
    )
    print("\n".join(render_grid(result, args.vpp, costs)))
    print(f"makespan {result.makespan}")
    for r in range(args.pp):
        print(
            f"rank {r}: bubble {_fmt(result.bubble_fraction[r])}, "
            f"idle {result.makespan - result.busy[r]}, peak activations held {result.peak_in_flight[r]} (microbatch x chunk)"
        )
    if args.actions:
        for r, actions in enumerate(schedule):
            print(f"rank {r} actions: " + " ".join(map(str, actions)))
    if result.deadlocked or result.mismatches or problems:
        print(result.report() if result.deadlocked or result.mismatches else "\n".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
