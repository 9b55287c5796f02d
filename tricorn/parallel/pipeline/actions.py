"""The vocabulary of pipeline schedules: actions, their kinds, the stage placements and the message rules.

schedules.py builds the 1F1B, GPipe and interleaved lists from these and zero_bubble.py the ZB-H1, ZB-V
and DualPipeV ones; both import this module, so neither imports the other's generators (schedules.py's
``schedule_for`` dispatches to both). The contracts (placements, batching, FIFO matching) are in
schedules.py's docstring. No collectives and no device work.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class ScheduleError(ValueError):
    """A schedule that cannot be built for the given sizes; the message is one line for the user."""


class Kind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"  # the full backward, or only the input gradient where the schedule has a WEIGHT for it
    WEIGHT = "W"  # the deferred weight gradients of one (microbatch, chunk); no communication
    SEND_FORWARD = "SF"  # send this chunk's output activation to the next virtual stage
    RECV_FORWARD = "RF"  # receive this chunk's input activation from the previous virtual stage
    SEND_BACKWARD = "SB"  # send the gradient of this chunk's input to the previous virtual stage
    RECV_BACKWARD = "RB"  # receive the gradient of this chunk's output from the next virtual stage

    @property
    def is_compute(self) -> bool:
        return self in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT)

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_FORWARD, Kind.SEND_BACKWARD)


@dataclass(frozen=True)
class Action:
    """One entry of a rank's schedule. ``chunk`` is the model chunk on THIS rank (0 without interleaving)."""

    kind: Kind
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind.value}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


FORWARD, BACKWARD, WEIGHT = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT
SEND_FORWARD, RECV_FORWARD = Kind.SEND_FORWARD, Kind.RECV_FORWARD
SEND_BACKWARD, RECV_BACKWARD = Kind.SEND_BACKWARD, Kind.RECV_BACKWARD

SCHEDULES = ("1f1b", "gpipe", "interleaved", "forward-only", "zb-h1", "zbv", "dualpipev")
ZERO_BUBBLE = ("zb-h1", "zbv", "dualpipev")  # the schedules with WEIGHT actions
LOOP, V = "loop", "v"  # stage-to-rank placements
V_SCHEDULES = ("zbv", "dualpipev")  # the schedules that run on the v placement, 2 chunks per rank


def placement_of(kind: Optional[str]) -> str:
    """The stage-to-rank placement a schedule runs on."""
    return V if kind in V_SCHEDULES else LOOP


# Order of communication actions inside one batched step. Keeping one fixed order on
# every rank makes the per-pair FIFO matching hold when two messages of different kinds
# travel between the same two ranks in one step (pp=2 with interleaving).
_COMM_ORDER = {SEND_FORWARD: 0, RECV_FORWARD: 1, SEND_BACKWARD: 2, RECV_BACKWARD: 3}


# ------------------------------------------------------------------ virtual stages


def virtual_stage(rank: int, chunk: int, pp: int, placement: str = LOOP) -> int:
    if placement == V:
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def stage_owner(stage: int, pp: int, placement: str = LOOP) -> tuple[int, int]:
    """(rank, chunk) holding a virtual stage: the inverse of :func:`virtual_stage`."""
    if placement == V:
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp


def next_stage(rank: int, chunk: int, pp: int, vpp: int, placement: str = LOOP) -> Optional[tuple[int, int]]:
    """(rank, chunk) of the virtual stage after (rank, chunk), or None on the last one."""
    vs = virtual_stage(rank, chunk, pp, placement) + 1
    return None if vs >= pp * vpp else stage_owner(vs, pp, placement)


def prev_stage(rank: int, chunk: int, pp: int, vpp: int, placement: str = LOOP) -> Optional[tuple[int, int]]:
    """(rank, chunk) of the virtual stage before (rank, chunk), or None on the first one."""
    vs = virtual_stage(rank, chunk, pp, placement) - 1
    return None if vs < 0 else stage_owner(vs, pp, placement)


def is_first_stage(rank: int, chunk: int) -> bool:
    """This chunk embeds the tokens (virtual stage 0, chunk 0 of rank 0 in both placements)."""
    return rank == 0 and chunk == 0


def is_last_stage(rank: int, chunk: int, pp: int, vpp: int, placement: str = LOOP) -> bool:
    """This chunk holds the final norm, the head and the loss."""
    return virtual_stage(rank, chunk, pp, placement) == pp * vpp - 1


def is_local_edge(rank: int, chunk: int, pp: int, vpp: int, placement: str, towards_next: bool) -> bool:
    """The neighbour stage of (rank, chunk) in that direction is on the same rank (the tip of the V): no message."""
    peer = (next_stage if towards_next else prev_stage)(rank, chunk, pp, vpp, placement)
    return peer is not None and peer[0] == rank


_MATCH = {SEND_FORWARD: RECV_FORWARD, RECV_FORWARD: SEND_FORWARD, SEND_BACKWARD: RECV_BACKWARD, RECV_BACKWARD: SEND_BACKWARD}


def counterpart(action: Action, rank: int, pp: int, vpp: int, placement: str = LOOP) -> tuple[int, Action]:
    """(peer rank, the action the peer must post) for a communication action on ``rank``."""
    towards_next = action.kind in (SEND_FORWARD, RECV_BACKWARD)
    peer = (next_stage if towards_next else prev_stage)(rank, action.chunk, pp, vpp, placement)
    if peer is None:
        where = "last" if towards_next else "first"
        raise ScheduleError(f"rank {rank} action {action} has no peer: chunk {action.chunk} is the {where} virtual stage")
    return peer[0], Action(_MATCH[action.kind], action.microbatch, peer[1])


def group_steps(actions: list[Action]) -> list[tuple[Action, ...]]:
    """Split a rank's list into steps: each compute action alone, each run of communication actions together.

    The executor issues one ``batch_isend_irecv`` per communication step and waits for it.
    """
    steps: list[tuple[Action, ...]] = []
    comm: list[Action] = []
    for a in actions:
        if a.kind.is_compute:
            if comm:
                steps.append(tuple(comm))
                comm = []
            steps.append((a,))
        else:
            comm.append(a)
    if comm:
        steps.append(tuple(comm))
    return steps


# ------------------------------------------------------------------ building lists


def _with_comms(rank: int, pp: int, vpp: int, steps: list[list[Action]], placement: str = LOOP) -> list[Action]:
    """Insert sends after the compute step producing them and recvs before the step consuming them.

    WEIGHT actions communicate nothing, and neither does an edge between two chunks of one rank (v placement).
    """
    out: list[Action] = []
    sends: list[Action] = []

    def remote(a: Action, towards_next: bool) -> bool:
        edge = (next_stage if towards_next else prev_stage)(rank, a.chunk, pp, vpp, placement)
        return edge is not None and edge[0] != rank

    for step in steps:
        recvs = []
        for a in step:
            if a.kind is FORWARD and remote(a, towards_next=False):
                recvs.append(Action(RECV_FORWARD, a.microbatch, a.chunk))
            elif a.kind is BACKWARD and remote(a, towards_next=True):
                recvs.append(Action(RECV_BACKWARD, a.microbatch, a.chunk))
        out += sorted(sends + recvs, key=lambda a: _COMM_ORDER[a.kind])
        out += step
        sends = []
        for a in step:
            if a.kind is FORWARD and remote(a, towards_next=True):
                sends.append(Action(SEND_FORWARD, a.microbatch, a.chunk))
            elif a.kind is BACKWARD and remote(a, towards_next=False):
                sends.append(Action(SEND_BACKWARD, a.microbatch, a.chunk))
    out += sorted(sends, key=lambda a: _COMM_ORDER[a.kind])
    return out


def _check_sizes(pp: int, num_microbatches: int, vpp: int = 1) -> None:
    if pp < 1:
        raise ScheduleError(f"pipeline size must be at least 1, got {pp}")
    if num_microbatches < 1:
        raise ScheduleError(f"number of microbatches must be at least 1, got {num_microbatches}")
    if vpp < 1:
        raise ScheduleError(f"virtual stages per rank must be at least 1, got {vpp}")
