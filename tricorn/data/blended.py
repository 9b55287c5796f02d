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
ties, in float64 exactly as the C++ helper computes it. Each step depends on
the previous one; numpy guesses blocks of steps and checks them at once (for
two datasets nearly every block is right: ~0.3 s per million samples), and
for three or more datasets, where guesses fail every few steps, a Python
loop steps exactly (~1 s per million samples for 3, ~7 s for 30). The result is cached like the GPT
indices (tricorn.data.cache), so one rank pays it once per run configuration.
Deterministic, independent of rank and DP size.
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


_CHUNK = 1 << 15  # steps checked at once by the vectorised path


def _greedy_steps(w: np.ndarray, taken: np.ndarray, start: int, steps: int, which: np.ndarray) -> None:
    """megatron-core's greedy, one step at a time (exact; the reference for the vectorised path)."""
    weights = w.tolist()
    counts = taken.tolist()
    others = range(1, len(weights))
    w0 = weights[0]
    picks = []
    for n in range(start, start + steps):
        step = float(n) if n else 1.0  # the C++ helper's max(n, 1)
        best, best_error = 0, w0 * step - counts[0]
        for k in others:  # strict >: the lowest index wins a tie, as in the C++ helper
            error = weights[k] * step - counts[k]
            if error > best_error:
                best, best_error = k, error
        picks.append(best)
        counts[best] += 1
    which[start : start + steps] = picks
    taken[:] = counts


def _vectorised_steps(w: np.ndarray, taken: np.ndarray, start: int, steps: int, which: np.ndarray) -> int:
    """Guess the next `steps` picks, check them all at once, keep the exact prefix; returns how many were kept.

    Guess: dataset k's next picks fall at the steps (taken_k + i) / w_k, merged in order. Check:
    with the counts the guess implies, the greedy's own argmax at every step (float64, first
    index on ties, as the C++ helper). Up to the first disagreement the guess is the greedy's
    history, and the argmax there is the greedy's next pick. For two datasets the guess is
    almost always right (a wrong guess still yields one exact step); for more it is often wrong,
    so build_blending_indices steps those exactly instead.
    """
    picks, times = [], []
    for k, weight in enumerate(w.tolist()):
        i = np.arange(int(np.ceil(steps * weight)) + 2)
        picks.append(np.full(i.size, k))
        times.append((taken[k] + i) / weight)
    all_picks, all_times = np.concatenate(picks), np.concatenate(times)
    guess = all_picks[np.lexsort((all_picks, all_times))[:steps]]
    onehot = np.zeros((steps, w.size), dtype=np.int64)
    onehot[np.arange(steps), guess] = 1
    before = (taken + np.cumsum(onehot, axis=0) - onehot).astype(np.float64)
    step = np.maximum(np.arange(start, start + steps), 1).astype(np.float64)
    best = np.argmax(w[None, :] * step[:, None] - before, axis=1)
    wrong = np.flatnonzero(best != guess)
    kept = steps if wrong.size == 0 else int(wrong[0]) + 1
    which[start : start + kept] = guess[:kept]
    if wrong.size:
        which[start + kept - 1] = best[kept - 1]
    taken += np.bincount(which[start : start + kept], minlength=w.size)
    return kept


def build_blending_indices(weights: Sequence[float], size: int) -> dict[str, np.ndarray]:
    """dataset_index[n]: which dataset sample n comes from; dataset_sample_index[n]: which of its samples.

    `weights` are used as given (normalise them first, as megatron-core does) and must be positive.
    """
    w = np.asarray(weights, dtype=np.float64)
    which = np.zeros(size, dtype=np.int16)
    taken = np.zeros(w.size, dtype=np.int64)
    n = 0
    if w.size > 2:  # the guesses fail every few steps for three or more datasets: step exactly
        _greedy_steps(w, taken, 0, size, which)
        n = size
    while n < size:
        n += _vectorised_steps(w, taken, n, min(_CHUNK, size - n), which)
    local = np.zeros(size, dtype=np.int64)
    for k in range(w.size):  # sample j of dataset k is its j-th appearance
        mask = which == k
        local[mask] = np.arange(int(mask.sum()))
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
