"""Weighted blending of sample sources: `--data-path 0.3 A 0.7 B`, megatron-core's rules.

Sizes (megatron-core's BlendedMegatronDatasetBuilder, with its default 0.5%
surplus): for a blend of `size` samples with normalised weights w_k,
dataset k is built with ceil(ceil(size * w_k) * 1.005) samples, of which the
blend uses up to ceil(size * w_k); the blend holds sum_k ceil(size * w_k)
samples, marginally more than asked. Without weights (several prefixes),
each dataset is one epoch of its split and the weights are those epochs'
sample counts; the blend holds min(size, their sum) samples.

Order (megatron-core's build_blending_indices): sample n goes to the dataset
whose share lags most, argmax_k (w_k * max(n, 1) - taken_k), the lowest k on
ties, in float64 exactly as the C++ helper computes it. That greedy step
depends on the previous one, so it runs as a Python loop over the samples:
about 1 s per million samples for two datasets (O(size x datasets)); the
result is cached like the GPT indices (tricorn.data.cache), so one rank pays
it once per run configuration. Deterministic, independent of rank and DP size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from tricorn.data.cache import load_or_build
from tricorn.data.errors import DataError

SURPLUS = 0.005  # megatron-core's mid_level_dataset_surplus default


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.size == 0 or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise DataError(f"blend weights must be non-negative with a positive sum, got {list(weights)}")
    return w / np.sum(w)


def blend_sizes(weights: Sequence[float], size: int, surplus: float = 0.0) -> list[int]:
    """Samples per dataset for a blend of `size`: ceil(ceil(size * w_k) * (1 + surplus)) with normalised w."""
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in normalize_weights(weights).tolist()]


def build_blending_indices(weights: Sequence[float], size: int) -> dict[str, np.ndarray]:
    """dataset_index[n]: which dataset sample n comes from; dataset_sample_index[n]: which of its samples.

    `weights` are used as given (normalise them first, as megatron-core does).
    """
    w = [float(x) for x in weights]
    taken = [0] * len(w)
    which = np.zeros(size, dtype=np.int16)
    local = np.zeros(size, dtype=np.int64)
    datasets = range(len(w))
    for n in range(size):
        step = float(max(n, 1))
        best, best_error = 0, w[0] * step - taken[0]
        for k in datasets:  # strict >: the lowest index wins a tie, as in the C++ helper
            error = w[k] * step - taken[k]
            if error > best_error:
                best, best_error = k, error
        which[n] = best
        local[n] = taken[best]
        taken[best] += 1
    return {"dataset_index": which, "dataset_sample_index": local}


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
        self.weights = normalize_weights(weights)  # megatron-core normalises again here, so do we
        self.description = {
            "class": "BlendedDataset",
            "format": 2,
            "size": size,
            "weights": self.weights.tolist(),
            "datasets": description or [getattr(ds, "description", repr(ds)) for ds in self.datasets],
        }
        cached = load_or_build(
            cache_path,
            "BlendedDataset",
            split,
            self.description,
            ("dataset_index", "dataset_sample_index"),
            lambda: build_blending_indices(self.weights, size),
        )
        self.from_cache = cached.from_cache
        self.dataset_index = cached["dataset_index"]
        self.dataset_sample_index = cached["dataset_sample_index"]
        self.counts = np.bincount(np.asarray(self.dataset_index), minlength=len(self.datasets))
        for k, (ds, count) in enumerate(zip(self.datasets, self.counts)):
            if count > len(ds):
                raise DataError(f"blend component {k} has {len(ds)} samples but {count} are needed; build it with more samples")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> Any:
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} is out of range for {self.size} samples")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
