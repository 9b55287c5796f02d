"""Documents inside a sample: Megatron's --reset-position-ids, --reset-attention-mask and --eod-mask-loss.

A sample is seq_length + 1 tokens cut out of the document stream, so it usually holds the end of one document,
some whole ones and the start of another. megatron-core 0.19 (``_get_ltor_masks_and_position_ids`` in
megatron/core/datasets/gpt_dataset.py) reads the documents off the end-of-document token (the tokenizer's eod)
of the sample's inputs, and this module computes exactly what it computes, for a whole batch at once:

- the end-of-document token belongs to the document it ends; the next document starts after it;
- --reset-position-ids: the position of input token j is j minus the start of its document;
- --reset-attention-mask: no token attends to a token of an earlier document of the same sample;
- --eod-mask-loss: a position whose input token is the end of document gets no loss.

Nothing is stored per sample: the loader computes these from the tokens each time it cuts a batch
(tests/test_documents.py checks them against fixtures that megatron-core made). The attention mask is never
built: ``bounds`` lists where each sample's documents start (Megatron's padded cu_seqlens), which the attention
kernels take (tricorn/model/masking.py). No collectives; memory: [b, s] positions and [b, s + 1] bounds on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class DocumentFlags:
    """The three flags and the end-of-document id they read (the tokenizer's eod)."""

    eod: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    @property
    def active(self) -> bool:
        return self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss


def document_starts(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, s] int64: the index of the first token of each token's document (0 or one past an earlier eod)."""
    b, s = tokens.shape
    index = torch.arange(s, dtype=torch.int64).expand(b, s)
    ends = torch.where(tokens == eod, index, torch.full_like(index, -1))
    last_end = torch.cummax(ends, dim=1).values  # the latest eod at or before each position
    before = torch.cat([torch.full((b, 1), -1, dtype=torch.int64), last_end[:, :-1]], dim=1)  # strictly before
    return before + 1


def document_bounds(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, s + 1] int32: each sample's document starts, then s, padded with s (Megatron's padded cu_seqlens).

    Row r: [0, e_1 + 1, e_2 + 1, ..., s, s, ...] for the eods e_i of sample r that are not its last token."""
    b, s = tokens.shape
    starts = tokens[:, :-1] == eod  # an eod at position i starts a document at i + 1 (not past the end)
    rows = []
    for row in range(b):
        new = (torch.nonzero(starts[row]).flatten() + 1).tolist()
        rows.append([0, *new] + [s] * (s - len(new)))
    return torch.tensor(rows, dtype=torch.int32).reshape(b, s + 1)


def apply_document_flags(
    tokens: torch.Tensor, loss_mask: torch.Tensor, flags: Optional[DocumentFlags]
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Megatron's three flags on a batch of inputs (before pad ids are replaced): zeroes the loss mask in place
    at end-of-document inputs (--eod-mask-loss); returns (position ids [b, s] int64 or None, bounds [b, s + 1]
    int32 or None) for --reset-position-ids and --reset-attention-mask."""
    if flags is None or not flags.active:
        return None, None
    if flags.eod_mask_loss:
        loss_mask[tokens == flags.eod] = 0.0
    positions = bounds = None
    if flags.reset_position_ids:
        positions = torch.arange(tokens.shape[1], dtype=torch.int64) - document_starts(tokens, flags.eod)
    if flags.reset_attention_mask:
        bounds = document_bounds(tokens, flags.eod)
    return positions, bounds


def bounds_rows(bounds: torch.Tensor) -> list[list[int]]:
    """Each sample's document starts and the sequence end, the padding dropped: host integers (bounds is host memory)."""
    rows = []
    for row in bounds.tolist():
        rows.append(row[: row.index(row[-1]) + 1])
    return rows


def starts_from_bounds(bounds: torch.Tensor) -> torch.Tensor:
    """[b, s] int64: the first token of each token's document, from [b, s + 1] bounds (for tests and references)."""
    b, width = bounds.shape
    s = width - 1
    index = torch.arange(s, dtype=torch.int64)
    out = torch.empty(b, s, dtype=torch.int64)
    for row in range(b):
        starts = bounds[row].to(torch.int64)
        which = torch.searchsorted(starts, index, right=True) - 1  # the last start <= j
        out[row] = starts[which]
    return out
