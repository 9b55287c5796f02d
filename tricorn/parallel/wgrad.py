"""Deferred weight gradients: the B/W split that the zero-bubble pipeline schedules run.

A zero-bubble schedule (``pipeline/zero_bubble.py``) runs each backward as two actions:
``B`` (the input gradients, which the previous stage waits for) and ``W`` (the weight
gradients, deferred into what would be bubble). The executor opens a
:class:`WeightGradStore` for the iteration (``collecting``) and wraps each ``B`` of
(microbatch, chunk) in ``backward_input(key)``. Meanwhile every backward that can defer a
weight gradient hands it to :func:`defer` as ``(parameter, thunk)``: the thunk computes the
gradient in exactly the op form the plain backward uses, and ``defer`` either runs it at once
(no B open, or the tensor the forward received is a cast copy rather than the parameter: its
graph is freed at ``B``) or queues it under the running B's key. The deferring backwards:

* the tensor-parallel linears (``tensor.py``: column, row, the head, also under sequence
  parallelism) through :func:`linear` / :func:`weight_grad`: ``grad_output.t().mm(input)``, the
  product autograd itself computes for ``F.linear``;
* the routed experts' loop of GEMMs (``model/moe.py``, ``_LoopGemm``): per expert
  ``torch.mm(g.t(), part, out=grad_w[e])`` into one stacked gradient, as its backward did;
* the norms (``model/lean.py``, ``_Norm``): the weight's reduction over tokens of the fp32
  product ``grad * xhat``, formed in ``B``.

The model package reaches :func:`defer` only through its layer spec (``LayerSpec.weight_grad``,
set by ``tensor.tensor_parallel_spec``; the model's default computes at once). ``run(key)`` at the
``W`` action runs each queued thunk as the backward of a one-node graph whose input is the weight,
so autograd accumulates it as the weight's gradient, exactly as in a plain backward: the same
in-place add into ``.grad`` and the same post-accumulate-grad hooks (the data-parallel buckets,
``data_parallel.py``). The gradients are bitwise the plain backward's.

Communication: none. Under TP each rank's weight gradient is the product of its own
shards; under SP the column-parallel input is all-gathered in ``B`` (as in a plain
backward) and the gathered input is what is queued, so ``W`` sends nothing; the experts'
rows are those the dispatch (expert parallelism's all_to_all) already delivered.
Memory: from ``B`` to ``W`` a linear keeps its input (as its saved tensor would have been,
but the gathered sequence under SP: TP x its shard) and its output gradient, a loop of expert
GEMMs its token-copy rows and their output gradient, a norm the fp32 product of its output
gradient and normalised input (its tokens: the sequence shard under SP); the rest of the
microbatch's graph is freed at ``B``. A ``W`` computes one weight gradient at a time and drops
each thunk (and what it holds) as soon as its gradient is handed over, so beyond the queue it
holds one weight gradient (``planning/zero_bubble_memory.py`` counts the queue). Computed in
``B`` still: biases, the embedding, the MoE router, and the CUDA fused paths (``F.grouped_mm``
experts, ``F.rms_norm`` / ``F.layer_norm`` norms: autograd's own backwards, whose form a thunk
would not reproduce bit for bit).

Without an open store the linears are plain ``F.linear`` (the path of every other schedule) and
:func:`defer` computes at once.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Optional

import torch
import torch.nn.functional as F

Key = tuple[int, int]  # (microbatch, chunk)
Thunk = Callable[[], torch.Tensor]  # computes one weight gradient, in the plain backward's op form

_store: Optional[WeightGradStore] = None  # the store of the running iteration, set by ``collecting``


class WeightGradStore:
    """Queued weight-gradient computations of one iteration, per (microbatch, chunk)."""

    def __init__(self) -> None:
        self.queues: dict[Key, list[tuple[torch.Tensor, Thunk]]] = {}
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
        """Around the B of ``key``: the deferring backwards queue their weight gradients under it."""
        self.current = key
        try:
            yield
        finally:
            self.current = None

    def queue(self, weight: torch.Tensor, thunk: Thunk) -> None:
        assert self.current is not None
        self.queues.setdefault(self.current, []).append((weight, thunk))

    def run(self, key: Key) -> int:
        """The W of ``key``: compute and accumulate its queued weight gradients; returns how many."""
        items = self.queues.pop(key, [])
        n = len(items)
        # One gradient at a time, each item dropped once its gradient is handed over: the W holds the queue
        # less what it has consumed plus one weight gradient, never all of the chunk's weight gradients at once.
        items.reverse()
        while items:
            _WeightGrad.apply(*items.pop()).backward()
        return n

    def weights(self, key: Key) -> list[torch.Tensor]:
        """The parameters whose gradients the W of ``key`` will deliver."""
        return [w for w, _ in self.queues.get(key, [])]

    def pending(self) -> int:
        return sum(len(q) for q in self.queues.values())


class _WeightGrad(torch.autograd.Function):
    """A node whose backward is one queued thunk: the gradient is made inside the engine, so autograd's
    accumulation takes it as the weight's ``.grad`` without a copy (a gradient handed in from outside,
    ``torch.autograd.backward(weight, grad)``, is still referenced by the caller and gets cloned)."""

    @staticmethod
    def forward(ctx, weight, thunk):
        ctx.thunk = thunk
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        thunk, ctx.thunk = ctx.thunk, None  # what the thunk holds goes with this gradient, not with the node
        return thunk(), None


def deferring() -> bool:
    """Inside a B whose weight gradients go to a W."""
    return _store is not None and _store.current is not None


def defer(weight: torch.Tensor, thunk: Thunk) -> Optional[torch.Tensor]:
    """``weight``'s gradient now (``thunk()``), or None once it is queued for the running B's W.

    ``weight`` must be the tensor the forward received, not its saved copy: a parameter that is a view of a
    DP bucket comes back from ``ctx.saved_tensors`` as another tensor, and a gradient handed to that one would
    never reach the parameter. Only a leaf (the parameter itself) is deferred: a cast copy's own graph
    (``w.to(dtype)``) is freed with the rest at B, so its gradient is computed now and flows through it."""
    if deferring() and weight.is_leaf:
        assert _store is not None
        _store.queue(weight, thunk)
        return None
    return thunk()


def _linear_weight_grad(grad2d: torch.Tensor, inp2d: torch.Tensor) -> torch.Tensor:
    return grad2d.t().mm(inp2d)  # autograd's own form for F.linear


def weight_grad(weight: torch.Tensor, grad2d: torch.Tensor, inp2d: torch.Tensor) -> Optional[torch.Tensor]:
    """A linear's weight gradient now, or None once it is queued for the running B's W (``defer``)."""
    return defer(weight, functools.partial(_linear_weight_grad, grad2d, inp2d))


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
