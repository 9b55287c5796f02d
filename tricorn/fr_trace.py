"""`tricorn fr-trace DIR`: where each rank is in its collectives, from the flight-recorder dumps of a hang.

The dumps are torch's (training/flight_recorder.py writes ``rank_<R>`` on a watchdog verdict; NCCL's own dump on
a timeout has the same layout). Per rank: the collective it is in (issued, not completed: what it waits for),
and its last completed one, each as group, sequence number and operation. Per process group: the members whose
last issued sequence number is below the others' hold the group up: one that waits on nobody (in no
collective) is the cause and is named with the last collective it issued ("behind:"); one waiting in a collective
is held up itself, and the members of that collective that have not issued it are named ("held up:"). A rank without a dump (dead, stopped, or holding the GIL) is said to be missing.

torch's own analyser reads the same directory: ``python -m torch.distributed.flight_recorder.fr_trace DIR -p
rank_`` (it matches every collective across ranks; this tool says where each rank stopped). Dumps are read
with an unpickler that builds plain Python values only (no code in a file from the cluster runs here).
No torch import, no collectives.
"""

from __future__ import annotations

import argparse
import pickle
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

_RANK_FILE = re.compile(r"(\d+)$")
_PLAIN = {("builtins", n) for n in ("dict", "list", "tuple", "set", "frozenset", "str", "bytes", "int", "float", "bool")}


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PLAIN:
            return getattr(__import__("builtins"), name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a flight-recorder dump")


@dataclass(frozen=True)
class Op:
    """One recorded collective of one rank."""

    group: str  # the process group's c10d name
    seq: int
    name: str  # all_reduce, _reduce_scatter_base, send, ...
    completed: bool
    p2p: bool

    def describe(self, label: str) -> str:
        return f"{self.name} #{self.seq} over {label}"


@dataclass
class RankDump:
    rank: int
    ops: list[Op]
    last_issued: dict[str, int]  # group -> last enqueued collective sequence number
    labels: dict[str, str]  # group -> "dp 0,2"
    members: dict[str, list[int]]  # group -> global ranks

    def in_flight(self) -> list[Op]:
        return [o for o in self.ops if not o.completed]

    def last_completed(self) -> Optional[Op]:
        done = [o for o in self.ops if o.completed]
        return done[-1] if done else None


def read_dump(path: Path) -> RankDump:
    with open(path, "rb") as fh:
        data = _PlainUnpickler(fh).load()
    match = _RANK_FILE.search(path.name)
    rank = int(data.get("tricorn_rank", match.group(1) if match else -1))
    status = data.get("pg_status") or {}  # keyed by the entries' pg_id (as text), not by the group's name
    ops, issued = [], {}
    for e in data.get("entries", []):
        group, seq, p2p = str(e["process_group"][0]), int(e["collective_seq_id"]), bool(e.get("is_p2p"))
        pg = status.get(str(e.get("pg_id")), {})
        done_upto = int(pg.get("last_completed_collective", -1))
        completed = e.get("state") == "completed" or bool(e.get("retired")) or (not p2p and seq <= done_upto)
        ops.append(Op(group, seq, str(e.get("profiling_name", "?")).split(":")[-1], completed, p2p))
        if not p2p:
            issued[group] = max(issued.get(group, -1), seq, int(pg.get("last_enqueued_collective", -1)))
    members = {}
    for name, cfg in (data.get("pg_config") or {}).items():
        try:
            members[str(name)] = [int(r) for r in re.findall(r"\d+", str(cfg.get("ranks", "")))]
        except (TypeError, AttributeError):
            continue
    labels = {str(k): str(v) for k, v in (data.get("tricorn_groups") or {}).items()}
    for name, cfg in (data.get("pg_config") or {}).items():
        if str(name) not in labels and members.get(str(name)):
            labels[str(name)] = f"{cfg.get('desc') or 'group ' + str(name)} {','.join(map(str, members[str(name)]))}"
    return RankDump(rank, ops, issued, labels, members)


def read_dir(directory: Path) -> dict[int, RankDump]:
    dumps = {}
    for path in sorted(p for p in directory.iterdir() if p.is_file() and _RANK_FILE.search(p.name) and ".tmp" not in p.name):
        try:
            d = read_dump(path)
        except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise SystemExit(f"tricorn: error: {path} is not a flight-recorder dump ({e})") from None
        dumps[d.rank] = d
    return dumps


def summarize(dumps: dict[int, RankDump], world_size: Optional[int] = None) -> list[str]:
    """The report's lines: one per rank, then the ranks that hold up each group."""
    labels: dict[str, str] = {}
    members: dict[str, set[int]] = {}
    for d in dumps.values():
        labels.update(d.labels)
        for g, ranks in d.members.items():
            members.setdefault(g, set()).update(ranks)
    label = lambda g: labels.get(g, f"group {g}")  # noqa: E731
    world = world_size or max([max(m) + 1 for m in members.values() if m] + [max(dumps) + 1 if dumps else 0])
    lines = [f"flight recorder: dumps of {len(dumps)} of {world} ranks"]
    for r in range(world):
        d = dumps.get(r)
        if d is None:
            lines.append(f"rank {r}: no dump (dead, stopped, or stuck holding the GIL)")
            continue
        waiting = d.in_flight()
        last = d.last_completed()
        parts = [f"waits in {', '.join(o.describe(label(o.group)) for o in waiting)}" if waiting else "in no collective"]
        parts.append(f"last completed {last.describe(label(last.group))}" if last else "no collective completed")
        lines.append(f"rank {r}: " + "; ".join(parts))
    behind: dict[int, list[str]] = {}
    for g, ranks in sorted(members.items()):
        issued = {r: dumps[r].last_issued.get(g, -1) for r in ranks if r in dumps}
        if len(issued) < 2 or len(set(issued.values())) < 2:
            continue
        top = max(issued.values())
        ahead = sorted(r for r, s in issued.items() if s == top)
        for r, s in sorted(issued.items()):
            if s < top:
                behind.setdefault(r, []).append(f"{label(g)} (at #{s}, ranks {','.join(map(str, ahead))} at #{top})")
    # A rank behind in a group is the cause when it waits on nobody; one that waits in a collective is held up
    # itself, by the members of that collective's group that have not issued it yet.
    for r, groups in sorted(behind.items()):
        waiting = [o for o in dumps[r].in_flight() if not o.p2p]
        if waiting:
            o = waiting[0]
            absent = sorted(m for m in members.get(o.group, ()) if m in dumps and dumps[m].last_issued.get(o.group, -1) < o.seq)
            absent += sorted(m for m in members.get(o.group, ()) if m not in dumps)
            lines.append(
                f"held up: rank {r} waits in {o.describe(label(o.group))} for rank(s) {','.join(map(str, absent)) or '?'}, "
                f"and so holds up {'; '.join(groups)}"
            )
            continue
        ops = [o for o in dumps[r].ops if not o.p2p]
        last = f"its last collective {ops[-1].describe(label(ops[-1].group))}, completed" if ops else "no collective recorded"
        lines.append(f"behind: rank {r} (in no collective; {last}) holds up {'; '.join(groups)}")
    if not behind:
        lines.append("behind: no rank is behind its groups (every member issued the same collectives)")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tricorn fr-trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="the directory of the dumps (--flight-recorder-dump-path)")
    parser.add_argument("--world-size", type=int, help="ranks in the job (default: the largest rank any group names, + 1)")
    args = parser.parse_args(argv)
    directory = Path(args.dir)
    if not directory.is_dir():
        print(f"tricorn: error: {directory} is not a directory of flight-recorder dumps", file=sys.stderr)
        return 2
    dumps = read_dir(directory)
    if not dumps:
        print(f"tricorn: error: no flight-recorder dumps (rank_<R>) in {directory}", file=sys.stderr)
        return 2
    print("\n".join(summarize(dumps, args.world_size)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
