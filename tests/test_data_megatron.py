"""Sample i of tricorn equals sample i of megatron-core's GPTDataset / BlendedDataset (fixtures made by megatron-core).

tests/fixtures/megatron_gpt.npz was written by scripts/make_megatron_fixtures.py
running megatron-core itself (version pinned in the file): corpus sizes,
seeds, seq lengths, 1-5 epochs (short and long final epochs), splits,
weighted and unweighted blends, per-split paths. Each case's corpora are
rebuilt here from their stored sequence lengths with the same token recipe,
read through tricorn's loader, and every index array and the checked samples
(tokens, labels, loss mask with pad id 5) must be identical.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tricorn.config_args import config_from_args
from tricorn.data.base import batch_from_samples
from tricorn.data.blended import BlendedDataset
from tricorn.data.errors import DataError
from tricorn.data.indexed import IndexedDatasetBuilder
from tricorn.data.loader import build_split_source

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "megatron_gpt.npz"
VOCAB = 1000
PAD_ID = 5


def token_at(sequence: np.ndarray, position: np.ndarray) -> np.ndarray:
    """The fixture script's token recipe, written again (the test must not import megatron or the script)."""
    return (sequence * 31 + position * 7 + (position * position) % 13) % VOCAB


def write_corpus(prefix: str, lengths: np.ndarray) -> None:
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for s, n in enumerate(lengths.tolist()):
        builder.add_document(token_at(np.full(n, s), np.arange(n)), [n])
    builder.finalize(prefix + ".idx")


@pytest.fixture(scope="module")
def fixture() -> dict[str, np.ndarray]:
    with np.load(FIXTURES) as data:
        return {k: data[k] for k in data.files}


def case_ids() -> list[int]:
    with np.load(FIXTURES) as data:
        return list(range(int(data["num_cases"])))


def case_config(fx: dict, c: str, prefixes: list[str]):
    kind, weights = str(fx[f"{c}/kind"]), fx[f"{c}/weights"].tolist()
    paths = [str(x) for pair in zip(weights, prefixes) for x in pair] if weights else prefixes
    argv = ["--device", "cpu", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)]
    argv += ["--seq-length", str(int(fx[f"{c}/seq"])), "--seed", str(int(fx[f"{c}/seed"]))]
    argv += ["--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1"]
    if kind == "per_split":
        for flag in ("--train-data-path", "--valid-data-path", "--test-data-path"):
            argv += [flag, *paths]
    else:
        argv += ["--data-path", *paths, "--split", str(fx[f"{c}/split"])]
    return config_from_args(argv)


def assert_same(got, want, what: str) -> None:
    got = np.asarray(got)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, megatron-core {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, megatron-core {want.shape}"
    mismatch = np.flatnonzero((got != want).reshape(got.shape[0], -1).any(axis=1)) if got.size else []
    assert len(mismatch) == 0, f"{what}: first difference at {mismatch[0]} of {len(got)}"


def test_fixture_comes_from_megatron_core(fixture):
    assert str(fixture["megatron_core_version"]) == "0.19.2"
    kinds = {str(fixture[f"case{i}/kind"]) for i in case_ids()}
    assert kinds == {"single", "blend", "per_split"}
    # The grid covers 1-5 epochs and separate final epochs (a shuffle index that keeps its tail in place).
    epochs = set()
    for i in case_ids():
        for key in [k for k in fixture if k.startswith(f"case{i}/split0/c") and k.endswith("/document_index")]:
            docs = fixture[key.replace("document_index", "documents")]
            epochs.add(fixture[key].size // max(1, int(docs[1] - docs[0])))
    assert {1, 2, 3, 4, 5} <= epochs


@pytest.mark.parametrize("case", case_ids())
def test_indices_and_samples_equal_megatron_core(fixture, tmp_path, case):
    c = f"case{case}"
    prefixes = []
    for k in range(int(fixture[f"{c}/num_corpora"])):
        prefixes.append(str(tmp_path / f"corpus{k}"))
        write_corpus(prefixes[-1], fixture[f"{c}/lengths{k}"])
    cfg = case_config(fixture, c, prefixes)
    for split_index, size in enumerate(fixture[f"{c}/sizes"].tolist()):
        s = f"{c}/split{split_index}"
        if f"{s}/none" in fixture:  # megatron-core builds nothing; tricorn refuses a train split without data
            if split_index == 0:
                with pytest.raises(DataError, match="no documents"):
                    build_split_source(cfg, split_index, int(size))
            else:
                assert build_split_source(cfg, split_index, int(size)) is None, s
            continue
        source = build_split_source(cfg, split_index, int(size))
        assert source is not None and len(source) == int(fixture[f"{s}/len"]), s
        parts = [source]
        if f"{s}/dataset_index" in fixture:
            assert isinstance(source, BlendedDataset), f"{s}: megatron-core blends here"
            assert_same(source.dataset_index, fixture[f"{s}/dataset_index"], f"{s} dataset_index")
            assert_same(source.dataset_sample_index, fixture[f"{s}/dataset_sample_index"], f"{s} dataset_sample_index")
            parts = source.datasets
        else:
            assert not isinstance(source, BlendedDataset), f"{s}: megatron-core does not blend here"
        for p, part in enumerate(parts):
            want_samples = int(fixture[f"{s}/c{p}/num_samples"])
            assert part.num_samples == (None if want_samples < 0 else want_samples), f"{s}/c{p} num_samples"
            assert [int(part.documents[0]), int(part.documents[-1]) + 1] == fixture[f"{s}/c{p}/documents"].tolist()
            for name in ("document_index", "sample_index", "shuffle_index"):
                assert_same(getattr(part, name), fixture[f"{s}/c{p}/{name}"], f"{s}/c{p} {name}")
        checked = fixture[f"{s}/checked"].tolist()
        batch = batch_from_samples(torch.stack([torch.as_tensor(source[i]) for i in checked]), PAD_ID)
        for name in ("tokens", "labels", "loss_mask"):
            want = torch.from_numpy(fixture[f"{s}/{name}"])
            assert torch.equal(getattr(batch, name), want.to(getattr(batch, name).dtype)), f"{s} {name}"


def test_pad_labels_leave_the_loss():
    samples = torch.tensor([[1, PAD_ID, 2, PAD_ID, 3]])
    batch = batch_from_samples(samples, PAD_ID)
    assert batch.loss_mask.tolist() == [[0.0, 1.0, 0.0, 1.0]]
    assert batch.tokens.tolist() == [[1, 0, 2, 0]] and batch.labels.tolist() == [[0, 2, 0, 3]]
    assert batch_from_samples(samples).loss_mask.tolist() == [[1.0] * 4]  # no pad id: every position counts
