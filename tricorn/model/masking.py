"""Which keys a query sees: causal, within its document (--reset-attention-mask), within a window (--window-size).

Query at sequence position i of a sample sees key j when

    lo(i) <= j <= i,    lo(i) = max(start of i's document, i - W)

(W the window's left size: Megatron's ``--window-size W,0``, keys i - W .. i, W + 1 of them; no window: W = inf;
no documents: one document per sample). Hugging Face's ``sliding_window = N`` (Mistral) is keys i - N + 1 .. i:
``--window-size N-1,0``.

The rule is never built as an [s, s] mask. ``plan`` cuts the allowed region of each sample into rectangles that
fused kernels take without a mask (tricorn/model/attention_blocks.py): a causal square per document on the
diagonal, and under a window, per tile of W rows, an anti-causal square (the window's lower edge) beside the
causal one; rectangles no document spans are never called. Documents come per sample as bounds
(tricorn/data/documents.py: [b, s + 1] int32, host memory), read on the host to plan the calls: nothing is read
from the device. The same plan serves every layout: a single device attends its whole sequence to itself; a
context-parallel rank plans each of its query chunks against each key chunk it holds by their global positions
(tricorn/parallel/context/), so p2p skips the ring steps' blocks no document spans and a2a / allgather apply the
same rule to the gathered sequence.

On a GPU, whole sequences (one device, or a2a after its all-to-all) in fp16 / bf16 run instead as one varlen flash
call with the documents as its sequences and the window as its own (tricorn/model/varlen.py); the blocks serve
the CPU, fp32 and the ring and all-gather chunks. The planned attention is one custom op (``tricorn::attend_masked``,
with its backward op), so --torch-compile keeps a layer in one graph: the op is opaque to dynamo, its host-read of
the bounds happens when it runs, and new documents never recompile. No collectives; memory: the op's output and lse (what one flash call keeps),
plus attention_blocks.py's transient accumulators.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from tricorn.attention_kernels import AttentionCall, varlen_refusal
from tricorn.data.documents import bounds_rows
from tricorn.model import varlen
from tricorn.model.attention_blocks import ANTICAUSAL, CAUSAL, UNMASKED, Block, attend, attend_backward

Run = tuple[int, int, int]  # (first local row, its global position, length): a contiguous piece of the sequence


@dataclass(frozen=True)
class AttentionMask:
    """What limits causal attention beyond causality: per-sample document bounds and/or a left window."""

    documents: Optional[torch.Tensor] = None  # [b, s + 1] int32 host bounds (tricorn/data/documents.py)
    window: Optional[int] = None  # keys i - window .. i; None: unlimited


@dataclass(frozen=True)
class Packing:
    """Documents packed into the samples of a microbatch (--reset-position-ids, --reset-attention-mask)."""

    position_ids: Optional[torch.Tensor] = None  # [b, s_local] int64: each of this rank's rows' position (RoPE)
    documents: Optional[torch.Tensor] = None  # [b, s + 1] int32 host bounds of the whole samples


def attention_mask(documents: Optional[torch.Tensor], window: Optional[int]) -> Optional[AttentionMask]:
    """The mask of a layer for a microbatch, or None when plain causal attention is all it needs."""
    return AttentionMask(documents, window) if documents is not None or window is not None else None


# ---------------------------------------------------------------- planning (host integers only)


def _rectangles(r0: int, r1: int, c0: int, c1: int, window: Optional[int]) -> list[tuple[int, int, int, int, int]]:
    """(rows, keys, kind) rectangles covering {(i, j): r0 <= i < r1, c0 <= j < c1, i - window <= j <= i} once.

    Rows are cut where the upper edge (j = i) or the lower edge (j = i - window) crosses c0 or c1, so within a
    tile each edge is either a diagonal inside [c0, c1) or outside it; tiles where both edges are diagonals are
    cut again into window-high pieces, each an anti-causal square, an unmasked middle and a causal square."""
    low = None if window is None else -window  # lower edge offset j - i >= low; the upper edge is j - i <= 0
    cuts = {r0, r1}
    for x in (c0, c1) + (() if low is None else (c0 - low, c1 - low)):
        if r0 < x < r1:
            cuts.add(x)
    points = sorted(cuts)
    out: list[tuple[int, int, int, int, int]] = []
    for ra, rb in zip(points, points[1:]):
        if rb - 1 < c0 or (low is not None and ra + low >= c1):
            continue  # the upper edge is left of c0, or the lower edge right of c1: nothing to see
        upper_diagonal = rb <= c1  # row i sees up to i (inside [c0, c1)); else up to c1 - 1
        lower_diagonal = low is not None and ra + low >= c0  # row i sees from i + low; else from c0
        if not lower_diagonal:
            if upper_diagonal:
                if c0 < ra:
                    out.append((ra, rb, c0, ra, UNMASKED))
                out.append((ra, rb, ra, rb, CAUSAL))
            else:
                out.append((ra, rb, c0, c1, UNMASKED))
            continue
        if not upper_diagonal:
            out.append((ra, rb, ra + low, rb + low, ANTICAUSAL))
            if rb + low < c1:
                out.append((ra, rb, rb + low, c1, UNMASKED))
            continue
        for a in range(ra, rb, window):  # both edges diagonal: window-high pieces
            b = min(a + window, rb)
            out.append((a, b, a + low, b + low, ANTICAUSAL))
            if b + low < a:
                out.append((a, b, b + low, a, UNMASKED))
            out.append((a, b, a, b, CAUSAL))
    return out


def _documents_of(bounds_row: Sequence[int], lo: int, hi: int) -> list[tuple[int, int]]:
    """The documents [start, end) of one sample's bounds that overlap global positions [lo, hi)."""
    s = bounds_row[-1]
    ends = list(bounds_row)
    first = max(bisect.bisect_right(ends, lo) - 1, 0)
    out = []
    for start, end in zip(ends[first:], ends[first + 1 :]):
        if start >= hi or start >= s:
            break
        if end > lo:
            out.append((start, end))
    return out


def plan(
    q_runs: Sequence[Run],
    k_runs: Sequence[Run],
    seq_length: int,
    window: Optional[int] = None,
    bounds: Optional[list[list[int]]] = None,
) -> list[Block]:
    """The kernel calls that attend the query rows `q_runs` to the key rows `k_runs` under the rule (module
    docstring): per sample when `bounds` gives documents (each row: its starts, then seq_length, padded), else
    shared by every sample. Local rows in the blocks; global positions decide what is seen."""
    samples: list[tuple[Optional[int], list[int]]]
    samples = [(None, [0, seq_length])] if bounds is None else list(enumerate(bounds))
    blocks: list[Block] = []
    for sample, row in samples:
        for ql, qg, qn in q_runs:
            for kl, kg, kn in k_runs:
                lo, hi = max(qg, kg), qg + qn  # a key before kg, or a query row's document ending before it: nothing
                for ds, de in _documents_of(row, kg, min(hi, kg + kn)) if lo < hi else ():
                    r0, r1 = max(qg, ds), min(qg + qn, de)
                    c0, c1 = max(kg, ds), min(kg + kn, de)
                    if r0 >= r1 or c0 >= c1:
                        continue
                    for ra, rb, ca, cb, kind in _rectangles(r0, r1, c0, c1, window):
                        blocks.append(
                            Block(
                                ra - qg + ql, rb - qg + ql, ca - kg + kl, cb - kg + kl,
                                kind == CAUSAL, sample, kind == ANTICAUSAL,
                            )
                        )  # fmt: skip
    return blocks


def _runs(flat: Sequence[int]) -> list[Run]:
    return [(flat[i], flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)]


def plan_for(q: torch.Tensor, documents: Optional[torch.Tensor], q_runs, k_runs, seq_length: int, window: int) -> list[Block]:
    if documents is not None and documents.shape[0] != q.shape[0]:
        raise ValueError(f"document bounds for {documents.shape[0]} samples, attention over {q.shape[0]}")
    return plan(_runs(q_runs), _runs(k_runs), seq_length, None if window < 0 else window, document_rows(documents))


def document_rows(documents: Optional[torch.Tensor]) -> Optional[list[list[int]]]:
    """The bounds as host integers. Every layer of a microbatch, forward and backward, reads the same tensor: it is
    decoded once and kept on the tensor (it goes with it), with the version it was read at (an in-place change)."""
    if documents is None:
        return None
    hit = getattr(documents, "_tricorn_rows", None)
    if hit is None or hit[0] != documents._version:
        hit = (documents._version, bounds_rows(documents))
        documents._tricorn_rows = hit
    return hit[1]


def _varlen(q, k, v, q_runs, k_runs, seq_length: int) -> bool:
    """Whole sequences on a GPU whose varlen flash takes them: one call instead of the blocks (varlen.py)."""
    return list(q_runs) == list(k_runs) == whole(seq_length) and varlen.takes(q, k, v)


# ---------------------------------------------------------------- the custom ops


@torch.library.custom_op("tricorn::attend_masked", mutates_args=())
def attend_masked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: Optional[torch.Tensor],
    q_runs: list[int],
    k_runs: list[int],
    seq_length: int,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q's rows over k/v's under the rule; runs flattened (local, global, length) triples,
    window -1 for none. Rows that see nothing get out 0 and lse -inf."""
    if _varlen(q, k, v, q_runs, k_runs, seq_length):
        return varlen.forward(q, k, v, documents, document_rows(documents), None if window < 0 else window)
    return attend(q, k, v, plan_for(q, documents, q_runs, k_runs, seq_length, window))


@attend_masked.register_fake
def _(q, k, v, documents, q_runs, k_runs, seq_length, window):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32))


@torch.library.custom_op("tricorn::attend_masked_backward", mutates_args=())
def attend_masked_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    documents: Optional[torch.Tensor],
    q_runs: list[int],
    k_runs: list[int],
    seq_length: int,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of attend_masked given the rows' global out and lse."""
    if _varlen(q, k, v, q_runs, k_runs, seq_length):
        return varlen.backward(dout, q, k, v, out, lse, documents, document_rows(documents), None if window < 0 else window)
    return attend_backward(dout, q, k, v, out, lse, plan_for(q, documents, q_runs, k_runs, seq_length, window))


@attend_masked_backward.register_fake
def _(dout, q, k, v, out, lse, documents, q_runs, k_runs, seq_length, window):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, documents, q_runs, k_runs, seq_length, window = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)  # what one flash call keeps
    ctx.documents = documents  # host bounds: read, never saved as an activation
    ctx.args = (q_runs, k_runs, seq_length, window)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attend_masked_backward(dout, q, k, v, out, lse, ctx.documents, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


attend_masked.register_autograd(_backward, setup_context=_setup_context)


def planned_calls(q, k, v, documents, q_runs, k_runs, seq_length, window, cap=(9, 0)) -> list[AttentionCall]:
    """The kernel calls `attend_masked` makes on a CUDA device of capability `cap` for these arguments, as
    tricorn.attention_kernels describes calls: one varlen flash call for whole sequences it takes, else one call
    per block (an anti-causal block: a causal call on fresh reversed copies). What the CUDA contract checks."""
    whole_call = AttentionCall.of(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1], where="masking.py")
    if list(q_runs) == list(k_runs) == whole(seq_length) and varlen_refusal(whole_call, cap) is None:
        return [dataclasses.replace(whole_call, varlen=True)]
    calls = []
    for blk in plan_for(q, documents, q_runs, k_runs, seq_length, window):
        qb, kb, vb = blk.operands(q, k, v)
        if blk.anticausal:  # torch.flip returns contiguous tensors of their own
            qb, kb, vb = (torch.empty(t.shape, dtype=t.dtype, device="meta") for t in (qb, kb, vb))
        gqa = kb.shape[1] != qb.shape[1]
        calls.append(AttentionCall.of(qb, kb, vb, is_causal=blk.causal or blk.anticausal, enable_gqa=gqa, where="masking.py"))
    return calls


def whole(s: int) -> list[int]:
    """The run of a whole sequence of s rows held in order (a single device, or a2a's gathered sequence)."""
    return [0, 0, s]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """Causal attention under `mask` of a whole sequence: q [b, h, s, d]; k, v [b, hkv, s, d]."""
    s = q.shape[2]
    window = -1 if mask.window is None else mask.window
    out, _ = attend_masked(q, k, v, mask.documents, whole(s), whole(s), s, window)
    return out


# ---------------------------------------------------------------- checks before launch


def validate_attention_mask(cfg) -> list[str]:
    """--window-size, --reset-attention-mask and what they meet, one sentence per problem (before launch)."""
    m, d = cfg.model, cfg.data
    errs: list[str] = []
    w = m.window_size
    if w is not None:
        text = ",".join(str(x) for x in w)
        if len(w) not in (1, 2):
            errs.append(f"--window-size {text} must be LEFT or LEFT,RIGHT (Megatron's form, e.g. 4095,0)")
        elif not (w[0] >= 1 or w[0] == -1):
            errs.append(
                f"--window-size {text}: LEFT must be a positive number of earlier tokens a query sees (or -1: all of them); "
                "Hugging Face's sliding_window N is --window-size N-1,0"
            )
        elif len(w) == 2 and w[1] != 0:
            errs.append(
                f"--window-size {text}: a causal decoder sees no later token, so RIGHT must be 0; use --window-size {w[0]},0"
            )
    limited = d.reset_attention_mask or m.attention_window is not None
    if limited and m.attention_dropout > 0:
        what = "--reset-attention-mask" if d.reset_attention_mask else "--window-size"
        errs.append(
            f"--attention-dropout {m.attention_dropout:g} with {what} is not supported (the keyed dropout runs explicit "
            "attention over the causal mask only); use --attention-dropout 0"
        )
    return errs
