"""build_loaders / prepare_vocab from a Config: DP invariance, exact resume, blending, splits, vocab checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from harness import demo_corpus_module

from tricorn.config_args import config_from_args
from tricorn.data.base import MockSamples
from tricorn.data.indexed import IndexedDatasetBuilder
from tricorn.data.loader import build_loaders, prepare_vocab
from tricorn.data.tokenizer import build_tokenizer, train_sentencepiece

ROOT = Path(__file__).resolve().parents[1]
GBS = 8


def write_dataset(prefix: Path, num_docs: int, low: int, high: int, seed: int, dtype=np.uint16) -> str:
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for n in rng.integers(1, 80, size=num_docs):
        builder.add_document(rng.integers(low, high, size=int(n)), [int(n)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture
def data(tmp_path) -> dict[str, str]:
    return {
        "a": write_dataset(tmp_path / "a_text_document", 300, 0, 500, seed=1),
        "b": write_dataset(tmp_path / "b_text_document", 300, 500, 1000, seed=2),
    }


def make_cfg(*flags: str, train_iters: int = 10, world_size: int = 1):
    argv = ["--device", "cpu", "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", str(GBS)]
    argv += ["--train-iters", str(train_iters), "--eval-interval", "5", "--eval-iters", "2", "--seed", "11"]
    return config_from_args(argv + list(flags), world_size=world_size)


def null_cfg(data_path: list[str], *flags: str, **kw):
    cfg = make_cfg("--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--data-path", *data_path, *flags, **kw)
    assert prepare_vocab(cfg) == []
    return cfg


def global_batches(cfg, dp_size: int, consumed: int = 0, count: int = 5) -> list[torch.Tensor]:
    """Tokens of `count` global batches, stitched from every DP rank's slice."""
    loaders = [build_loaders(cfg, rank, dp_size, consumed)[0] for rank in range(dp_size)]
    return [torch.cat([loader.next(GBS).tokens for loader in loaders]) for _ in range(count)]


def test_global_batches_do_not_depend_on_dp_size(data, tmp_path):
    cfg = null_cfg([data["a"]], "--data-cache-path", str(tmp_path / "cache"))
    reference = global_batches(cfg, 1)
    assert len({tuple(b.flatten().tolist()) for b in reference}) == 5  # real, distinct batches
    for dp in (2, 4):
        assert all(torch.equal(x, y) for x, y in zip(global_batches(cfg, dp), reference)), f"DP={dp} differs"


def test_resume_at_consumed_samples_continues_exactly(data):
    cfg = null_cfg(["0.5", data["a"], "0.5", data["b"]])
    uninterrupted = global_batches(cfg, 2, count=6)
    k = 3 * GBS
    resumed = global_batches(cfg, 2, consumed=k, count=3)
    assert all(torch.equal(x, y) for x, y in zip(resumed, uninterrupted[3:]))
    loader = build_loaders(cfg, 0, 1)[0]
    loader.load_state_dict({"consumed_samples": k})
    batch = loader.next(GBS)
    assert torch.equal(batch.tokens, uninterrupted[3]) and loader.state_dict() == {"consumed_samples": k + GBS}
    assert torch.equal(batch.labels[:, :-1], batch.tokens[:, 1:])


def test_blend_weights_over_1000_samples(data):
    cfg = null_cfg(["0.3", data["a"], "0.7", data["b"]], train_iters=125)  # 125 x 8 = 1000 samples
    train, valid, test = build_loaders(cfg, 0, 1)
    assert len(train.source) == 1000
    from_a = sum(int(train.source[i][0] < 500) for i in range(1000))
    # Integer counts: the blend rounds each weight x 1000 to within one sample.
    assert abs(from_a - 300) <= 1 and abs((1000 - from_a) - 700) <= 1
    # megatron-core: each dataset contributes ceil(size * weight), so the blend holds 125 + 292 > 416 samples.
    assert valid is not None and len(valid.source) == 417 and (125 // 5 + 1) * 2 * GBS == 416


def test_splits_and_explicit_paths(data):
    cfg = null_cfg([data["a"]], "--split", "90,10,0")
    train, valid, test = build_loaders(cfg, 0, 1)
    assert test is None
    assert train.source.documents.tolist() == list(range(270)) and valid.source.documents.tolist() == list(range(270, 300))
    cfg = make_cfg("--vocab-size", "1000", "--train-data-path", data["a"], "--valid-data-path", data["b"] + ".bin")
    assert prepare_vocab(cfg) == []
    train, valid, test = build_loaders(cfg, 0, 1)
    assert test is None and train.source.documents.size == 300
    assert valid.source.indexed.path_prefix == data["b"] and valid.source.documents.size == 300
    cfg = null_cfg([data["a"]], "--eval-iters", "0")
    assert build_loaders(cfg, 0, 1)[1:] == (None, None)


def test_mock_data_loaders():
    cfg = make_cfg("--mock-data", "--vocab-size", "77")
    assert prepare_vocab(cfg) == []
    train, valid, test = build_loaders(cfg, 1, 2, consumed_samples=16)
    assert isinstance(train.source, MockSamples) and train.consumed_samples == 16 and train.dp_rank == 1
    assert (train.source.seed, valid.source.seed) == (11, 12) and valid.source.vocab_size == 77


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("tok")
    demo_corpus_module().build_corpus(str(tmp / "c.jsonl"), max_bytes=100_000)
    return train_sentencepiece([str(tmp / "c.jsonl")], 600, str(tmp / "sp"), num_threads=1)


def test_prepare_vocab_takes_or_checks_the_tokenizer_vocabulary(data, sp_model):
    sp = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model, "--data-path", data["a"]]
    cfg = make_cfg(*sp)
    assert prepare_vocab(cfg) == [] and cfg.model.vocab_size == 600
    cfg = make_cfg(*sp, "--vocab-size", "1024")
    assert prepare_vocab(cfg) == [] and cfg.model.vocab_size == 1024  # larger: the user's is kept
    # Smaller is refused even where the padding would hold every id (520 pads to 640): a checkpoint keeps the
    # real rows only, so ids 520..599 would lose their embeddings at the first save.
    for smaller in ("520", "500"):
        errors = prepare_vocab(make_cfg(*sp, "--vocab-size", smaller))
        assert len(errors) == 1 and f"--vocab-size {smaller} is smaller" in errors[0] and "600" in errors[0]
        assert "\n" not in errors[0]


def test_prepare_vocab_reports_bad_data(data, tmp_path):
    cfg = make_cfg("--vocab-size", "1000", "--data-path", str(tmp_path / "missing"))
    assert "does not exist" in prepare_vocab(cfg)[0]
    (tmp_path / "b_text_document.bin").write_bytes((tmp_path / "b_text_document.bin").read_bytes()[:-3])
    errors = prepare_vocab(make_cfg("--vocab-size", "1000", "--data-path", "0.5", data["a"], "0.5", data["b"]))
    assert len(errors) == 1 and "b_text_document.bin" in errors[0] and "truncated" in errors[0]
    errors = prepare_vocab(make_cfg("--vocab-size", "100", "--make-vocab-size-divisible-by", "4", "--data-path", data["a"]))
    assert len(errors) == 1 and "outside the model's vocabulary [0, 100)" in errors[0]
    errors = prepare_vocab(make_cfg("--vocab-size", "1000", "--data-path", "0.5", data["a"], "0.5"))
    assert len(errors) == 1 and "WEIGHT PREFIX" in errors[0]
    errors = prepare_vocab(make_cfg("--vocab-size", "1000", "--data-path", data["a"], "--split", "0,1,0"))
    assert len(errors) == 1 and "no training documents" in errors[0]
    errors = prepare_vocab(make_cfg("--tokenizer-type", "SentencePieceTokenizer", "--data-path", data["a"]))
    assert len(errors) == 1 and "--tokenizer-model" in errors[0]


def test_pad_labels_are_masked_for_every_sentencepiece_tokenizer_type(tmp_path, sp_model):
    prefix = write_dataset(tmp_path / "p_text_document", 60, 0, 8, seed=3)  # ids 0..7: pad (3) is frequent
    for tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        cfg = make_cfg("--tokenizer-type", tokenizer_type, "--tokenizer-model", sp_model, "--data-path", prefix)
        assert prepare_vocab(cfg) == [] and cfg.model.vocab_size == 600
        batch = build_loaders(cfg, 0, 1)[0].next(GBS)
        pads = batch.loss_mask == 0
        assert pads.any() and torch.all(batch.labels[pads] == 0) and not torch.any(batch.tokens == 3)
        assert torch.all(batch.labels[~pads] != 3)
    cfg = null_cfg([prefix])  # NullTokenizer has no pad: every position counts
    assert torch.all(build_loaders(cfg, 0, 1)[0].next(GBS).loss_mask == 1)


def test_legacy_null_tokenizer_vocabulary(data):
    cfg = make_cfg("--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--legacy-tokenizer", "--data-path", data["a"])
    assert prepare_vocab(cfg) == []
    tok = build_tokenizer(cfg)
    assert (tok.vocab_size, tok.eod, tok.pad) == (1001, 1000, -1)  # legacy Megatron: eod V on top of V text ids
    cfg = make_cfg("--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--data-path", data["a"])
    assert prepare_vocab(cfg) == [] and (build_tokenizer(cfg).vocab_size, build_tokenizer(cfg).eod) == (1000, 999)
