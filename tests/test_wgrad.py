"""The B/W split of a linear (tricorn/parallel/wgrad.py): the deferred weight gradient is autograd's, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tricorn.parallel import wgrad


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_deferred_linear_equals_autograd_bitwise(bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, 48, generator=gen)  # [s, b, in], sequence-first as in the model
    w = torch.nn.Parameter(torch.randn(40, 48, generator=gen))
    b = torch.nn.Parameter(torch.randn(40, generator=gen)) if bias else None
    out_grad = torch.randn(16, 3, 40, generator=gen)

    xa = x.clone().requires_grad_()
    F.linear(xa, w, b).backward(out_grad)
    want = (xa.grad, w.grad.clone(), None if b is None else b.grad.clone())
    w.grad = None
    if b is not None:
        b.grad = None

    store = wgrad.WeightGradStore()
    xb = x.clone().requires_grad_()
    with store.collecting():
        y = wgrad.linear(xb, w, b)
        with store.backward_input((0, 0)):  # B: input (and bias) gradients; the weight's is queued
            y.backward(out_grad)
        assert w.grad is None and store.pending() == 1
        assert torch.equal(xb.grad, want[0])
        if b is not None:
            assert torch.equal(b.grad, want[2])
        assert store.run((0, 0)) == 1 and store.pending() == 0  # W
    assert torch.equal(w.grad, want[1])  # bitwise: the same product autograd computes


def test_without_a_store_the_linear_is_plain_and_backward_outside_b_computes_at_once():
    assert not wgrad.deferring()
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(5, 8))
    y = wgrad.linear(x, w)
    assert y.grad_fn.name() != "_DeferrableLinearBackward"  # plain F.linear when nothing collects
    store = wgrad.WeightGradStore()
    with store.collecting():
        wgrad.linear(x, w).sum().backward()  # a backward outside any B (no key): dW at once
    assert w.grad is not None and store.pending() == 0
    with pytest.raises(RuntimeError, match="already collecting"):
        with store.collecting(), wgrad.WeightGradStore().collecting():
            pass
