"""Deferred weight gradients: the B/W split that the zero-bubble pipeline schedules run.

A zero-bubble schedule (``pipeline/zero_bubble.py``) runs each backward as two actions:
``B`` (the input gradients, which the previous stage waits for) and ``W`` (the weight
gradients, deferred into what would be bubble). The executor opens a
:class:`WeightGradStore` for the iteration (``collecting``) and wraps each ``B`` of
(microbatch, chunk) in ``backward_input(key)``. Meanwhile the tensor-parallel linears
(``tensor.py``: column, row, the head, also under sequence parallelism) run through
:func:`linear` / :func:`weight_grad`: their backward computes the input gradient (and the
bias gradient) as usual but queues ``(weight, input, grad_output)`` under the key instead
of the weight gradient. ``run(key)`` at the ``W`` action computes each
``grad_output.t().mm(input)`` - the product autograd itself computes for ``F.linear``, so
the gradient is bitwise the plain backward's - as the backward of a one-node graph whose
input is the weight, so autograd accumulates it as the weight's gradient. Autograd's accumulation then runs
exactly as in a plain backward: the same in-place add into ``.grad`` and the same
post-accumulate-grad hooks (the data-parallel buckets, ``data_parallel.py``).

Communication: none. Under TP each rank's weight gradient is the product of its own
shards; under SP the column-parallel input is all-gathered in ``B`` (as in a plain
backward) and the gathered input is what is queued, so ``W`` sends nothing.
Memory: from ``B`` to ``W`` a linear keeps its input (as its saved tensor would have been,
but the gathered sequence under SP: TP x its shard) and its output gradient; the rest of
the microbatch's graph is freed at ``B``. A ``W`` computes one weight gradient at a time and
drops each linear's pair as soon as its gradient is handed over, so beyond the queue it holds
one weight gradient (``planning/zero_bubble_memory.py`` counts the queue). Other weight gradients (norms, embedding,
experts) are computed in ``B``.

Without an open store the linears are plain ``F.linear`` (the path of every other schedule).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Optional

import torch
import torch.nn.functional as F

Key = tuple[int, int]  # (microbatch, chunk)

_store: Optional[WeightGradStore] = None  # the store of the running iteration, set by ``collecting``


class WeightGradStore:
    """Queued weight-gradient products of one iteration, per (microbatch, chunk)."""

    def __init__(self) -> None:
        self.queues: dict[Key, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self.current: Optional[Key] = None  # the key of the running B

    @contextlib.contextmanager
    def collecting(self) -> Iterator[WeightGradStore]:
        """The linears built while this is open save what a deferred weight gradient needs."""
        global _store
        if _store is not None:
            raise RuntimeError("a weight-gradient store is already collecting")
        _store = self
        try:
            yield self
        finally:
            _store = None

    @contextlib.contextmanager
    def backward_input(self, key: Key) -> Iterator[None]:
        """Around the B of ``key``: the linears queue their weight gradients under it."""
        self.current = key
        try:
            yield
        finally:
            self.current = None

    def queue(self, weight: torch.Tensor, inp2d: torch.Tensor, grad2d: torch.Tensor) -> None:
        assert self.current is not None
        self.queues.setdefault(self.current, []).append((weight, inp2d, grad2d))

    def run(self, key: Key) -> int:
        """The W of ``key``: compute and accumulate its queued weight gradients; returns how many."""
        items = self.queues.pop(key, [])
        n = len(items)
        # One product at a time, each item dropped once its gradient is handed over: the W holds the queue
        # less what it has consumed plus one weight gradient, never all of the chunk's weight gradients at once.
        items.reverse()
        while items:
            _WeightGrad.apply(*items.pop()).backward()
        return n

    def weights(self, key: Key) -> list[torch.Tensor]:
        """The parameters whose gradients the W of ``key`` will deliver."""
        return [w for w, _, _ in self.queues.get(key, [])]

    def pending(self) -> int:
        return sum(len(q) for q in self.queues.values())


class _WeightGrad(torch.autograd.Function):
    """A node whose backward is one queued product: the gradient is made inside the engine, so autograd's
    accumulation takes it as the weight's ``.grad`` without a copy (a gradient handed in from outside,
    ``torch.autograd.backward(weight, grad)``, is still referenced by the caller and gets cloned)."""

    @staticmethod
    def forward(ctx, weight, inp2d, grad2d):
        ctx.pair = (inp2d, grad2d)
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        inp2d, grad2d = ctx.pair
        ctx.pair = None  # the pair goes with this product, not with the node
        return grad2d.t().mm(inp2d), None, None  # autograd's own form for F.linear


def deferring() -> bool:
    """Inside a B whose weight gradients go to a W."""
    return _store is not None and _store.current is not None


def weight_grad(weight: torch.Tensor, grad2d: torch.Tensor, inp2d: torch.Tensor) -> Optional[torch.Tensor]:
    """A linear's weight gradient now, or None once it is queued for the running B's W.

    ``weight`` must be the tensor the forward received (the parameter), not its saved copy: a parameter
    that is a view of a DP bucket comes back from ``ctx.saved_tensors`` as another tensor, and a gradient
    handed to that one would never reach the parameter."""
    if deferring():
        assert _store is not None
        _store.queue(weight, inp2d, grad2d)
        return None
    return grad2d.t().mm(inp2d)


class _DeferrableLinear(torch.autograd.Function):
    """``F.linear`` whose backward leaves the weight gradient to ``weight_grad``."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.param = weight  # the parameter object itself for the W (see weight_grad)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad2d = grad.reshape(-1, grad.shape[-1])
        grad_input = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_weight = weight_grad(ctx.param, grad2d, x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_bias = grad2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear``; while a store is collecting, one whose weight gradient a W can run later."""
    if _store is None or not torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    return _DeferrableLinear.apply(x, weight, bias)
