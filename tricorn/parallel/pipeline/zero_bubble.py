"""Zero-bubble pipeline schedules as data: ZB-H1, ZB-V and DualPipeV.

Each splits a backward into ``B`` (the input gradient, which the previous stage waits for)
and ``W`` (the weight gradients, which nobody waits for) and places the W's where 1F1B
would idle (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024). The lists are
built from compute actions only; ``schedules._with_comms`` adds the sends and recvs.

* ``zb-h1`` (1 chunk per rank, loop placement, m >= pp): 1F1B's order, but rank ``r``
  holds back its first ``r`` W's, so every rank keeps ``pp`` microbatches in flight (1F1B's
  rank 0 figure) and the bubble falls to ``(pp - 1)(T_F + T_B - T_W)``.
* ``zbv`` (2 chunks per rank, v placement): rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``;
  warm-up forwards down the V, then F/B/W of both chunks in turn, W's deferred in the
  cool-down. With T_F = T_B = T_W a rank never idles inside its active span.
* ``dualpipev`` (2 chunks per rank, v placement, m >= 2 pp): DeepSeek's DualPipe cut in half.
  Its steady state pairs one microbatch's forward on one chunk with another's backward on
  the other chunk (a GPU overlaps their compute with the other's communication; here they
  run one after the other), and only part of the backwards are split (a full backward is a
  ``B`` followed at once by its ``W``).

A W always follows its own B on the same rank; W's of one chunk run in microbatch order, so
the last W of a chunk is its last gradient-writing action (the data-parallel reduction of
the chunk starts there). No torch; lists have O(microbatches) entries.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from tricorn.parallel.pipeline.actions import BACKWARD, FORWARD, WEIGHT, Action, ScheduleError, V, _check_sizes, _with_comms


def _steps(actions: list[Action]) -> list[list[Action]]:
    return [[a] for a in actions]


def zb_h1_schedule(pp: int, num_microbatches: int) -> list[list[Action]]:
    """1F1B with the first ``rank`` W's of each rank deferred to its cool-down."""
    _check_sizes(pp, num_microbatches)
    m = num_microbatches
    if m < pp:
        raise ScheduleError(f"the zb-h1 schedule needs at least as many microbatches as pipeline ranks: {m} < pp {pp}")
    out = []
    for r in range(pp):
        warmup = pp - r - 1
        order = [Action(FORWARD, i) for i in range(warmup)]
        waiting: deque[int] = deque()  # microbatches whose B ran and whose W did not
        for k in range(m):
            if warmup + k < m:
                order.append(Action(FORWARD, warmup + k))
            order.append(Action(BACKWARD, k))
            waiting.append(k)
            if len(waiting) > r:
                order.append(Action(WEIGHT, waiting.popleft()))
        order += [Action(WEIGHT, k) for k in waiting]
        out.append(_with_comms(r, pp, 1, _steps(order)))
    return out


class _Counters:
    """The next microbatch of each (kind, chunk) on one rank, and the queue of deferred W's."""

    def __init__(self, m: int):
        self.m = m
        self.next: dict[tuple, int] = {}
        self.deferred: deque[Action] = deque()
        self.order: list[Action] = []

    def add(self, kind, chunk: int, split: bool = True) -> Optional[Action]:
        """Append the next ``kind`` of ``chunk``; an unsplit backward is its B and at once its W.

        A split backward's W is returned and queued in ``deferred``; None past the last microbatch."""
        i = self.next.get((kind, chunk), 0)
        self.next[(kind, chunk)] = i + 1
        if i >= self.m:
            return None  # past the last microbatch (zbv builds lists for at least 2 pp - 1 of them)
        self.order.append(Action(kind, i, chunk))
        if kind is not BACKWARD:
            return None
        w = Action(WEIGHT, i, chunk)
        if split:
            self.deferred.append(w)
            return w
        self.order.append(w)
        return None

    def weight(self) -> None:
        """Run the oldest deferred W, if any."""
        if self.deferred:
            self.order.append(self.deferred.popleft())


def zbv_schedule(pp: int, num_microbatches: int) -> list[list[Action]]:
    """ZB-V on 2 chunks per rank (v placement): the order of torch's ``ScheduleZBVZeroBubble``."""
    _check_sizes(pp, num_microbatches)
    m = max(num_microbatches, 2 * pp - 1)  # the lists of the full pipeline; actions past the last microbatch dropped
    out = []
    for r in range(pp):
        c = _Counters(num_microbatches)
        f0 = f1 = 0  # forwards issued per chunk, counting those past the last microbatch
        for _ in range(2 * (pp - r) - 1):
            c.add(FORWARD, 0)
            f0 += 1
        for _ in range(r):
            c.add(FORWARD, 1)
            c.add(FORWARD, 0)
            f0, f1 = f0 + 1, f1 + 1
        for _ in range(pp - r):
            c.add(FORWARD, 1)
            c.add(BACKWARD, 1, split=False)
            f1 += 1
        while f1 < f0 or f0 < m:
            if f0 < m:
                c.add(FORWARD, 0)
                f0 += 1
            c.add(BACKWARD, 0, split=False)
            c.add(FORWARD, 1)
            c.add(BACKWARD, 1, split=False)
            f1 += 1
        # Cool-down: the B's first; the W's they leave behind fill the tail, chunk 1's before chunk 0's.
        for _ in range(r):
            c.add(BACKWARD, 0)
            c.add(BACKWARD, 1)
        for _ in range(pp - r):
            c.add(BACKWARD, 0)
            oldest = next((w for w in c.deferred if w.chunk == 0), None)
            if oldest is not None:
                c.deferred.remove(oldest)
                c.order.append(oldest)
        c.order += [w for w in c.deferred if w.chunk == 1] + [w for w in c.deferred if w.chunk == 0]
        out.append(_with_comms(r, pp, 2, _steps(c.order), V))
    return out


def dualpipev_schedule(pp: int, num_microbatches: int) -> list[list[Action]]:
    """DualPipeV on 2 chunks per rank (v placement): the phases of DeepSeek's ``DualPipeV.step``."""
    _check_sizes(pp, num_microbatches)
    m = num_microbatches
    if m < 2 * pp:
        raise ScheduleError(f"the dualpipev schedule needs at least 2 x pp microbatches: {m} < 2 x {pp} = {2 * pp}")
    out = []
    for r in range(pp):
        c = _Counters(m)
        for _ in range(2 * (pp - r - 1)):
            c.add(FORWARD, 0)
        for _ in range(r + 1):
            c.add(FORWARD, 0)
            c.add(FORWARD, 1)
        for _ in range(pp - r - 1):
            c.add(BACKWARD, 1)
            c.weight()
            c.add(FORWARD, 1)
        for _ in range(m - 2 * pp + r + 1):  # the main phase: F0 with B1, then F1 with B0
            c.add(FORWARD, 0)
            c.add(BACKWARD, 1, split=False)
            c.add(FORWARD, 1)
            c.add(BACKWARD, 0, split=False)
        for _ in range(pp - r - 1):
            c.add(BACKWARD, 1, split=False)
            c.add(FORWARD, 1)
            c.add(BACKWARD, 0, split=False)
        split = False
        for i in range(r + 1):  # the second half of these backwards leave their W's for the tail
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            c.add(BACKWARD, 1, split)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            c.add(BACKWARD, 0, split)
        for _ in range(pp - r - 1):
            c.weight()
            c.add(BACKWARD, 0, split)
        while c.deferred:
            c.weight()
        out.append(_with_comms(r, pp, 2, _steps(c.order), V))
    return out
