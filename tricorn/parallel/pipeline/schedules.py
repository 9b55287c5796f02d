"""Pipeline schedules as data: for every pipeline rank, the ordered list of actions it runs.

An :class:`Action` is a forward or backward of one microbatch on one model chunk, or one
point-to-point message (send/recv of an activation or of a gradient). The trainer's
executor runs a rank's list in order, the simulator (``simulator.py``) runs all lists
together to find deadlocks and measure the bubble, and ``tricorn schedule`` draws them.

Virtual stages: with the ``loop`` placement (Megatron's numbering) model chunk ``c`` on
pipeline rank ``r`` is virtual stage ``c * pp + r``; with the ``v`` placement (ZB-V,
DualPipeV: 2 chunks per rank) rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``, so rank 0
holds both the first and the last stage and rank ``pp - 1`` passes stage ``pp - 1``'s output
to its own next chunk without a message. Activations flow from virtual stage ``s`` to
``s + 1``, gradients flow back. The peer of a send/recv is implied by its kind, chunk and
the placement (see :func:`counterpart`).

Zero-bubble schedules (``zero_bubble.py``) split a backward in two actions: ``B`` (the input
gradient, on the critical path) and ``W`` (the weight gradients, deferred to fill bubbles).
A schedule without ``W`` actions runs the full backward in ``B``.

Communication contract with the executor:

* Every maximal run of consecutive communication actions in a rank's list is ONE step:
  the executor posts all of them in list order as a single ``batch_isend_irecv`` call and
  waits for all of them before the next compute action (:func:`group_steps`).
* Messages between a pair of ranks are matched in posting order (NCCL has no tags), and
  the schedules are built so that the k-th send from rank a to rank b is the k-th recv on
  b from a; the simulator checks this.
* A recv is placed in the communication step right before the compute step that consumes
  it; a send right after the compute step that produced it. In the interleaved steady
  state a compute step is a forward followed by a backward (Megatron's
  ``send_forward_backward_recv_forward_backward``), elsewhere a single action. Under the
  rendezvous model (a send completes only once its recv is posted, and vice versa) these
  lists never deadlock; tests check this by simulation for pp 1..8.

No collectives and no device work happen here; lists have O(microbatches x chunks) entries.
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


def forward_only_schedule(pp: int, num_microbatches: int) -> list[list[Action]]:
    """Evaluation: each rank runs every microbatch forward, in order."""
    _check_sizes(pp, num_microbatches)
    return [_with_comms(r, pp, 1, [[Action(FORWARD, i)] for i in range(num_microbatches)]) for r in range(pp)]


def gpipe_schedule(pp: int, num_microbatches: int) -> list[list[Action]]:
    """All forwards, then all backwards: every rank holds the activations of all microbatches."""
    _check_sizes(pp, num_microbatches)
    m = num_microbatches
    steps = [[Action(FORWARD, i)] for i in range(m)] + [[Action(BACKWARD, i)] for i in range(m)]
    return [_with_comms(r, pp, 1, steps) for r in range(pp)]


def one_f_one_b_schedule(pp: int, num_microbatches: int) -> list[list[Action]]:
    """PipeDream-flush: ``pp - rank - 1`` warm-up forwards, alternating forward/backward, then cool-down backwards.

    Rank r holds at most ``pp - r`` microbatches of activations.
    """
    _check_sizes(pp, num_microbatches)
    m = num_microbatches
    out = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        steps = [[Action(FORWARD, i)] for i in range(warmup)]
        for k in range(m - warmup):
            steps += [[Action(FORWARD, warmup + k)], [Action(BACKWARD, k)]]
        steps += [[Action(BACKWARD, k)] for k in range(m - warmup, m)]
        out.append(_with_comms(r, pp, 1, steps))
    return out


def interleaved_order(pp: int, vpp: int, k: int, forward: bool) -> tuple[int, int]:
    """(microbatch, chunk) of the k-th forward (or backward) on a rank, in Megatron's interleaved order.

    Microbatches go through chunk 0 in groups of ``pp``, then the same group through chunk 1, ...;
    backwards visit the chunks in reverse.
    """
    group, in_group = divmod(k, pp * vpp)
    chunk = in_group // pp
    if not forward:
        chunk = vpp - 1 - chunk
    return group * pp + in_group % pp, chunk


def check_interleaving(pp: int, vpp: int, num_microbatches: int) -> None:
    """Raise ScheduleError unless the interleaved schedule can run these sizes."""
    _check_sizes(pp, num_microbatches, vpp)
    if pp < 2:
        raise ScheduleError(f"the interleaved schedule needs a pipeline size of at least 2, got {pp} (with {vpp} chunks)")
    if num_microbatches % pp != 0:
        raise ScheduleError(
            f"the interleaved schedule needs the number of microbatches divisible by the pipeline size: "
            f"{num_microbatches} microbatches is not a multiple of pp {pp}; use {num_microbatches - num_microbatches % pp or pp} "
            f"or {num_microbatches + pp - num_microbatches % pp}"
        )


def interleaved_schedule(pp: int, vpp: int, num_microbatches: int, forward_only: bool = False) -> list[list[Action]]:
    """Megatron's interleaved 1F1B with ``vpp`` model chunks per rank (needs num_microbatches % pp == 0).

    Warm-up is ``2 * (pp - rank - 1) + (vpp - 1) * pp`` forwards (all of them when
    num_microbatches == pp), then steady steps of one forward and one backward, then cool-down.
    """
    check_interleaving(pp, vpp, num_microbatches)
    total = num_microbatches * vpp
    out = []
    for r in range(pp):
        if forward_only or num_microbatches == pp:
            warmup = total
        else:
            warmup = min(2 * (pp - r - 1) + (vpp - 1) * pp, total)
        fwd = [Action(FORWARD, *interleaved_order(pp, vpp, k, True)) for k in range(total)]
        bwd = [] if forward_only else [Action(BACKWARD, *interleaved_order(pp, vpp, k, False)) for k in range(total)]
        steps = [[a] for a in fwd[:warmup]]
        steps += [[fwd[warmup + k], bwd[k]] for k in range(total - warmup) if bwd]
        steps += [[a] for a in bwd[total - warmup :]] if bwd else []
        out.append(_with_comms(r, pp, vpp, steps))
    return out


def forward_only_v_schedule(pp: int, num_microbatches: int) -> list[list[Action]]:
    """Evaluation on the v placement: every microbatch down the V (chunk 0), then back up (chunk 1)."""
    _check_sizes(pp, num_microbatches)
    steps = [[Action(FORWARD, i, c)] for c in (0, 1) for i in range(num_microbatches)]
    return [_with_comms(r, pp, 2, steps, V) for r in range(pp)]


def schedule_for(
    pp: int, vpp: int, num_microbatches: int, kind: Optional[str] = None, forward_only: bool = False
) -> list[list[Action]]:
    """The action lists the executor runs: ``kind`` is one of ``SCHEDULES``.

    ``kind=None`` picks interleaved when ``vpp > 1`` and 1F1B otherwise (Megatron's rule);
    ``forward_only=True`` gives the evaluation schedule for the same layout (for zbv and
    dualpipev on their v placement).
    """
    if kind is None:
        kind = "interleaved" if vpp > 1 else "1f1b"
    if kind not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule '{kind}'; choose one of {', '.join(SCHEDULES)}")
    if kind in V_SCHEDULES:
        from tricorn.parallel.pipeline.zero_bubble import dualpipev_schedule, zbv_schedule

        if vpp != 2 or pp < 2:
            raise ScheduleError(
                f"the {kind} schedule runs 2 model chunks on each of at least 2 ranks, got {vpp} chunks on pp {pp}"
            )
        if forward_only:
            return forward_only_v_schedule(pp, num_microbatches)
        return (zbv_schedule if kind == "zbv" else dualpipev_schedule)(pp, num_microbatches)
    if kind == "forward-only":
        forward_only = True
    if vpp > 1:
        if kind in ("1f1b", "gpipe", "zb-h1"):
            raise ScheduleError(f"the {kind} schedule runs one model chunk per rank; with {vpp} virtual stages use interleaved")
        return interleaved_schedule(pp, vpp, num_microbatches, forward_only=forward_only)
    if kind == "interleaved":
        raise ScheduleError("the interleaved schedule needs at least 2 virtual stages per pipeline rank")
    if forward_only:
        return forward_only_schedule(pp, num_microbatches)
    if kind == "zb-h1":
        from tricorn.parallel.pipeline.zero_bubble import zb_h1_schedule

        return zb_h1_schedule(pp, num_microbatches)
    return gpipe_schedule(pp, num_microbatches) if kind == "gpipe" else one_f_one_b_schedule(pp, num_microbatches)


def check_schedule(schedule: list[list[Action]], pp: int, vpp: int, num_microbatches: int, placement: str = LOOP) -> list[str]:
    """Local well-formedness, one line per problem: every (microbatch, chunk) forward once (backward once or
    never on every rank; a W never, or once after its B), each recv before the compute that consumes it, each
    send after the compute that makes it, and across a same-rank edge (v placement) producer before consumer."""
    errs: list[str] = []
    if len(schedule) != pp:
        return [f"schedule has {len(schedule)} rank lists, expected {pp}"]
    expected = {(i, c) for i in range(num_microbatches) for c in range(vpp)}
    has_backward = any(a.kind is BACKWARD for actions in schedule for a in actions)
    for r, actions in enumerate(schedule):
        seen: dict[tuple[Kind, int, int], int] = {}
        for pos, a in enumerate(actions):
            key = (a.kind, a.microbatch, a.chunk)
            if key in seen:
                errs.append(f"rank {r}: {a} appears twice (positions {seen[key]} and {pos})")
            seen[key] = pos
        for kind in (FORWARD, BACKWARD) if has_backward else (FORWARD,):
            done = {(mb, c) for (k, mb, c) in seen if k is kind}
            if done != expected:
                missing = sorted(expected - done)[:4]
                extra = sorted(done - expected)[:4]
                errs.append(f"rank {r}: {kind.name} set is wrong (missing {missing}, unexpected {extra})")
        weights = {(mb, c) for (k, mb, c) in seen if k is WEIGHT}
        if weights and weights != expected:
            errs.append(f"rank {r}: WEIGHT set is wrong (missing {sorted(expected - weights)[:4]})")
        for (k, mb, c), pos in seen.items():
            before: list[tuple[Kind, int, int]] = {BACKWARD: [(FORWARD, mb, c)], WEIGHT: [(BACKWARD, mb, c)]}.get(k, [])
            prev = prev_stage(r, c, pp, vpp, placement)
            nxt = next_stage(r, c, pp, vpp, placement)
            if k is FORWARD and prev is not None:
                before = [(RECV_FORWARD, mb, c) if prev[0] != r else (FORWARD, mb, prev[1])]
            if k is BACKWARD and nxt is not None:
                before = [(FORWARD, mb, c), (RECV_BACKWARD, mb, c) if nxt[0] != r else (BACKWARD, mb, nxt[1])]
            after = {SEND_FORWARD: FORWARD, SEND_BACKWARD: BACKWARD}.get(k)
            for need in before:
                if seen.get(need, len(actions)) > pos:
                    errs.append(f"rank {r}: {Action(k, mb, c)} at position {pos} comes before {Action(*need)}")
            if after is not None and seen.get((after, mb, c), len(actions)) > pos:
                errs.append(f"rank {r}: {Action(k, mb, c)} at position {pos} comes before {Action(after, mb, c)}")
    return errs


def sends_done_by(
    schedule: list[list[Action]], rank: int, pp: int, vpp: int, placement: str = LOOP
) -> dict[Action, list[Action]]:
    """For each recv of ``rank``: its earlier sends that are certainly complete once that recv completes.

    A send to peer q is done once q completed the matching recv; q completes a step's recvs before it goes
    on, so every send of ours matched by a recv in a step of q before the step in which q posts the send we
    are receiving is done by then. The executor waits for those (at once: they are complete) and so frees
    the buffers of its lazy sends without ever waiting on a peer. Messages match per channel in order."""

    def channel(a: Action, r: int) -> tuple[int, int, bool]:
        peer, _ = counterpart(a, r, pp, vpp, placement)
        src, dst = (r, peer) if a.kind.is_send else (peer, r)
        return src, dst, placement == V and a.kind in (SEND_BACKWARD, RECV_BACKWARD)

    step_of: dict[tuple, list[int]] = {}  # (channel, "send"|"recv") -> step index of each message, in order
    for r, actions in enumerate(schedule):
        for i, step in enumerate(group_steps(actions)):
            for a in step:
                if not a.kind.is_compute:
                    step_of.setdefault((channel(a, r), a.kind.is_send), []).append(i)
    mine = [a for a in schedule[rank] if not a.kind.is_compute]
    count: dict[tuple, int] = {}
    sent: list[tuple[Action, tuple, int]] = []  # (send, channel, its index on the channel)
    out: dict[Action, list[Action]] = {}
    for a in mine:
        ch = channel(a, rank)
        k = count.get((ch, a.kind.is_send), 0)
        count[(ch, a.kind.is_send)] = k + 1
        if a.kind.is_send:
            sent.append((a, ch, k))
            continue
        peer = ch[0]
        posted_at = step_of[(ch, True)][k]  # the peer's step that sends this message
        done = [s for s, sch, j in sent if sch[1] == peer and step_of[(sch, False)][j] < posted_at]
        sent = [x for x in sent if x[0] not in done]
        out[a] = done
    return out
