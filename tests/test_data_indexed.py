"""Megatron .bin/.idx byte compatibility, reading, and one-line errors on corrupt files."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from tricorn.data.errors import DataError
from tricorn.data.indexed import IndexedDataset, IndexedDatasetBuilder, best_token_dtype

# The spec, written out independently of tricorn/data/indexed.py.
CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7, np.uint16: 8}


def reference_write(prefix: str, docs: list[list[list[int]]], dtype, modes: list[int] | None = None) -> None:
    """docs: documents, each a list of sequences of token ids."""
    itemsize = np.dtype(dtype).itemsize
    lengths, pointers, doc_idx, ptr = [], [], [0], 0
    with open(prefix + ".bin", "wb") as fh:
        for doc in docs:
            for seq in doc:
                for tok in seq:
                    fh.write(np.array(tok, dtype=dtype).tobytes())
                lengths.append(len(seq))
                pointers.append(ptr)
                ptr += len(seq) * itemsize
            doc_idx.append(len(lengths))
    with open(prefix + ".idx", "wb") as fh:
        fh.write(b"MMIDIDX\x00\x00")
        fh.write(struct.pack("<Q", 1))
        fh.write(struct.pack("<B", CODES[dtype]))
        fh.write(struct.pack("<Q", len(lengths)))
        fh.write(struct.pack("<Q", len(doc_idx)))
        fh.write(b"".join(struct.pack("<i", n) for n in lengths))
        fh.write(b"".join(struct.pack("<q", p) for p in pointers))
        fh.write(b"".join(struct.pack("<q", d) for d in doc_idx))
        if modes is not None:
            fh.write(b"".join(struct.pack("<b", m) for m in modes))


def random_docs(rng: np.random.Generator, vocab: int, n: int) -> list[list[int]]:
    return [rng.integers(0, vocab, size=int(rng.integers(0, 50))).tolist() for _ in range(n)]


@pytest.mark.parametrize("vocab", [32000, 128256], ids=["uint16", "int32"])
def test_builder_bytes_equal_reference(tmp_path, vocab):
    dtype = best_token_dtype(vocab)
    assert dtype == (np.uint16 if vocab < 65500 else np.int32)
    docs = random_docs(np.random.default_rng(vocab), vocab, 40)
    docs[3] = []  # a zero-length sequence is legal in the format
    docs[5] = [vocab - 1]
    reference_write(str(tmp_path / "ref"), [[d] for d in docs], dtype)
    builder = IndexedDatasetBuilder(str(tmp_path / "ours.bin"), dtype)
    for i, doc in enumerate(docs):
        if i % 2:
            builder.add_item(np.array(doc))
            builder.end_document()
        else:
            builder.add_document(doc, [len(doc)])
    builder.finalize(str(tmp_path / "ours.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()
    # the bulk path used by preprocessing writes the same bytes
    bulk = IndexedDatasetBuilder(str(tmp_path / "bulk.bin"), dtype)
    bulk.add_documents(np.concatenate([np.array(d, dtype=np.int64) for d in docs]), [len(d) for d in docs])
    bulk.finalize(str(tmp_path / "bulk.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"bulk{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_reads_reference_files(tmp_path, dtype):
    rng = np.random.default_rng(1)
    docs = [[s for s in random_docs(rng, 1000, int(rng.integers(1, 4)))] for _ in range(12)]  # multi-sequence documents
    reference_write(str(tmp_path / "ref"), docs, dtype)
    ds = IndexedDataset(str(tmp_path / "ref"))
    flat = [seq for doc in docs for seq in doc]
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == len(flat)
    assert ds.sequence_lengths.tolist() == [len(s) for s in flat]
    assert ds.document_indices.tolist() == np.cumsum([0] + [len(d) for d in docs]).tolist()
    assert ds.sequence_modes is None
    for i, seq in enumerate(flat):
        assert ds[i].tolist() == seq
    longest = int(np.argmax(ds.sequence_lengths))
    assert ds.get(longest, offset=2, length=3).tolist() == flat[longest][2:5]
    assert ds.get(longest, offset=2).tolist() == flat[longest][2:]
    assert [a.tolist() for a in ds[1:4]] == flat[1:4]
    with pytest.raises(IndexError):
        ds.get(longest, offset=1, length=len(flat[longest]))


def test_sequence_modes_block(tmp_path):
    reference_write(str(tmp_path / "ref"), [[[1, 2], [3]], [[4]]], np.uint16, modes=[0, 1, 0])
    ds = IndexedDataset(str(tmp_path / "ref"), multimodal=True)
    assert ds.sequence_modes.tolist() == [0, 1, 0]
    builder = IndexedDatasetBuilder(str(tmp_path / "ours.bin"), np.uint16, multimodal=True)
    builder.add_document([1, 2, 3], [2, 1], modes=[0, 1])
    builder.add_item([4])
    builder.end_document()
    builder.finalize(str(tmp_path / "ours.idx"))
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "ref.idx").read_bytes()


def test_finalize_is_atomic_and_abort_cleans_up(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint16)
    builder.add_item([1, 2, 3])
    builder.end_document()
    assert not (tmp_path / "d.bin").exists() and not (tmp_path / "d.idx").exists()
    builder.abort()
    assert os.listdir(tmp_path) == []


def _single_line_error(prefix: str) -> str:
    with pytest.raises(DataError) as info:
        IndexedDataset(prefix)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_corrupt_files_give_one_line_errors(tmp_path):
    prefix = str(tmp_path / "d")
    reference_write(prefix, [[[1, 2, 3]], [[4, 5]]], np.uint16)
    IndexedDataset(prefix)  # sane before we break it

    data = (tmp_path / "d.bin").read_bytes()
    (tmp_path / "d.bin").write_bytes(data[:-2])  # truncated .bin
    message = _single_line_error(prefix)
    assert "d.bin" in message and "truncated" in message and "8 bytes" in message and "10" in message
    (tmp_path / "d.bin").write_bytes(data)

    index = (tmp_path / "d.idx").read_bytes()
    (tmp_path / "d.idx").write_bytes(b"XXXXXXXXX" + index[9:])  # wrong magic
    message = _single_line_error(prefix)
    assert "d.idx" in message and "magic" in message

    (tmp_path / "d.idx").write_bytes(index[:9] + struct.pack("<Q", 2) + index[17:])
    assert "version 2" in _single_line_error(prefix)
    (tmp_path / "d.idx").write_bytes(index[:17] + bytes([99]) + index[18:])
    assert "dtype code 99" in _single_line_error(prefix)
    (tmp_path / "d.idx").write_bytes(index[:-5])
    assert "truncated" in _single_line_error(prefix)
    (tmp_path / "d.idx").write_bytes(index[:20])
    assert "header" in _single_line_error(prefix)
    os.remove(tmp_path / "d.idx")
    assert "does not exist" in _single_line_error(prefix)


def test_add_index_merges_shards(tmp_path):
    reference_write(str(tmp_path / "a"), [[[1, 2]], [[3]]], np.uint16)
    reference_write(str(tmp_path / "b"), [[[4, 5, 6]]], np.uint16)
    reference_write(str(tmp_path / "ab"), [[[1, 2]], [[3]], [[4, 5, 6]]], np.uint16)
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), np.uint16)
    builder.add_index(str(tmp_path / "a"))
    builder.add_index(str(tmp_path / "b"))
    builder.finalize(str(tmp_path / "m.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"m{ext}").read_bytes() == (tmp_path / f"ab{ext}").read_bytes()
