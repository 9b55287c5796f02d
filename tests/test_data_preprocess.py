"""Tokenizers, `tricorn tokenizer train`, `tricorn preprocess` (bad input, workers, atomic output) and the demo corpus."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from harness import demo_corpus_module

from tricorn.data.errors import DataError
from tricorn.data.indexed import IndexedDataset
from tricorn.data.preprocess import main as preprocess_main
from tricorn.data.preprocess import preprocess
from tricorn.data.tokenizer import NullTokenizer, SentencePieceTokenizer, cli_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    demo_corpus_module().build_corpus(str(path), max_bytes=300_000)
    return path


@pytest.fixture(scope="module")
def sp_model(corpus, tmp_path_factory) -> str:
    prefix = tmp_path_factory.mktemp("tok") / "sp"
    rc = cli_main(["train", "--input", str(corpus), "--vocab-size", "600", "--model-prefix", str(prefix), "--num-threads", "1"])
    assert rc == 0
    return f"{prefix}.model"


def test_demo_corpus_is_deterministic_and_capped(tmp_path, corpus):
    again = tmp_path / "again.jsonl"
    info = demo_corpus_module().build_corpus(str(again), max_bytes=300_000)
    assert again.read_bytes() == corpus.read_bytes()
    assert 0 < info.bytes <= 300_000 and info.documents == len(corpus.read_text().splitlines())
    assert all(isinstance(json.loads(line)["text"], str) for line in corpus.read_text().splitlines())
    assert [p.name for p in tmp_path.iterdir()] == ["again.jsonl"]  # no temp file left


def test_sentencepiece_tokenizer_round_trips_code(sp_model, corpus):
    tok = SentencePieceTokenizer(sp_model)
    assert tok.vocab_size == 600 and tok.eod == 2 and tok.pad == 3
    text = json.loads(corpus.read_text().splitlines()[0])["text"]
    ids = tok.encode(text)
    assert max(ids) < tok.vocab_size and len(ids) < 0.7 * len(text)  # BPE merged something (bytes would be >= 1 per char)
    assert tok.decode(ids) == text  # whitespace, indentation and newlines survive
    assert tok.decode(tok.encode("def f(x):\n    return  x\t# ü 你好\n")) == "def f(x):\n    return  x\t# ü 你好\n"


def test_tokenizer_cli_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert cli_main(["train", "--input", str(bad), "--vocab-size", "300", "--model-prefix", str(tmp_path / "t")]) == 1
    assert not list(tmp_path.glob("t*"))
    with pytest.raises(DataError, match="does not exist"):
        SentencePieceTokenizer(str(tmp_path / "missing.model"))
    (tmp_path / "junk.model").write_bytes(b"junk")
    with pytest.raises(DataError, match="not a sentencepiece model"):
        SentencePieceTokenizer(str(tmp_path / "junk.model"))


def test_null_tokenizer():
    tok = NullTokenizer(100)
    assert (tok.vocab_size, tok.eod) == (100, 99)
    assert tok.encode("1 2\n3") == [1, 2, 3] and tok.decode([1, 2]) == "1 2"
    with pytest.raises(ValueError):
        tok.encode("1 100")


def _write_jsonl(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def test_preprocess_counts_bad_lines_and_keeps_good_documents(tmp_path, sp_model, capsys):
    good = ["def a():\n    pass\n", "x = 1  # one", "print('hello')"]
    lines = [
        json.dumps({"text": good[0]}),
        '{"text": "unterminated',  # malformed JSON (line 2)
        json.dumps({"text": ""}),  # empty (line 3)
        json.dumps({"body": "no text key"}),  # missing key (line 4)
        json.dumps({"text": good[1], "other": 5}),
        "",  # blank line: not a document, not an error
        json.dumps({"text": good[2]}),
    ]
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, lines)
    out = tmp_path / "out" / "corpus"
    rc = preprocess_main(
        ["--input", str(src), "--output-prefix", str(out), "--tokenizer-type", "SentencePieceTokenizer"]
        + ["--tokenizer-model", sp_model, "--append-eod"]
    )
    assert rc == 0
    report = capsys.readouterr().out
    assert "wrote 4 documents" in report  # the empty one is kept, as Megatron keeps it
    assert "skipped 2 bad lines" in report and "malformed JSON 1" in report and "missing key 'text' 1" in report
    assert f"{src}:2 (malformed JSON)" in report and f"{src}:4 (missing key 'text')" in report
    assert "empty documents" not in report
    tok = SentencePieceTokenizer(sp_model)
    ds = IndexedDataset(str(out) + "_text_document")
    # Megatron writes a blank document as a document with no sequence and no eod.
    assert ds.dtype == np.uint16 and len(ds) == 3 and ds.document_indices.tolist() == [0, 1, 1, 2, 3]
    for i, text in enumerate(good):
        assert ds[i].tolist() == tok.encode(text) + [tok.eod]
    assert (
        preprocess_main(
            ["--input", str(src), "--output-prefix", str(out), "--tokenizer-type", "SentencePieceTokenizer"]
            + ["--tokenizer-model", sp_model, "--append-eod", "--drop-blank-documents"]
        )
        == 0
    )
    report = capsys.readouterr().out
    assert "wrote 3 documents" in report and "skipped 1 empty documents" in report and f"{src}:3" in report
    assert IndexedDataset(str(out) + "_text_document").document_indices.tolist() == [0, 1, 2, 3]


def test_blank_documents_kept_as_megatron_writes_them(tmp_path):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [json.dumps({"text": t}) for t in ["1 2", "   ", "3", "", "4 5 6"]])
    kept = preprocess([str(src)], str(tmp_path / "k"), "NullTokenizer", vocab_size=10, append_eod=True, progress=None)
    ds = IndexedDataset(kept.outputs[0])
    assert kept.documents == 5 and [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 9], [3, 9], [4, 5, 6, 9]]
    assert ds.document_indices.tolist() == [0, 1, 1, 2, 2, 3]  # blank: a document without a sequence (or eod)
    dropped = preprocess(
        [str(src)], str(tmp_path / "d"), "NullTokenizer", vocab_size=10, append_eod=True, progress=None, drop_blank_documents=True
    )
    assert dropped.documents == 3 and dropped.empty == 2
    assert IndexedDataset(dropped.outputs[0]).document_indices.tolist() == [0, 1, 2, 3]
    for ext in (".bin",):
        assert (tmp_path / f"k_text_document{ext}").read_bytes() == (tmp_path / f"d_text_document{ext}").read_bytes()


def test_legacy_tokenizers(tmp_path, sp_model):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [json.dumps({"text": "1 2"})])
    legacy = preprocess(
        [str(src)], str(tmp_path / "n"), "NullTokenizer", vocab_size=10, append_eod=True, progress=None, legacy_tokenizer=True
    )
    assert IndexedDataset(legacy.outputs[0])[0].tolist() == [1, 2, 10]  # legacy Megatron: eod is V, vocabulary V + 1
    text_src = tmp_path / "t.jsonl"
    _write_jsonl(text_src, [json.dumps({"text": "hello world"})])
    tok = SentencePieceTokenizer(sp_model)
    for legacy_flag, prefix in ((False, []), (True, [tok.bos])):
        out = preprocess(
            [str(text_src)],
            str(tmp_path / f"l{legacy_flag}"),
            "Llama2Tokenizer",
            sp_model,
            append_eod=True,
            progress=None,
            legacy_tokenizer=legacy_flag,
        )
        assert IndexedDataset(out.outputs[0])[0].tolist() == prefix + tok.encode("hello world") + [tok.eod]
    with pytest.raises(DataError, match="legacy"):
        preprocess([str(text_src)], str(tmp_path / "s"), "SentencePieceTokenizer", sp_model, progress=None, legacy_tokenizer=True)


def test_preprocess_workers_gz_multiple_inputs_and_keys(tmp_path, corpus, sp_model):
    docs = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    first = tmp_path / "a.jsonl.gz"
    with gzip.open(first, "wt", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"text": t, "title": t[:20] or "t"}) + "\n" for t in docs[:10])
    second = tmp_path / "b.jsonl"
    _write_jsonl(second, [json.dumps({"text": t, "title": t[:20] or "t"}) for t in docs[10:]] + ["[1, 2]"])
    common = ["--input", str(first), str(second), "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model]
    common += ["--json-keys", "text", "title", "--log-interval", "0"]
    assert preprocess_main(common + ["--output-prefix", str(tmp_path / "one")]) == 0
    assert preprocess_main(common + ["--output-prefix", str(tmp_path / "two"), "--workers", "2"]) == 0
    for key in ("text", "title"):
        for ext in (".bin", ".idx"):
            one = (tmp_path / f"one_{key}_document{ext}").read_bytes()
            assert one == (tmp_path / f"two_{key}_document{ext}").read_bytes()
    ds = IndexedDataset(str(tmp_path / "one_text_document"))
    assert len(ds) == len(docs)
    assert ds[11].tolist() == SentencePieceTokenizer(sp_model).encode(docs[11])


def test_strict_stops_at_first_bad_line_and_writes_nothing(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [json.dumps({"text": "1 2 3"}), json.dumps({"text": 7}), "{bad"])
    args = [
        "--input",
        str(src),
        "--output-prefix",
        str(tmp_path / "o"),
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "10",
    ]
    assert preprocess_main(args + ["--strict"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{src}:2: not a string" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
    assert preprocess_main(args) == 0  # without --strict the bad lines are skipped
    assert IndexedDataset(str(tmp_path / "o_text_document"))[0].tolist() == [1, 2, 3]


def test_preprocess_fatal_input_errors(tmp_path):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, ["{bad", json.dumps({"text": "   "})])
    with pytest.raises(DataError, match="no usable documents"):
        preprocess([str(src)], str(tmp_path / "o"), "NullTokenizer", vocab_size=10, progress=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
    with pytest.raises(DataError, match="does not exist"):
        preprocess([str(tmp_path / "missing.jsonl")], str(tmp_path / "o"), "NullTokenizer", vocab_size=10)
    truncated = tmp_path / "t.jsonl.gz"
    truncated.write_bytes(gzip.compress(b'{"text": "1 2"}\n' * 1000)[:-20])
    with pytest.raises(DataError, match="truncated"):
        preprocess([str(truncated)], str(tmp_path / "o"), "NullTokenizer", vocab_size=10, progress=None)
    assert not list(tmp_path.glob("o_*"))


def test_module_entry_point(tmp_path):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [json.dumps({"text": "4 5 6"})])
    cmd = [sys.executable, "-m", "tricorn.data.preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "o")]
    cmd += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "70000", "--append-eod"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    assert ds.dtype == np.int32 and ds[0].tolist() == [4, 5, 6, 69999]
