"""--num-workers N: worker processes build the next global batches while the trainer computes.

A torch DataLoader over the same sample source, driven by a batch sampler that lists, batch
after batch, exactly the sample indices GlobalBatchLoader.next() would take for this DP rank
(global batch sizes follow `batch_size_at(consumed_samples)`, so --rampup-batch-size works).
The DataLoader returns batches in order whatever the worker count, so the tokens and hence
the losses are bitwise the same as with 0 workers; the position (`consumed_samples`, and `skipped_samples`
with --skip-samples) stays the only state (a resume rebuilds the sampler from it). Each worker keeps `prefetch_factor` batches ready.
On CUDA the batches come in pinned memory (the trainer then copies with non_blocking=True).

No collectives. Memory: N x prefetch_factor batch slices in host memory, N worker processes
(forked on Linux: the sample source, memory-mapped files included, is shared, not copied).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Optional

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from tricorn.data.base import Batch, GlobalBatchLoader, SampleSource, batch_from_samples
from tricorn.data.documents import DocumentFlags


class _Samples(Dataset):
    def __init__(self, source: SampleSource):
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.as_tensor(self.source[index % len(self.source)])


class _RankBatches(Sampler[list[int]]):
    """This DP rank's sample indices of each global batch from the base loader's position on (its next()'s order)."""

    def __init__(self, base: GlobalBatchLoader, batch_size_at: Callable[[int], int]):
        self.cursor = GlobalBatchLoader(base.source, base.dp_rank, base.dp_size, base.consumed_samples, skip=base.skip)
        self.cursor.skipped_samples = base.skipped_samples
        self.batch_size_at = batch_size_at

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield list(self.cursor._take(self.batch_size_at(self.cursor.consumed_samples)))


class _Collate:
    def __init__(self, pad_id: int, documents: Optional[DocumentFlags]):
        self.pad_id, self.documents = pad_id, documents

    def __call__(self, samples: list[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        b = batch_from_samples(torch.stack(samples), self.pad_id, documents=self.documents)
        return b.tokens, b.labels, b.loss_mask, b.position_ids, b.documents


class PrefetchingBatchLoader(GlobalBatchLoader):
    """GlobalBatchLoader whose batches are built ahead by `num_workers` processes (see module docstring)."""

    def __init__(
        self,
        base: GlobalBatchLoader,
        num_workers: int,
        batch_size_at: Callable[[int], int],
        pin_memory: bool = False,
        prefetch_factor: int = 2,
    ):
        super().__init__(base.source, base.dp_rank, base.dp_size, base.consumed_samples, base.pad_id, base.skip, base.documents)
        self.skipped_samples = base.skipped_samples
        self.num_workers, self.batch_size_at = num_workers, batch_size_at
        self.pin_memory, self.prefetch_factor = pin_memory, prefetch_factor
        self._iter: Optional[Iterator] = None
        self._iter_at = -1  # consumed_samples the iterator's next batch starts at

    def _start(self) -> None:
        sampler = _RankBatches(self, self.batch_size_at)
        loader = DataLoader(
            _Samples(self.source),
            batch_sampler=sampler,
            num_workers=self.num_workers,
            collate_fn=_Collate(self.pad_id, self.documents),
            pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch_factor,
            persistent_workers=False,
        )
        self._iter, self._iter_at = iter(loader), self.consumed_samples

    def next(self, global_batch_size: int) -> Batch:
        if global_batch_size % self.dp_size or global_batch_size != self.batch_size_at(self.consumed_samples):
            return super().next(global_batch_size)  # off the schedule (never in training): read (or refuse) directly
        if self._iter is None or self._iter_at != self.consumed_samples:
            self.close()
            self._start()
        tokens, labels, loss_mask, positions, documents = next(self._iter)
        mine = self._take(global_batch_size)  # the same indices the sampler gave the workers
        self._iter_at = self.consumed_samples
        return Batch(tokens, labels, loss_mask, tuple(mine), positions, documents)

    def close(self) -> None:
        """Stop the workers (they restart at the next batch)."""
        if self._iter is not None:
            shutdown = getattr(self._iter, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            self._iter = None
