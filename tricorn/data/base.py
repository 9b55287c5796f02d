"""The contract between data and trainer, and the deterministic mock data.

A loader yields, for each global batch, this DP rank's contiguous slice of it.
Global batch j is the samples [consumed, consumed + global_batch_size) of one
global sample order that does not depend on the DP size, so every layout trains
on the same tokens and a resume continues with exactly the next sample.
No collectives; memory: one global batch slice at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from tricorn.data.documents import DocumentFlags, apply_document_flags
from tricorn.data.skip_samples import SkipList
from tricorn.pinned import host_side, is_pinned, pin


@dataclass
class Batch:
    tokens: torch.Tensor  # [b, s] int64 inputs
    labels: torch.Tensor  # [b, s] int64 next tokens
    loss_mask: torch.Tensor  # [b, s] float32, 0 drops a position from the loss
    # Global index of each row in the sample order (host ints: dropout masks are drawn by them, and
    # reading them never touches the device). None for batches that were not cut from a sample order.
    sample_ids: Optional[tuple[int, ...]] = None
    # --reset-position-ids: [b, s] int64 position of each input in its document (RoPE and learned positions
    # read it); None: 0..s-1. Sliced with the tokens (context parallel keeps its chunks' positions).
    position_ids: Optional[torch.Tensor] = None
    # --reset-attention-mask: [b, s + 1] int32 where each sample's documents start, then s, padded with s
    # (tricorn/data/documents.py). Host memory on every device and never sliced by context parallelism: the
    # attention kernels plan their calls from it on the host (tricorn/model/masking.py) without reading the device.
    documents: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def slice(self, start: int, stop: int) -> Batch:
        ids = None if self.sample_ids is None else self.sample_ids[start:stop]
        rows = (self.tokens, self.labels, self.loss_mask, self.position_ids, self.documents)
        tokens, labels, loss_mask, positions, documents = (None if t is None else t[start:stop] for t in rows)
        return Batch(tokens, labels, loss_mask, ids, positions, documents)

    def to(self, device: torch.device | str, copy: bool = False) -> Batch:
        """On `device`; with copy=True always fresh storage (a microbatch then never keeps its batch alive).
        From pinned memory the copy is asynchronous (non_blocking): the host does not wait for it.
        `documents` stays in host memory (it is only read there)."""
        tensors = (self.tokens, self.labels, self.loss_mask, self.position_ids)
        moved = [None if t is None else t.to(device, copy=copy, non_blocking=is_pinned(t)) for t in tensors]
        return Batch(*moved[:3], self.sample_ids, moved[3], self.documents)

    def pin(self) -> Batch:
        """In pinned host memory: on CUDA a copy from pageable memory would make the host wait (cudaMemcpy)."""
        positions = None if self.position_ids is None else pin(self.position_ids)
        return Batch(pin(self.tokens), pin(self.labels), pin(self.loss_mask), self.sample_ids, positions, self.documents)


def batch_from_samples(
    samples: torch.Tensor,
    pad_id: int = -1,
    sample_ids: Optional[tuple[int, ...]] = None,
    documents: Optional[DocumentFlags] = None,
) -> Batch:
    """[b, s+1] token samples -> inputs/labels shifted by one.

    As megatron-core's GPTDataset: --eod-mask-loss, --reset-position-ids and --reset-attention-mask read the
    inputs' end-of-document tokens (`documents`; tricorn/data/documents.py), then a position whose label is
    pad_id is left out of the loss, and pad ids in tokens and labels become 0 (so an id outside the
    vocabulary still embeds). pad_id < 0: no pad, every position counts.
    """
    samples = samples.long()
    tokens, labels = samples[:, :-1].contiguous(), samples[:, 1:].contiguous()
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    position_ids, bounds = apply_document_flags(tokens, loss_mask, documents)
    if pad_id >= 0:
        loss_mask[labels == pad_id] = 0.0
        tokens[tokens == pad_id] = 0
        labels[labels == pad_id] = 0
    return Batch(tokens, labels, loss_mask, sample_ids, position_ids, bounds)


class SampleSource(Protocol):
    """Random access to the global sample order: sample i is seq_length + 1 tokens."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> torch.Tensor: ...


class GlobalBatchLoader:
    """Cuts global batches out of a sample order and hands this DP rank its slice.

    The state is `consumed_samples` (and, with a --skip-samples list, `skipped_samples`: the listed samples
    passed over so far; tricorn/data/skip_samples.py); restoring it resumes exactly. With `pin_memory` (set by
    the trainer on CUDA: tricorn.pinned.pins_host_memory) batches come in pinned memory, so the trainer's copies
    of its microbatches to the device are non-blocking. `last_batch_ids` holds the sample indices of the whole
    global batch last handed out (the spike guard names them).
    """

    pin_memory = False

    def __init__(
        self,
        source: SampleSource,
        dp_rank: int,
        dp_size: int,
        consumed_samples: int = 0,
        pad_id: int = -1,
        skip: Optional[SkipList] = None,
        documents: Optional[DocumentFlags] = None,
    ):
        self.source = source
        self.pad_id = pad_id  # labels equal to it are left out of the loss (batch_from_samples)
        self.documents = documents  # --reset-position-ids / --reset-attention-mask / --eod-mask-loss
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed_samples = consumed_samples
        self.skip = skip
        self.skipped_samples = 0
        self.last_batch_ids: Sequence[int] = ()

    def _take(self, global_batch_size: int) -> Sequence[int]:
        """This DP rank's sample indices of the next global batch; advances the position."""
        if global_batch_size % self.dp_size != 0:
            raise ValueError(f"global batch {global_batch_size} is not divisible by DP size {self.dp_size}")
        per_rank = global_batch_size // self.dp_size
        ids = global_batch_ids(self.consumed_samples, self.skipped_samples, global_batch_size, self.skip)
        self.skipped_samples += ids[-1] + 1 - (self.consumed_samples + self.skipped_samples) - global_batch_size
        self.consumed_samples += global_batch_size
        self.last_batch_ids = ids
        return ids[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]

    def next(self, global_batch_size: int) -> Batch:
        mine = self._take(global_batch_size)
        with host_side():  # host work by design: the samples are read and cut in host memory
            samples = torch.stack([torch.as_tensor(self.source[i % len(self.source)]) for i in mine])
            batch = batch_from_samples(samples, self.pad_id, tuple(mine), self.documents)
        return batch.pin() if self.pin_memory else batch

    def state_dict(self) -> dict:
        state = {"consumed_samples": self.consumed_samples}
        return {**state, "skipped_samples": self.skipped_samples} if self.skipped_samples else state

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])
        self.skipped_samples = int(state.get("skipped_samples", 0))


def global_batch_ids(consumed: int, skipped: int, global_batch_size: int, skip: Optional[SkipList]) -> Sequence[int]:
    """Sample indices of the global batch that starts at raw position consumed + skipped (skip: left out)."""
    start = consumed + skipped
    return range(start, start + global_batch_size) if skip is None else skip.take(start, global_batch_size)


class MockSamples:
    """Synthetic tokens: sample i depends only on (seed, i), never on the layout.

    Each sample is a random walk with small steps modulo the vocabulary, so the
    next token is predictable and the loss falls visibly in a demo.
    """

    def __init__(self, vocab_size: int, seq_length: int, seed: int, num_samples: int = 10**9):
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.seed = seed
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = torch.randint(0, self.vocab_size, (1,), generator=gen)
        steps = torch.randint(-2, 3, (self.seq_length,), generator=gen)
        return torch.cat([start, start + steps.cumsum(0)]) % self.vocab_size
