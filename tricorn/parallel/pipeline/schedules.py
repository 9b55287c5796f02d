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

from typing import Optional

from tricorn.parallel.pipeline.actions import (  # noqa: F401 - the vocabulary, re-exported
    _COMM_ORDER,
    _MATCH,
    BACKWARD,
    FORWARD,
    LOOP,
    RECV_BACKWARD,
    RECV_FORWARD,
    SCHEDULES,
    SEND_BACKWARD,
    SEND_FORWARD,
    V_SCHEDULES,
    WEIGHT,
    ZERO_BUBBLE,
    Action,
    Kind,
    ScheduleError,
    V,
    _check_sizes,
    _with_comms,
    counterpart,
    group_steps,
    is_first_stage,
    is_last_stage,
    is_local_edge,
    next_stage,
    placement_of,
    prev_stage,
    stage_owner,
    virtual_stage,
)
from tricorn.parallel.pipeline.zero_bubble import dualpipev_schedule, zb_h1_schedule, zbv_schedule


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
