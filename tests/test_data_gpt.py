"""GPT samples (spans, epochs, shuffle), Megatron split semantics, the index cache, and blending."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tricorn.data.blended import BlendedDataset, blend_sizes, build_blending_indices, normalize_weights
from tricorn.data.errors import DataError
from tricorn.data.gpt_dataset import GPTDataset, split_ranges
from tricorn.data.indexed import IndexedDataset, IndexedDatasetBuilder

ROOT = Path(__file__).resolve().parents[1]


def make_dataset(prefix: str, lengths: list[int], low: int = 0, high: int = 1000, seed: int = 0) -> IndexedDataset:
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for n in lengths:
        builder.add_document(rng.integers(low, high, size=n), [n])
    builder.finalize(prefix + ".idx")
    return IndexedDataset(prefix)


@pytest.fixture
def indexed(tmp_path) -> IndexedDataset:
    lengths = np.random.default_rng(7).integers(1, 60, size=50).tolist()
    lengths[4] = lengths[20] = 0  # empty documents must be stepped over
    return make_dataset(str(tmp_path / "d"), lengths)


def test_samples_span_documents_in_shuffled_epoch_order(indexed):
    documents = np.arange(5, 45)
    seq = 16
    tokens_per_epoch = int(indexed.sequence_lengths[documents].sum())
    ds = GPTDataset(indexed, documents, num_samples=200, seq_length=seq, seed=3)
    epochs = ds.document_index.size // documents.size
    assert epochs == -(-(200 * seq + 1) // tokens_per_epoch) and ds.document_index.size == epochs * documents.size
    # Megatron shuffles the repeated list as a whole: every document appears `epochs` times, not once per epoch.
    assert np.bincount(ds.document_index, minlength=45)[5:].tolist() == [epochs] * documents.size
    assert ds.document_index.dtype == np.int32
    assert any(sorted(e.tolist()) != documents.tolist() for e in ds.document_index.reshape(epochs, -1))
    assert len(ds) == (epochs * tokens_per_epoch - 1) // seq >= 200
    assert sorted(np.asarray(ds.shuffle_index).tolist()) == list(range(len(ds)))
    # Reference: the documents laid end to end; sample i is seq + 1 tokens starting at shuffle_index[i] * seq.
    flat = np.concatenate([indexed[int(d)] for d in ds.document_index]).astype(np.int64)
    for i in range(len(ds)):
        start = int(ds.shuffle_index[i]) * seq
        got = ds[i]
        assert got.dtype == np.int64 and got.shape == (seq + 1,)
        assert np.array_equal(got, flat[start : start + seq + 1]), i
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_short_final_epoch_is_shuffled_separately(indexed):
    documents = np.arange(50)
    seq = 8
    per_epoch = (int(indexed.sequence_lengths.sum()) - 1) // seq
    ds = GPTDataset(indexed, documents, num_samples=per_epoch + 3, seq_length=seq, seed=1)  # a 2nd epoch barely used
    first = (int(indexed.sequence_lengths.sum()) - 1) // seq
    assert set(np.asarray(ds.shuffle_index[:first]).tolist()) == set(range(first))
    # ... and its documents are shuffled after, and apart from, the first epoch's.
    assert sorted(ds.document_index[: documents.size].tolist()) == documents.tolist()
    full = GPTDataset(indexed, documents, num_samples=2 * per_epoch - 2, seq_length=seq, seed=1)  # nearly two epochs: one shuffle
    assert set(np.asarray(full.shuffle_index[:first]).tolist()) != set(range(first))


def test_one_epoch_when_num_samples_is_none(indexed):
    ds = GPTDataset(indexed, np.arange(50), None, 8, seed=1)
    assert ds.document_index.size == 50 and len(ds) == (int(indexed.sequence_lengths.sum()) - 1) // 8


def test_first_sample_starts_at_the_first_document_even_when_empty(tmp_path):
    ds = make_dataset(str(tmp_path / "e"), [0, 5, 0, 7, 9])
    for seed in range(20):
        index = GPTDataset(ds, np.arange(5), 4, 3, seed=seed)
        assert index.sample_index[0].tolist() == [0, 0]  # Megatron's helper: (0, 0), not the first non-empty document
        flat = np.concatenate([ds[int(d)] for d in index.document_index]).astype(np.int64)
        assert np.array_equal(index[int(np.flatnonzero(np.asarray(index.shuffle_index) == 0)[0])], flat[:4])
        if int(ds.sequence_lengths[int(index.document_index[0])]) == 0:
            break
    else:
        raise AssertionError("no seed put an empty document first")


def megatron_core_split(split: str, n: int) -> list[tuple[int, int]]:
    """megatron-core's parse_and_normalize_split + convert_split_vector_to_split_matrix + its rounding, written out."""
    weights = [float(x) for x in split.replace("/", ",").split(",")]
    weights += [0.0] * (3 - len(weights))
    weights = [w / sum(weights) for w in weights]
    bookends = [0.0]
    for w in weights:
        bookends.append(bookends[-1] + w)
    return [
        (int(round(bookends[i] * float(n))), int(round(bookends[i + 1] * float(n)))) if bookends[i + 1] > bookends[i] else (0, 0)
        for i in range(3)
    ]


@pytest.mark.parametrize("split", ["969,30,1", "98,2", "1,1,1", "900/50/50", "100", "0,1,1"])
@pytest.mark.parametrize("n", [1, 7, 359, 1000, 12345])
def test_split_matches_megatron_core(split, n):
    assert split_ranges(split, n) == megatron_core_split(split, n)


def legacy_megatron_lm_split(split: str, n: int) -> list[tuple[int, int]]:
    """Legacy Megatron-LM's get_split_indices: round each share, the rounding error moves the later bounds."""
    weights = [float(x) for x in split.split(",")]
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / sum(weights) * float(n))))
    excess = bounds[-1] - n
    bounds[1:] = [b - excess for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def test_split_rounds_cumulative_boundaries_not_legacy_shares():
    # The measurement: with --split 969,30,1 the two rules differ for 4860 of the sizes 1..20000.
    differ = sum(split_ranges("969,30,1", n) != legacy_megatron_lm_split("969,30,1", n) for n in range(1, 20001))
    assert differ == 4860


def test_split_rejects_nonsense():
    with pytest.raises(DataError, match="--split"):
        split_ranges("0,0,0", 10)


def test_cache_is_reused_and_keyed(tmp_path, indexed):
    cache = str(tmp_path / "cache")
    docs = np.arange(50)
    first = GPTDataset(indexed, docs, 100, 16, seed=5, cache_path=cache, split="train")
    assert not first.from_cache
    files = sorted(os.listdir(cache))
    assert files == sorted(
        f"{first.cache_key}-GPTDataset-train-{n}"
        for n in ("description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy")
    )
    again = GPTDataset(indexed, docs, 100, 16, seed=5, cache_path=cache, split="train")
    assert again.from_cache and again.cache_key == first.cache_key
    assert isinstance(again.shuffle_index, np.memmap)
    assert all(np.array_equal(again[i], first[i]) for i in range(len(first)))
    keys = {first.cache_key}
    for changed in (dict(seed=6), dict(seq_length=8), dict(num_samples=101), dict(documents=np.arange(49))):
        kwargs = dict(indexed=indexed, documents=docs, num_samples=100, seq_length=16, seed=5, cache_path=cache)
        kwargs.update(changed)
        other = GPTDataset(**kwargs)
        assert not other.from_cache and other.cache_key not in keys
        keys.add(other.cache_key)
    assert not [f for f in os.listdir(cache) if ".tmp" in f]


_RANK_SCRIPT = """
import json, os, sys, time
import numpy as np, torch.distributed as dist
import tricorn.data.gpt_dataset as g
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2, init_method="tcp://127.0.0.1:" + os.environ["PORT"])
if rank == 0:  # a slow builder: rank 1 must wait at the barrier and then read rank 0's files
    build = g.build_indices
    g.build_indices = lambda *a: (time.sleep(1.0), build(*a))[1]
ds = g.GPTDataset(g.IndexedDataset(sys.argv[1]), np.arange(50), 100, 16, 5, sys.argv[2])
out = dict(from_cache=ds.from_cache, samples=[ds[i].tolist() for i in range(len(ds))])
json.dump(out, open(sys.argv[3] + str(rank), "w"))
dist.destroy_process_group()
"""


def test_rank0_builds_cache_others_wait_and_read(tmp_path, indexed):
    from harness import free_port

    env = dict(os.environ, PORT=str(free_port()), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    args = [sys.executable, "-c", _RANK_SCRIPT, indexed.path_prefix, str(tmp_path / "cache"), str(tmp_path / "out")]
    procs = [subprocess.Popen(args, env=dict(env, RANK=str(r)), stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()
    r0, r1 = (json.loads((tmp_path / f"out{r}").read_text()) for r in range(2))
    assert (r0["from_cache"], r1["from_cache"]) == (False, True)
    assert r0["samples"] == r1["samples"]


def test_blending_is_megatrons_greedy_interleave():
    indices = build_blending_indices([0.3, 0.7], 1000)
    which = indices["dataset_index"]
    assert which.dtype == np.int16 and np.bincount(which).tolist() == [300, 700]
    # The C++ helper's first steps: n=0 and n=1 both use max(n, 1) = 1, so dataset 1 (0.7) goes first, then 0.
    assert which[:10].tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    for k in (0, 1):  # each dataset's samples are taken in order, each once
        assert indices["dataset_sample_index"][which == k].tolist() == list(range(np.sum(which == k)))
    assert build_blending_indices([0.5, 0.5], 4)["dataset_index"].tolist() == [0, 1, 0, 1]  # ties: lower index


def test_vectorised_blend_equals_the_step_by_step_greedy():
    from tricorn.data.blended import _greedy_steps

    rng = np.random.default_rng(4)
    for k in (2, 2, 2, 3):
        weights = normalize_weights(rng.dirichlet(np.ones(k)))
        size = int(rng.integers(1, 40_000))
        exact = np.zeros(size, dtype=np.int16)
        _greedy_steps(weights, np.zeros(k, dtype=np.int64), 0, size, exact)
        assert np.array_equal(build_blending_indices(weights, size)["dataset_index"], exact), (weights, size)


def test_blend_sizes_follow_megatron_core():
    assert blend_sizes([0.3, 0.7], 1000) == [300, 700]
    assert blend_sizes([1, 2], 10) == [4, 7]  # ceil each share: the blend holds 11 > 10 samples
    assert blend_sizes([0.3, 0.7], 1000, 0.005) == [302, 704]  # the 0.5% surplus each dataset is built with


def test_blended_dataset_draws_by_weight(tmp_path):
    a = make_dataset(str(tmp_path / "a"), [30] * 40, 0, 500, seed=1)
    b = make_dataset(str(tmp_path / "b"), [30] * 40, 500, 1000, seed=2)
    parts = [GPTDataset(ds, np.arange(40), int(c), 16, 1) for ds, c in zip((a, b), blend_sizes([0.3, 0.7], 1000, 0.005))]
    blend = BlendedDataset(parts, [0.3, 0.7], 1000, cache_path=str(tmp_path / "cache"))
    from_a = sum(int(blend[i][0] < 500) for i in range(len(blend)))
    assert from_a == 300
    assert BlendedDataset(parts, [0.3, 0.7], 1000, cache_path=str(tmp_path / "cache")).from_cache
    with pytest.raises(DataError, match="needs|needed"):
        BlendedDataset([parts[0], GPTDataset(b, np.arange(2), 1, 16, 1)], [0.01, 0.99], 1000)
