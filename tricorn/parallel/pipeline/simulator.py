"""Discrete-event simulation of pipeline schedules: makespan, bubble, activations in flight, deadlocks.

Each rank runs its action list (``schedules.py``) in order. A compute action takes
``Costs.forward`` or ``Costs.backward``; where the schedule splits a backward (a ``W``
action for the same microbatch and chunk), ``B`` takes ``backward - weight`` and ``W``
takes ``Costs.weight``. A (microbatch, chunk) is in flight from its forward to its last
backward action (its W where there is one: the saved inputs live until then). A communication step (a maximal run of send/recv
actions, which the executor issues as one ``batch_isend_irecv``) is posted when the rank
reaches it and completes when every one of its messages can complete; a message completes
``Costs.p2p`` after both its send and its recv are posted (rendezvous: a send does not
complete before the peer posted the recv, as with NCCL). Messages between a pair of ranks
match in posting order; a send matched to a recv for a different tensor is reported in
``SimResult.mismatches``.

The simulation never hangs: when no rank can move, it stops and reports which posted
actions wait for which counterpart on which rank (``SimResult.deadlock``).

Times are kept in the number type of the costs: integer or Fraction costs give exact
makespans and bubble fractions (Fractions), floats give floats. Pure Python, no torch;
cost is linear in the number of actions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Optional, Union

from tricorn.parallel.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    LOOP,
    RECV_BACKWARD,
    RECV_FORWARD,
    SEND_BACKWARD,
    SEND_FORWARD,
    WEIGHT,
    Action,
    ScheduleError,
    V,
    counterpart,
    group_steps,
    next_stage,
    prev_stage,
    virtual_stage,
)

Number = Union[int, float, Fraction]


@dataclass(frozen=True)
class Costs:
    """Time of one forward / backward of one microbatch on one model chunk, and of one P2P message."""

    forward: Number = 1
    backward: Number = 2  # the whole backward: input and weight gradients
    p2p: Number = 0
    weight: Optional[Number] = None  # the weight-gradient part of ``backward`` (W); default half of it

    @property
    def w(self) -> Number:
        if self.weight is not None:
            return self.weight
        return Fraction(self.backward) / 2 if isinstance(self.backward, (int, Fraction)) else self.backward / 2


@dataclass(frozen=True)
class Wait:
    """A posted communication action that cannot complete: its counterpart was never posted."""

    rank: int
    action: Action
    peer: int
    expected: Action  # what the peer would have to post
    peer_blocked_at: Optional[tuple[Action, ...]]  # the peer's stuck step, None if the peer finished its list

    def __str__(self) -> str:
        where = (
            "has finished its list"
            if self.peer_blocked_at is None
            else "is blocked at [" + " ".join(map(str, self.peer_blocked_at)) + "]"
        )
        return f"rank {self.rank} {self.action} waits for rank {self.peer} to post {self.expected}; rank {self.peer} {where}"


@dataclass
class SimResult:
    makespan: Number
    busy: list[Number]  # compute time per rank
    bubble_fraction: list[Number]  # (makespan - busy) / makespan per rank
    peak_in_flight: list[int]  # most (microbatch, chunk) pairs with forward done and last backward action not yet
    timeline: list[list[tuple[Number, Number, Action]]]  # (start, end, action) of compute actions per rank
    order: list[list[Action]]  # actions each rank completed, in order
    deadlock: list[Wait] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)

    @property
    def deadlocked(self) -> bool:
        return bool(self.deadlock)

    def report(self) -> str:
        """Human summary; the deadlock or mismatch details when there are any."""
        if self.deadlock:
            return "deadlock:\n" + "\n".join(f"  {w}" for w in self.deadlock)
        if self.mismatches:
            return "message order mismatch:\n" + "\n".join(f"  {m}" for m in self.mismatches)
        return f"ok: makespan {self.makespan}"


def _ratio(a: Number, b: Number) -> Number:
    if b == 0:
        return 0
    if isinstance(a, (int, Fraction)) and isinstance(b, (int, Fraction)):
        return Fraction(a) / Fraction(b)
    return a / b


def _message_id(action: Action, rank: int, pp: int, vpp: int, placement: str) -> tuple[str, int, int]:
    """(direction, microbatch, receiving virtual stage): the tensor a send or recv carries."""
    if action.kind in (SEND_FORWARD, RECV_FORWARD):
        dst = next_stage(rank, action.chunk, pp, vpp, placement) if action.kind is SEND_FORWARD else (rank, action.chunk)
        direction = "activation"
    else:
        dst = prev_stage(rank, action.chunk, pp, vpp, placement) if action.kind.is_send else (rank, action.chunk)
        direction = "gradient"
    assert dst is not None
    return direction, action.microbatch, virtual_stage(dst[0], dst[1], pp, placement)


class _Channel:
    """Posted sends and recvs between one ordered pair of ranks, matched by posting order."""

    __slots__ = ("sends", "recvs")

    def __init__(self) -> None:
        self.sends: list[tuple[Number, Action, int]] = []  # (post time, action, rank)
        self.recvs: list[tuple[Number, Action, int]] = []


def simulate(
    schedule: list[list[Action]],
    pp: int,
    vpp: int = 1,
    costs: Costs = Costs(),
    placement: str = LOOP,
    lazy_sends: bool = False,
) -> SimResult:
    """Run all ranks' lists together; see the module docstring for the timing model.

    ``lazy_sends`` is the executor's P2P overlap: a rank waits for the recvs of a step only, never for its
    sends (a recv still completes ``p2p`` after its send was posted)."""
    if len(schedule) != pp:
        raise ScheduleError(f"schedule has {len(schedule)} rank lists but the pipeline size is {pp}")
    steps = [group_steps(actions) for actions in schedule]
    # Resolve every communication action's peer up front (also rejects actions without a peer).
    peers: dict[tuple[int, Action], int] = {}
    for r, actions in enumerate(schedule):
        for a in actions:
            if not a.kind.is_compute:
                peer, _ = counterpart(a, r, pp, vpp, placement)
                if peer == r:
                    raise ScheduleError(f"rank {r} action {a} would message itself; interleaving needs pp >= 2")
                peers[(r, a)] = peer
    backward_of = [{(a.microbatch, a.chunk) for a in actions if a.kind is BACKWARD} for actions in schedule]
    weight_of = [{(a.microbatch, a.chunk) for a in actions if a.kind is WEIGHT} for actions in schedule]
    split_backward = costs.backward - costs.w

    zero: Number = 0 * costs.forward
    clock: list[Number] = [zero] * pp
    pc = [0] * pp
    posted: list[Optional[list[tuple[list, int]]]] = [None] * pp  # per op of the current comm step: (other side list, index)
    busy: list[Number] = [zero] * pp
    held: list[set] = [set() for _ in range(pp)]
    peak = [0] * pp
    timeline: list[list[tuple[Number, Number, Action]]] = [[] for _ in range(pp)]
    order: list[list[Action]] = [[] for _ in range(pp)]
    # On the v placement gradients travel on a group of their own (p2p.py): a pair of ranks then carries
    # two independent FIFO channels, one per direction of the message.
    channels: dict[tuple[int, int, bool], _Channel] = {}
    mismatches: list[str] = []

    def post(r: int, step: tuple[Action, ...]) -> list[int]:
        """Post a comm step's actions; return the peers to wake."""
        refs = []
        woken = []
        for a in step:
            peer = peers[(r, a)]
            src, dst = (r, peer) if a.kind.is_send else (peer, r)
            gradient = placement == V and a.kind in (SEND_BACKWARD, RECV_BACKWARD)
            ch = channels.setdefault((src, dst, gradient), _Channel())
            mine, other = (ch.sends, ch.recvs) if a.kind.is_send else (ch.recvs, ch.sends)
            idx = len(mine)
            mine.append((clock[r], a, r))
            if idx < len(other):
                o_time, o_action, o_rank = other[idx]
                if _message_id(a, r, pp, vpp, placement) != _message_id(o_action, o_rank, pp, vpp, placement):
                    mismatches.append(
                        f"message {idx} from rank {src} to rank {dst}: rank {r} posted {a} but rank {o_rank} posted {o_action}"
                    )
            refs.append((other, idx))
            woken.append(peer)
        posted[r] = refs
        return woken

    def advance(r: int) -> list[int]:
        woken: list[int] = []
        rank_steps = steps[r]
        while pc[r] < len(rank_steps):
            step = rank_steps[pc[r]]
            first = step[0]
            if first.kind.is_compute:
                key = (first.microbatch, first.chunk)
                split = key in weight_of[r]
                if first.kind is FORWARD:
                    cost = costs.forward
                elif first.kind is WEIGHT:
                    cost = costs.w
                else:
                    cost = split_backward if split else costs.backward
                start = clock[r]
                clock[r] = start + cost
                busy[r] += cost
                timeline[r].append((start, clock[r], first))
                if first.kind is FORWARD:
                    if key in backward_of[r]:
                        held[r].add(key)
                        peak[r] = max(peak[r], len(held[r]))
                elif first.kind is WEIGHT or not split:
                    held[r].discard(key)
                order[r].append(first)
                pc[r] += 1
                continue
            if posted[r] is None:
                woken += post(r, step)
            refs = posted[r]
            assert refs is not None
            # With lazy sends only the recvs of a step are waited for (a send completes in the background).
            waited = [ref for a, ref in zip(step, refs) if not (lazy_sends and a.kind.is_send)]
            if any(idx >= len(other) for other, idx in waited):
                return woken  # blocked until a peer posts
            done = clock[r]
            for other, idx in waited:
                done = max(done, other[idx][0] + costs.p2p, clock[r] + costs.p2p)
            clock[r] = done
            order[r].extend(step)
            posted[r] = None
            pc[r] += 1
        return woken

    queue = deque(range(pp))
    queued = [True] * pp
    while queue:
        r = queue.popleft()
        queued[r] = False
        for peer in advance(r):
            if not queued[peer]:
                queued[peer] = True
                queue.append(peer)

    deadlock = _deadlock_report(steps, pc, posted, pp, vpp, placement, lazy_sends)
    makespan = max(clock) if pp else zero
    return SimResult(
        makespan=makespan,
        busy=busy,
        bubble_fraction=[_ratio(makespan - b, makespan) for b in busy],
        peak_in_flight=peak,
        timeline=timeline,
        order=order,
        deadlock=deadlock,
        mismatches=mismatches,
    )


def _deadlock_report(steps, pc, posted, pp: int, vpp: int, placement: str, lazy_sends: bool) -> list[Wait]:
    waits: list[Wait] = []
    for r in range(pp):
        if pc[r] >= len(steps[r]):
            continue
        step = steps[r][pc[r]]
        for a, (other, idx) in zip(step, posted[r]):
            if idx < len(other) or (lazy_sends and a.kind.is_send):
                continue
            peer, expected = counterpart(a, r, pp, vpp, placement)
            blocked = steps[peer][pc[peer]] if pc[peer] < len(steps[peer]) else None
            waits.append(Wait(r, a, peer, expected, blocked))
    return waits
