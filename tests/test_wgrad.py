"""The B/W split (tricorn/parallel/wgrad.py): a deferred weight gradient is the plain backward's, bit for bit.

The linears' (autograd's F.linear product), and through the layer spec's ``weight_grad`` hook the norms' and the
routed experts' loop of GEMMs' (their own backwards' reductions): queued at B (the store's pending count), delivered
at W, a cast weight never deferred."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tricorn.config import ModelConfig
from tricorn.model.moe import Experts
from tricorn.model.spec import LayerSpec
from tricorn.model.transformer import GPTModel
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


# ---------------------------------------------------------------- norms and experts, through the spec's hook


def _moe_model(normalization: str, dtype: torch.dtype, weight_grad) -> GPTModel:
    """Two MoE layers (the routed experts run the loop of GEMMs on the CPU), plain linears, norms with ``weight_grad``."""
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=16,
        ffn_hidden_size=24,
        num_attention_heads=4,
        seq_length=8,
        vocab_size=50,
        num_experts=4,
        moe_router_topk=2,
        swiglu=True,
        disable_bias_linear=True,
        normalization=normalization,
    )
    model = GPTModel(cfg, LayerSpec(weight_grad=weight_grad), padded_vocab_size=64)
    model.init_weights(1)
    return model.to(dtype)


def _deferrable(name: str) -> bool:
    """The parameters whose gradients the hook takes: norm weights (not biases) and the routed experts' stacks."""
    return name.endswith(("norm.weight", "experts.w1", "experts.w2"))


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_norms_and_experts_defer_to_w_and_equal_the_plain_backward_bitwise(normalization, dtype):
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    plain = _moe_model(normalization, dtype, None)
    plain(tokens, tokens).sum().backward()
    want = {n: p.grad for n, p in plain.named_parameters()}

    model = _moe_model(normalization, dtype, wgrad.defer)
    names = {id(p): n for n, p in model.named_parameters()}
    deferred = [n for n in names.values() if _deferrable(n)]
    assert len(deferred) == 2 * 2 + 1 + 2 * 2  # two norms per layer, the final norm, w1 and w2 per layer
    store = wgrad.WeightGradStore()
    with store.collecting():
        loss = model(tokens, tokens).sum()
        with store.backward_input((0, 0)):  # B: every other gradient now, the norms' and experts' weights queued
            loss.backward()
        assert store.pending() == len(deferred)
        assert sorted(names[id(w)] for w in store.weights((0, 0))) == sorted(deferred)
        for n, p in model.named_parameters():
            assert (p.grad is None) == _deferrable(n), n
            if p.grad is not None:
                assert torch.equal(p.grad, want[n]), f"{n}: B's gradient differs from the plain backward's"
        assert store.run((0, 0)) == len(deferred) and store.pending() == 0  # W
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, want[n]), f"{n}: not the plain backward's gradient bit for bit"  # same ops, same order


def test_a_cast_expert_weight_is_computed_in_b():
    """float64 experts fed float32 rows: the GEMMs get ``w.to(float32)``, whose graph goes at B, so no deferral."""
    cfg = ModelConfig(hidden_size=16, ffn_hidden_size=24, num_experts=3, moe_router_topk=1, swiglu=True, disable_bias_linear=True)
    gen = torch.Generator().manual_seed(1)
    x, counts = torch.randn(10, 16, generator=gen), [4, 0, 6]
    grads = []
    for hook in (None, wgrad.defer):
        experts = Experts(cfg, 3, weight_grad=hook).double()
        with torch.no_grad():
            for p in experts.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
        store = wgrad.WeightGradStore()
        with store.collecting(), store.backward_input((0, 0)):
            experts(x, torch.tensor(counts), counts).sum().backward()
            assert store.pending() == 0 and experts.w1.grad is not None and experts.w2.grad is not None
        grads.append((experts.w1.grad, experts.w2.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
