"""The CUDA varlen path of document-masked attention (tricorn/model/varlen.py), run on the CPU against a stand-in.

No GPU is lent to CI. tricorn/model/varlen.py packs a microbatch's documents as the variable-length sequences of
one ``aten._flash_attention_forward`` / ``_backward`` call; here those two ops are replaced by a stand-in written from
flash attention's documented semantics (torch/nn/attention/varlen.py and its fake kernels: packed [total, heads, d]
inputs, int32 cumulative starts, lse [heads, total], keys i - left .. i + right, GQA by head groups) in explicit
float64 math, whose argument names are checked against the real ops' schemas. tricorn's packing, cu_seqlens, lse
layout and unpacking into the decoder's sequence-first views must then give the explicit-mask reference's output
and gradients (float64, 1e-12: see tests/workers/cp_attention.py's REL argument). The kernel rules say when it runs.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from document_reference import allowed_mask

from tricorn.attention_kernels import FLASH, AttentionCall, cuda_sdpa_kernel, masked_attention_refusal
from tricorn.config_args import config_from_args
from tricorn.data.documents import document_bounds, starts_from_bounds
from tricorn.model import masking, varlen

REL = 1e-12  # float64: reordered sums of <= 64 terms of O(1) values, ~1e-15; a wrong row or key is O(1) off


def _probs(q, k, a, e, left, right):
    """Softmax probabilities [h, n, n] of packed sequence [a, e) (k already repeated to q's heads) and its lse."""
    i, j = torch.arange(e - a)[:, None], torch.arange(e - a)[None, :]
    allowed = (j <= i + right if right >= 0 else j >= 0) & (j >= i - left if left >= 0 else j >= 0)
    scores = torch.einsum("ihd,jhd->hij", q[a:e], k[a:e]) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, -math.inf)
    return torch.softmax(scores, -1), torch.logsumexp(scores, -1)


def _attend(q, k, v, cu, left, right):
    """Explicit attention of each packed sequence: q [T, h, d], k, v [T, hkv, d] -> out [T, h, d], lse [h, T]."""
    out, lse = torch.zeros_like(q), torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=q.dtype)
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    for a, e in zip(cu.tolist(), cu.tolist()[1:]):
        probs, lse[:, a:e] = _probs(q, k, a, e, left, right)
        out[a:e] = torch.einsum("hij,jhd->ihd", probs, v[a:e])
    return out, lse


def _attend_backward(dout, q, k, v, out, cu, left, right):
    """Softmax attention's gradients, written out (a custom op's backward runs below autograd)."""
    reps = q.shape[1] // k.shape[1]
    kr, vr = (t.repeat_interleave(reps, dim=1) for t in (k, v))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(kr), torch.zeros_like(vr)
    for a, e in zip(cu.tolist(), cu.tolist()[1:]):
        probs, _ = _probs(q, kr, a, e, left, right)
        dv[a:e] = torch.einsum("hij,ihd->jhd", probs, dout[a:e])
        dprobs = torch.einsum("ihd,jhd->hij", dout[a:e], vr[a:e])
        dscores = probs * (dprobs - (dout[a:e] * out[a:e]).sum(-1).t()[:, :, None]) / math.sqrt(q.shape[-1])
        dq[a:e] = torch.einsum("hij,jhd->ihd", dscores, kr[a:e])
        dk[a:e] = torch.einsum("hij,ihd->jhd", dscores, q[a:e])
    fold = lambda g: g.view(g.shape[0], k.shape[1], reps, g.shape[-1]).sum(2)  # noqa: E731 - GQA: sum each group
    return dq, fold(dk), fold(dv)


def _window(is_causal, left, right):
    return (left, 0) if is_causal else (left, right)


def flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
                  scale=None, window_size_left=None, window_size_right=None):  # fmt: skip
    assert dropout_p == 0.0 and scale is None and torch.equal(cum_seq_q, cum_seq_k) and cum_seq_q.dtype == torch.int32
    assert int(cum_seq_q[-1]) == query.shape[0] and max_q >= int((cum_seq_q[1:] - cum_seq_q[:-1]).max())
    out, lse = _attend(query, key, value, cum_seq_q, *_window(is_causal, window_size_left, window_size_right))
    return out, lse, torch.zeros(2, dtype=torch.uint64), torch.empty(0), torch.empty(0)


def flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                   is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None):  # fmt: skip
    assert logsumexp.shape == (query.shape[1], query.shape[0]) and logsumexp.is_contiguous()
    window = _window(is_causal, window_size_left, window_size_right)
    again, again_lse = _attend(query, key, value, cum_seq_q, *window)
    torch.testing.assert_close(again, out, rtol=REL, atol=REL)  # the forward's out and lse come back as given
    torch.testing.assert_close(again_lse, logsumexp, rtol=REL, atol=REL)
    return _attend_backward(grad_out, query, key, value, out, cum_seq_q, *window)


STAND_IN = types.SimpleNamespace(_flash_attention_forward=flash_forward, _flash_attention_backward=flash_backward)


def test_stand_in_takes_the_real_ops_arguments():
    """Each stand-in's parameters are the real op's leading ones, by name and kind (positional or keyword-only)."""
    for name, fn in (("_flash_attention_forward", flash_forward), ("_flash_attention_backward", flash_backward)):
        schema = [(a.name, a.kwarg_only) for a in getattr(torch.ops.aten, name).default._schema.arguments]
        code = fn.__code__
        ours = [(n, i >= code.co_argcount) for i, n in enumerate(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount])]
        assert ours == schema[: len(ours)], (name, ours, schema)


@pytest.mark.parametrize("batch, groups, window", [(1, 2, None), (1, 4, 5), (2, 2, 5), (3, 1, None)])
def test_varlen_path_equals_the_explicit_mask(monkeypatch, batch, groups, window):
    monkeypatch.setattr(varlen, "takes", lambda q, k, v: True)  # the GPU branch, on the CPU
    monkeypatch.setattr(varlen, "_aten", STAND_IN)
    s, heads, d = 32, 4, 8
    tokens = torch.randint(0, 5, (batch, s), generator=torch.Generator().manual_seed(batch))
    documents = document_bounds(tokens, eod=0)
    torch.manual_seed(groups)
    q = torch.randn(s, batch, heads, d, dtype=torch.float64).permute(1, 2, 0, 3).requires_grad_()
    k, v = (torch.randn(s, batch, groups, d, dtype=torch.float64).permute(1, 2, 0, 3).requires_grad_() for _ in range(2))
    out = masking.masked_attention(q, k, v, masking.AttentionMask(documents, window))
    assert out.stride() == q.stride()  # the decoder's [s, b, h, d] view costs no copy
    allowed = allowed_mask(s, starts_from_bounds(documents), window, batch)
    reps = heads // groups
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(reps, 1), v.repeat_interleave(reps, 1), attn_mask=allowed[:, None]
    )
    grad = torch.randn_like(want)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = torch.autograd.grad(want, (q, k, v), grad)
    torch.testing.assert_close(out, want, rtol=REL, atol=REL)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=REL, atol=REL)


def test_whole_sequences_in_bf16_run_varlen_flash_and_cp_blocks_do_not():
    """One varlen flash call for a whole sequence in bf16 (the kernel rules), per-block calls for a CP ring step."""
    q = torch.empty(64, 1, 8, 64, dtype=torch.bfloat16).permute(1, 2, 0, 3)
    k = torch.empty(64, 1, 2, 64, dtype=torch.bfloat16).permute(1, 2, 0, 3)
    documents = torch.tensor([[0, 20, 50] + [64] * 62], dtype=torch.int32)
    (call,) = masking.planned_calls(q, k, k, documents, masking.whole(64), masking.whole(64), 64, 7)
    assert call.varlen and cuda_sdpa_kernel(call) == FLASH
    assert cuda_sdpa_kernel(call, (7, 5)) != FLASH  # no flash before sm80
    ring = masking.planned_calls(
        q[:, :, :32], k[:, :, :32], k[:, :, :32], documents, [0, 0, 16, 16, 48, 16], [0, 16, 16, 16, 32, 16], 64, -1
    )
    assert ring and not any(c.varlen for c in ring)
    fp32 = AttentionCall((1, 8, 64, 64), (1, 2, 64, 64), (1, 2, 64, 64), (torch.float32,) * 3, (1, 1, 1), (0, 0, 0), varlen=True)
    assert cuda_sdpa_kernel(fp32) != FLASH
    cfg = config_from_args(["--device", "cpu", "--mock-data", "--vocab-size", "100", "--reset-attention-mask", "--bf16"])
    assert masked_attention_refusal(cfg) is None
    # fp32 with head dim 6: flash takes no fp32, the efficient kernel no head dim off its alignment: refused at launch
    odd = ["--device", "cpu", "--mock-data", "--vocab-size", "100", "--window-size", "8", "--hidden-size", "60"]
    line = masked_attention_refusal(config_from_args([*odd, "--num-attention-heads", "10"]))
    assert line is not None and "flash refuses: dtype torch.float32" in line and "efficient refuses: head dims" in line
