"""Documents in a sample: --reset-position-ids, --reset-attention-mask, --eod-mask-loss equal megatron-core's.

tests/fixtures/megatron_documents.npz was written by scripts/make_megatron_document_fixtures.py running
megatron-core 0.19.2 itself: corpora whose documents end with the end-of-document token (with pad ids and empty
documents), each flag alone and all three, documents longer than a sample and many short ones per sample. For
every sample of the train split, tricorn's loader (the same data, split, seed and flags) must give the same
tokens, labels, loss mask and positions, and its document bounds must allow exactly the keys megatron-core's
attention mask allows (the fixture keeps, per query row, the first key the mask allows; the script asserts the
mask is causal from there).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_data_megatron import load_npz, npz_cases

from tricorn.config_args import config_from_args
from tricorn.data.base import GlobalBatchLoader
from tricorn.data.documents import document_bounds, document_starts, starts_from_bounds
from tricorn.data.indexed import IndexedDatasetBuilder
from tricorn.data.loader import build_split_source, document_flags

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "megatron_documents.npz"
VOCAB, PAD_ID, EOD_ID = 1000, 5, 999
FLAGS = ("--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss")


def token_at(sequence: np.ndarray, position: np.ndarray) -> np.ndarray:
    """The fixture script's recipe, written again (the test must not import megatron or the script)."""
    tokens = (sequence * 31 + position * 7 + (position * position) % 13) % (VOCAB - 1)
    return np.where((sequence % 7 == 0) & (position == 3), PAD_ID, tokens)


def write_corpus(prefix: str, lengths: np.ndarray) -> None:
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for s, n in enumerate(lengths.tolist()):
        builder.add_document(np.concatenate([token_at(np.full(n, s), np.arange(n)), [EOD_ID]]), [n + 1])
    builder.finalize(prefix + ".idx")


@pytest.fixture(scope="module")
def fixture() -> dict[str, np.ndarray]:
    return load_npz(FIXTURES)


def case_ids() -> list[int]:
    return npz_cases(FIXTURES)


def test_fixture_comes_from_megatron_core(fixture):
    assert str(fixture["megatron_core_version"]) == "0.19.2"
    flags = {tuple(fixture[f"case{i}/flags"].tolist()) for i in case_ids()}
    assert flags >= {(True, True, True), (True, False, False), (False, True, False), (False, False, True)}
    # The corpora really pack several documents into a sample (else the test would prove nothing).
    assert max(int((fixture[f"case{i}/tokens"] == EOD_ID).sum(1).max()) for i in case_ids()) >= 5


@pytest.mark.parametrize("case", case_ids())
def test_every_sample_equals_megatron_core(fixture, tmp_path, case):
    c = f"case{case}"
    prefix = str(tmp_path / "corpus")
    write_corpus(prefix, fixture[f"{c}/lengths"])
    seq, seed, split = int(fixture[f"{c}/seq"]), int(fixture[f"{c}/seed"]), str(fixture[f"{c}/split"])
    argv = ["--device", "cpu", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--data-path", prefix]
    argv += ["--split", split, "--seq-length", str(seq), "--seed", str(seed), "--train-iters", "1"]
    argv += [flag for flag, on in zip(FLAGS, fixture[f"{c}/flags"].tolist()) if on]
    cfg = config_from_args(argv)
    want = {k: torch.from_numpy(fixture[f"{c}/{k}"]) for k in ("tokens", "labels", "loss_mask", "position_ids", "first_key")}
    n = want["tokens"].shape[0]
    source = build_split_source(cfg, 0, n)
    assert source is not None and len(source) == n
    batch = GlobalBatchLoader(source, 0, 1, pad_id=PAD_ID, documents=document_flags(cfg)).next(n)
    for name in ("tokens", "labels", "loss_mask"):
        assert torch.equal(getattr(batch, name), want[name].to(getattr(batch, name).dtype)), f"{c} {name}"
    reset_positions, reset_mask, _ = fixture[f"{c}/flags"].tolist()
    positions = batch.position_ids if reset_positions else torch.arange(seq).expand(n, seq)
    assert (batch.position_ids is None) == (not reset_positions)
    assert torch.equal(positions, want["position_ids"]), f"{c} position_ids"
    if reset_mask:
        assert batch.documents.dtype == torch.int32 and batch.documents.shape == (n, seq + 1)
        assert torch.equal(starts_from_bounds(batch.documents), want["first_key"]), f"{c} document boundaries"
    else:
        assert batch.documents is None and not want["first_key"].any()  # one document as far as attention goes


def test_bounds_and_starts_agree_on_edge_cases():
    eod = 9
    tokens = torch.tensor([[9, 9, 1, 2, 9, 3], [1, 2, 3, 4, 5, 9], [1, 2, 3, 4, 5, 6]])
    assert document_bounds(tokens, eod).tolist() == [[0, 1, 2, 5, 6, 6, 6], [0, 6, 6, 6, 6, 6, 6], [0] + [6] * 6]
    assert torch.equal(starts_from_bounds(document_bounds(tokens, eod)), document_starts(tokens, eod))
    # an eod as the last input token ends a document without starting one inside the sample
    assert document_starts(tokens, eod)[1].tolist() == [0] * 6


def test_a_tokenizer_without_an_end_of_document_token_is_refused(monkeypatch):
    from types import SimpleNamespace

    from tricorn.data import loader

    cfg = config_from_args(["--device", "cpu", "--mock-data", "--vocab-size", "100", "--reset-attention-mask", "--eod-mask-loss"])
    assert loader.document_flag_errors(cfg) == []  # the NullTokenizer's eod is V - 1
    monkeypatch.setattr(loader, "_document_tokenizer", lambda cfg: SimpleNamespace(eod=-1))  # a model without eos
    (line,) = loader.document_flag_errors(cfg)
    assert line.startswith("--reset-attention-mask --eod-mask-loss read the end-of-document token, but tokenizer")


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--window-size", "4096,4096"], "RIGHT must be 0; use --window-size 4096,0"),
        (["--window-size", "0"], "LEFT must be a positive number"),
        (["--window-size", "1,0,0"], "must be LEFT or LEFT,RIGHT"),
        (["--window-size", "a"], "must be integers separated by a comma"),
        (["--reset-attention-mask", "--attention-dropout", "0.1"], "--attention-dropout 0.1 with --reset-attention-mask"),
    ],
)
def test_bad_document_and_window_input_is_one_line(tmp_path, extra, needle):
    from badinput import assert_refused
    from harness import BASE_FLAGS

    assert_refused(BASE_FLAGS + extra, tmp_path, needle=needle)
