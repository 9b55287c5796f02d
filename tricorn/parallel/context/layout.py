"""The head-tail sequence layout of context parallelism: which tokens each CP rank keeps.

The sequence is cut into 2*CP chunks and CP rank r keeps chunks r and 2*CP-1-r, so every rank has the same
amount of causal attention work. A batch's positions (--reset-position-ids) are cut with its tokens; its document
bounds are not (they are global). No collectives; memory: index vectors of the sequence length.
"""

from __future__ import annotations

import torch

from tricorn.data.base import Batch


def local_positions(seq_length: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global positions of the tokens CP rank `cp_rank` keeps out of a `seq_length` sequence."""
    chunk = seq_length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, device=device)
    return torch.cat([first, second])


def chunk_runs(cp_rank: int, cp_size: int, chunk: int) -> list[int]:
    """CP rank `cp_rank`'s two chunks as (first local row, global position, length) triples, flattened
    (tricorn/model/masking.py plans document and window blocks on them)."""
    return [0, cp_rank * chunk, chunk, chunk, (2 * cp_size - 1 - cp_rank) * chunk, chunk]


def gathered_positions(seq_length: int, cp_size: int, device=None) -> torch.Tensor:
    """Global position of each row of a tensor gathered over CP in rank order (rank 0's chunks first)."""
    return torch.cat([local_positions(seq_length, r, cp_size, device) for r in range(cp_size)])


def global_order(seq_length: int, cp_size: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(to_global, to_gathered): index_select a gathered tensor with to_global to put it in sequence order,
    and a sequence-ordered one with to_gathered to put it back in rank order."""
    to_gathered = gathered_positions(seq_length, cp_size, device)
    return torch.argsort(to_gathered), to_gathered


def slice_batch(batch: Batch, cp_rank: int, cp_size: int) -> Batch:
    if cp_size == 1:
        return batch
    idx = local_positions(batch.tokens.shape[1], cp_rank, cp_size, batch.tokens.device)
    positions = None if batch.position_ids is None else batch.position_ids[:, idx]
    # The document bounds stay whole: attention plans each chunk's blocks by global positions.
    return Batch(
        batch.tokens[:, idx], batch.labels[:, idx], batch.loss_mask[:, idx], batch.sample_ids, positions, batch.documents
    )
