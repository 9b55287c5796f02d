"""Weighted blending of sample sources: `--data-path 0.3 A 0.7 B`.

Counts: dataset k contributes exactly count_k samples, the largest-remainder
rounding of weight_k * size, so every count is within 1 of its target for any
number of datasets, and the counts sum to size.

Order: sample j of dataset k sits at (j + phase_k) / count_k of the way
through the blend (phase 1/2, staggered among datasets of equal count); one
stable sort of those positions (ties: lower dataset first) gives the
interleave. Each dataset is spread evenly, so every prefix follows the
weights too: within 1 sample for two datasets, and on random blends of up to
32 datasets within about 2 (Megatron's greedy, which picks the dataset
furthest below its share step by step in C++, measures about 1.8 there, and
its totals can be nearly 1 off where ours are exact). The build is vectorised,
O(size log k), deterministic, independent of rank and DP size, and cached like
the GPT indices (tricorn.data.cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from tricorn.data.cache import load_or_build
from tricorn.data.errors import DataError


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.size == 0 or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise DataError(f"blend weights must be non-negative with a positive sum, got {list(weights)}")
    return w / w.sum()


def blending_counts(weights: Sequence[float], size: int) -> np.ndarray:
    """Largest-remainder apportionment of size samples (ties: lower index first)."""
    target = normalize_weights(weights) * size
    counts = np.floor(target).astype(np.int64)
    short = size - int(counts.sum())
    if short > 0:
        order = np.argsort(-(target - counts), kind="stable")
        counts[order[:short]] += 1
    return counts


def _phases(counts: np.ndarray) -> np.ndarray:
    """Where in its slot each dataset's samples sit: the middle, except that datasets with equal
    counts take evenly staggered places, so that their samples do not arrive in one burst."""
    phases = np.full(counts.size, 0.5)
    for value in np.unique(counts):
        same = np.flatnonzero(counts == value)
        if same.size > 1:
            phases[same] = (np.arange(same.size) + 0.5) / same.size
    return phases


def build_blending_indices(counts: Sequence[int]) -> dict[str, np.ndarray]:
    """dataset_index[i]: which dataset sample i comes from; dataset_sample_index[i]: which of its samples."""
    counts = np.asarray(counts, dtype=np.int64)
    which = np.repeat(np.arange(counts.size, dtype=np.int16), counts)
    starts = np.cumsum(counts) - counts
    local = np.arange(which.size, dtype=np.int64) - np.repeat(starts, counts)
    position = (local + np.repeat(_phases(counts), counts)) / np.repeat(np.maximum(counts, 1), counts)
    order = np.argsort(position, kind="stable")  # stable: ties keep the lower dataset first
    return {"dataset_index": which[order], "dataset_sample_index": local[order]}


class BlendedDataset:
    """size samples drawn from `datasets` by weight; implements base.SampleSource."""

    def __init__(
        self,
        datasets: Sequence[Any],
        weights: Sequence[float],
        size: int,
        cache_path: Optional[str] = None,
        split: str = "train",
        description: Optional[dict] = None,
    ):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.size = size
        self.counts = blending_counts(weights, size)
        for k, (ds, count) in enumerate(zip(self.datasets, self.counts)):
            if count > len(ds):
                raise DataError(f"blend component {k} has {len(ds)} samples but {count} are needed; build it with more samples")
        self.description = {
            "class": "BlendedDataset",
            "size": size,
            "counts": self.counts.tolist(),
            "datasets": description or [getattr(ds, "description", repr(ds)) for ds in self.datasets],
        }
        cached = load_or_build(
            cache_path,
            "BlendedDataset",
            split,
            self.description,
            ("dataset_index", "dataset_sample_index"),
            lambda: build_blending_indices(self.counts),
        )
        self.from_cache = cached.from_cache
        self.dataset_index = cached["dataset_index"]
        self.dataset_sample_index = cached["dataset_sample_index"]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> Any:
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} is out of range for {self.size} samples")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
