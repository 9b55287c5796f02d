"""GPT samples over an indexed dataset: seq_length + 1 tokens that run across document boundaries.

The three indices are megatron-core's (0.19), element for element, so sample i
here is sample i of megatron-core's GPTDataset for the same data, split,
sample count, seq_length and seed (tests/test_data_megatron.py checks this
against fixtures made by megatron-core itself). Built with vectorised numpy,
no C++ helper:
  document_index  the split's documents repeated once per epoch and shuffled
                  as one list (int32), one numpy RandomState(seed) draw; with a
                  separate final epoch (below), the first epochs and the final
                  one are shuffled apart, in that order, from the same generator;
  sample_index    [num_samples + 1, 2]: (position in document_index, token
                  offset) where sample i starts; sample i runs to the start
                  of sample i + 1 inclusive (the extra token is the last label).
                  Entry 0 is (0, 0) even when that document is empty, as in
                  Megatron's helper;
  shuffle_index   a permutation of the samples (uint32), drawn after the
                  document shuffle. When the samples wanted from the final
                  epoch are fewer than 80% of an epoch's, the final epoch's
                  samples are shuffled separately and come last, so they do
                  not skew the early samples.
num_samples=None builds exactly one epoch (Megatron's unweighted blends).
Sample i depends only on the data, the split, the sample count, seq_length and
the seed, never on the rank or the DP size. The indices are cached through
tricorn.data.cache (rank 0 builds, others wait and memory-map).

Split: `--split 969,30,1` normalises the weights, takes their running sums
c_0 = 0, c_1, c_2, c_3 = 1 and gives split k the sequences
[round(c_k * n), round(c_{k+1} * n)) (megatron-core's rounding of the
cumulative boundaries; a split whose weight is 0 gets nothing).
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Optional

import numpy as np

from tricorn.data.cache import load_or_build
from tricorn.data.errors import DataError
from tricorn.data.indexed import IndexedDataset, data_file_path, index_file_path

SPLIT_NAMES = ("train", "valid", "test")
INDEX_FORMAT = 2  # bump when the index construction changes, so old caches are not reused
FINAL_EPOCH_THRESHOLD = 0.80


def parse_split(split: str) -> list[float]:
    """'969,30,1' (or '969/30/1', or fewer parts) -> three proportions summing to 1."""
    parts = [float(x) for x in re.findall(r"[.0-9]+", split)]
    if not parts or len(parts) > 3 or sum(parts) <= 0:
        raise DataError(f"--split {split!r} must be up to three non-negative proportions such as 969,30,1")
    parts += [0.0] * (3 - len(parts))
    return (np.asarray(parts, dtype=np.float64) / np.sum(parts)).tolist()


def split_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """[begin, end) document ranges of train/valid/test: megatron-core rounds each cumulative boundary."""
    bounds = [0.0]
    for share in parse_split(split):
        bounds.append(bounds[-1] + share)  # running float sums, as megatron-core adds them
    ranges = []
    for k in range(3):
        if bounds[k + 1] <= bounds[k]:  # a zero-weight split: megatron-core builds no dataset
            ranges.append((0, 0))
            continue
        ranges.append((int(round(bounds[k] * float(num_documents))), int(round(bounds[k + 1] * float(num_documents)))))
    return ranges


def num_epochs_for(tokens_per_epoch: int, num_samples: Optional[int], seq_length: int) -> int:
    """Fewest whole epochs that hold num_samples samples of seq_length + 1 tokens (1 for num_samples=None)."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + 1  # +1: the last label
    return max(1, -(-needed // tokens_per_epoch))


def separate_final_epoch(tokens_per_epoch: int, num_samples: Optional[int], seq_length: int) -> bool:
    """Whether the final epoch is used so little (< 80% of an epoch's samples) that it is shuffled on its own."""
    num_epochs = num_epochs_for(tokens_per_epoch, num_samples, seq_length)
    if num_epochs == 1 or num_samples is None:
        return False
    samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    return num_samples - samples_before_final < int(FINAL_EPOCH_THRESHOLD * samples_per_epoch)


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final: bool = False
) -> np.ndarray:
    """The documents once per epoch, shuffled as one list; a separate final epoch is shuffled after the rest."""
    if separate_final and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng)
        return np.concatenate([first, build_document_index(documents, 1, rng)])
    index = np.tile(np.asarray(documents), num_epochs).astype(np.int32)
    rng.shuffle(index)
    return index


def build_sample_index(document_lengths: np.ndarray, seq_length: int) -> np.ndarray:
    """Start (document position, offset) of each sample, for lengths in document_index order.

    Sample i covers global tokens [i * seq_length, (i + 1) * seq_length]; the
    last boundary must still be a real token, hence (total - 1) // seq_length samples.
    """
    ends = np.cumsum(document_lengths, dtype=np.int64)
    total = int(ends[-1]) if ends.size else 0
    num_samples = max(total - 1, 0) // seq_length
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # side="right": a boundary on a document's first token belongs to it; empty documents are stepped over.
    doc_pos = np.searchsorted(ends, positions, side="right")
    offsets = positions - (ends[doc_pos] - document_lengths[doc_pos])
    doc_pos[0], offsets[0] = 0, 0  # Megatron starts at the first document even when it is empty
    top = max(document_lengths.size, int(document_lengths.max()) if document_lengths.size else 0)
    dtype = np.int32 if top <= np.iinfo(np.int32).max else np.int64
    return np.stack([doc_pos, offsets], axis=1).astype(dtype)


def build_shuffle_index(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, total) that keeps [num_samples, total) after the first part (each part shuffled)."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def build_indices(
    sequence_lengths: np.ndarray, documents: np.ndarray, num_samples: Optional[int], seq_length: int, seed: int
) -> dict[str, np.ndarray]:
    """The three index arrays for at least num_samples samples (whole epochs, as Megatron)."""
    tokens_per_epoch = int(sequence_lengths[documents].sum(dtype=np.int64))
    if tokens_per_epoch <= 1:
        raise DataError(f"the documents of this split hold {tokens_per_epoch} tokens; a sample needs at least 2")
    num_epochs = num_epochs_for(tokens_per_epoch, num_samples, seq_length)
    separate = separate_final_epoch(tokens_per_epoch, num_samples, seq_length)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate)
    sample_index = build_sample_index(sequence_lengths[document_index].astype(np.int64), seq_length)
    total = sample_index.shape[0] - 1
    first_part = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length if separate else total
    shuffle_index = build_shuffle_index(first_part, total, rng)
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


class GPTDataset:
    """Sample i (i < len) is an int64 array of seq_length + 1 tokens; implements base.SampleSource.

    num_samples=None: exactly one epoch of samples.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: np.ndarray,
        num_samples: Optional[int],
        seq_length: int,
        seed: int,
        cache_path: Optional[str] = None,
        split: str = "train",
    ):
        if num_samples is not None and num_samples < 1:
            raise ValueError(f"num_samples must be at least 1, got {num_samples}")
        self.indexed = indexed
        self.documents = np.asarray(documents, dtype=np.int64)
        self.seq_length = seq_length
        self.num_samples = num_samples
        if self.documents.size == 0:
            raise DataError(f"the {split} split of {indexed.path_prefix} has no documents; change --split or add data")
        prefix = indexed.path_prefix
        self.description = {
            "class": "GPTDataset",
            "format": INDEX_FORMAT,
            "path_prefix": os.path.realpath(prefix),
            # Cheap identity of the files: a re-preprocessed dataset almost surely changes a size.
            "idx_bytes": os.path.getsize(index_file_path(prefix)),
            "bin_bytes": os.path.getsize(data_file_path(prefix)),
            "documents": [int(self.documents.size), hashlib.md5(self.documents.tobytes()).hexdigest()],
            "num_samples": num_samples,
            "seq_length": seq_length,
            "seed": seed,
            "split": split,
        }
        try:
            cached = load_or_build(
                cache_path,
                "GPTDataset",
                split,
                self.description,
                ("document_index", "sample_index", "shuffle_index"),
                lambda: build_indices(indexed.sequence_lengths, self.documents, num_samples, seq_length, seed),
            )
        except DataError as e:
            raise DataError(f"the {split} split of {prefix}: {e}") from None
        self.cache_key = cached.key
        self.from_cache = cached.from_cache
        self.document_index = cached["document_index"]
        self.sample_index = cached["sample_index"]
        self.shuffle_index = cached["shuffle_index"]

    def __len__(self) -> int:
        return int(self.sample_index.shape[0] - 1)

    def __getitem__(self, idx: int) -> np.ndarray:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} is out of range for {len(self)} samples")
        i = int(self.shuffle_index[idx])
        doc_beg, off_beg = (int(x) for x in self.sample_index[i])
        doc_end, off_end = (int(x) for x in self.sample_index[i + 1])
        get, docs = self.indexed.get, self.document_index
        if doc_beg == doc_end:
            parts = [get(int(docs[doc_beg]), off_beg, off_end - off_beg + 1)]
        else:
            parts = [get(int(docs[doc_beg]), off_beg)]
            parts += [get(int(docs[d])) for d in range(doc_beg + 1, doc_end)]
            parts.append(get(int(docs[doc_end]), 0, off_end + 1))
        sample = np.concatenate(parts).astype(np.int64)
        assert sample.size == self.seq_length + 1, f"sample {idx} has {sample.size} tokens, expected {self.seq_length + 1}"
        return sample
