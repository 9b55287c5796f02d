"""Megatron-LM's indexed dataset (.bin/.idx), byte for byte, with Megatron's class and method names.

.idx layout (little endian):
    b"MMIDIDX\\x00\\x00"               9-byte magic
    <Q version = 1
    <B dtype code (uint8=1 int8=2 int16=3 int32=4 int64=5 float64=6 float32=7 uint16=8)
    <Q sequence count S, <Q document count D (= documents + 1)
    int32[S] sequence lengths, int64[S] byte pointers into .bin,
    int64[D] document indices (sequence index where each document starts; first 0, last S)
    int8[S]  sequence modes (optional, multimodal data only)
.bin: the tokens of all sequences, concatenated.

For GPT data each document is one sequence. Reading memory-maps both files
(no copy; pages come from the OS cache). Opening validates the whole index,
vectorised in bounded chunks: the header (an integer token dtype), non-negative
lengths, every pointer equal to the previous one plus its sequence's bytes,
document indices non-decreasing from 0 to the sequence count, and the .bin
length; so a truncated, corrupt or foreign file is one clear DataError instead
of garbage tokens. `token_range()` reads the whole .bin (chunked) for the
smallest and largest token id. The builder writes to temporary
names and renames at finalize, so an interrupted run never leaves a pair that
looks complete. No collectives.
"""

from __future__ import annotations

import array
import os
import struct
from collections.abc import Sequence
from typing import Any, Optional, Union

import numpy as np

from tricorn.data.errors import DataError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count

DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
# Entries per vectorised pass over the index or the tokens: bounds the temporaries (~128 MiB of int64).
_CHUNK = 1 << 24


def best_token_dtype(vocab_size: Optional[int]) -> type:
    """Megatron's rule: uint16 when every id fits with room to spare, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def dtype_code(dtype: Any) -> int:
    try:
        return _CODE_OF[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise DataError(
            f"dtype {dtype} cannot be stored in a Megatron .bin; use one of {sorted(str(np.dtype(t)) for t in DTYPE_CODES.values())}"
        )


def _as_array(tokens: Any, dtype: np.dtype) -> np.ndarray:
    if hasattr(tokens, "detach"):  # a torch tensor, without importing torch here
        tokens = tokens.detach().cpu().numpy()
    return np.asarray(tokens, dtype=dtype).reshape(-1)


class IndexedDatasetBuilder:
    """Writes `bin_path` and, at finalize(idx_path), the index; both appear under their names only then."""

    def __init__(self, bin_path: str, dtype: Any = np.int32, multimodal: bool = False):
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self.bin_path = bin_path
        self._tmp_bin = f"{bin_path}.tmp-{os.getpid()}"
        self.data_file = open(self._tmp_bin, "wb")
        self.multimodal = multimodal
        # array.array keeps 4/8 bytes per entry; a list of ints costs ~36 at 100M documents.
        self.sequence_lengths = array.array("i")
        self.document_indices = array.array("q", [0])
        self.sequence_modes: Optional[array.array] = array.array("b") if multimodal else None

    def add_item(self, tensor: Any, mode: int = 0) -> None:
        """Append one sequence (it joins the current document until end_document)."""
        tokens = _as_array(tensor, self.dtype)
        self.data_file.write(tokens.tobytes(order="C"))
        self.sequence_lengths.append(tokens.size)
        if self.sequence_modes is not None:
            self.sequence_modes.append(mode)

    def add_document(self, tensor: Any, lengths: Sequence[int], modes: Optional[Sequence[int]] = None) -> None:
        """Append one document made of sequences of `lengths` tokens (their concatenation is `tensor`)."""
        tokens = _as_array(tensor, self.dtype)
        if sum(int(n) for n in lengths) != tokens.size:
            raise ValueError(f"lengths sum to {sum(int(n) for n in lengths)} but the document has {tokens.size} tokens")
        self.data_file.write(tokens.tobytes(order="C"))
        self.sequence_lengths.extend(int(n) for n in lengths)
        self.document_indices.append(len(self.sequence_lengths))
        if self.sequence_modes is not None:
            self.sequence_modes.extend(modes if modes is not None else [0] * len(lengths))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Bulk form for preprocessing: many one-sequence documents whose concatenation is `tokens`."""
        tokens = _as_array(tokens, self.dtype)
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != tokens.size:
            raise ValueError(f"lengths sum to {int(lengths.sum())} but there are {tokens.size} tokens")
        self.data_file.write(tokens.tobytes(order="C"))
        start = len(self.sequence_lengths)
        self.sequence_lengths.extend(lengths.astype(np.int32).tolist())
        self.document_indices.extend(range(start + 1, start + 1 + lengths.size))
        if self.sequence_modes is not None:
            self.sequence_modes.extend([0] * lengths.size)

    def end_document(self) -> None:
        """Close the current document (after one or more add_item calls)."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append every document of another dataset with the same dtype (merging shards)."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise DataError(f"{index_file_path(path_prefix)} holds {other.dtype} tokens but this builder writes {self.dtype}")
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(other.sequence_lengths.tolist())
        self.document_indices.extend((other.document_indices[1:] + offset).tolist())
        if self.sequence_modes is not None:
            modes = other.sequence_modes if other.sequence_modes is not None else np.zeros(len(other), np.int8)
            self.sequence_modes.extend(modes.tolist())
        with open(data_file_path(path_prefix), "rb") as fh:
            while chunk := fh.read(64 << 20):
                self.data_file.write(chunk)

    def finalize(self, idx_path: str) -> None:
        """Write the index and move both files to their names (the .idx last, so a crash leaves no complete pair)."""
        self.data_file.close()
        tmp_idx = f"{idx_path}.tmp-{os.getpid()}"
        write_index(tmp_idx, self.dtype, self.sequence_lengths, self.document_indices, self.sequence_modes)
        if os.path.exists(idx_path):
            os.remove(idx_path)  # an old .idx must not pair with the new .bin while we rename
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(tmp_idx, idx_path)

    def abort(self) -> None:
        """Drop the temporary .bin (an interrupted or failed run)."""
        if not self.data_file.closed:
            self.data_file.close()
        if os.path.exists(self._tmp_bin):
            os.remove(self._tmp_bin)


def write_index(
    idx_path: str,
    dtype: Any,
    sequence_lengths: Sequence[int],
    document_indices: Sequence[int],
    sequence_modes: Optional[Sequence[int]] = None,
) -> None:
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(lengths.size, dtype=np.int64)
    if lengths.size:
        np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    docs = np.asarray(document_indices, dtype=np.int64)
    with open(idx_path, "wb") as fh:
        fh.write(_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, dtype_code(dtype), lengths.size, docs.size))
        fh.write(lengths.tobytes(order="C"))
        fh.write(pointers.tobytes(order="C"))
        fh.write(docs.tobytes(order="C"))
        if sequence_modes is not None:
            fh.write(np.asarray(sequence_modes, dtype=np.int8).tobytes(order="C"))


class IndexedDataset:
    """Memory-mapped reader: dataset[i] is sequence i as a numpy array of the file's dtype.

    `multimodal` is accepted for Megatron compatibility; the modes block is detected from the file size.
    """

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True):
        self.path_prefix = path_prefix
        idx_path, bin_path = index_file_path(path_prefix), data_file_path(path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise DataError(f"{path} does not exist; make the .bin/.idx pair with `tricorn preprocess --output-prefix ...`")
        self._idx = np.memmap(idx_path, dtype=np.uint8, mode="r") if os.path.getsize(idx_path) else np.zeros(0, np.uint8)
        header = self._read_header(idx_path)
        self.dtype = np.dtype(DTYPE_CODES[header[2]])
        count, doc_count = header[3], header[4]
        offset = _HEADER.size
        base = offset + count * (4 + 8) + doc_count * 8
        size = self._idx.size
        if size not in (base, base + count):  # base + count: a trailing int8 sequence-modes block
            raise DataError(
                f"{idx_path}: is {size} bytes but its header ({count} sequences, {doc_count} document indices) needs {base}; "
                "the file is truncated or corrupt, re-run `tricorn preprocess`"
            )
        self.sequence_lengths = np.frombuffer(self._idx, np.int32, count, offset)
        self.sequence_pointers = np.frombuffer(self._idx, np.int64, count, offset + count * 4)
        self.document_indices = np.frombuffer(self._idx, np.int64, doc_count, offset + count * 12)
        self.sequence_modes = np.frombuffer(self._idx, np.int8, count, base) if count and size == base + count else None
        self._check_documents(idx_path, count, doc_count)
        self._check_sequences(idx_path, count)
        self._bin = self._open_bin(bin_path, idx_path, count, mmap)

    def _read_header(self, idx_path: str) -> tuple:
        if self._idx.size < _HEADER.size:
            raise DataError(
                f"{idx_path}: is {self._idx.size} bytes, shorter than the {_HEADER.size}-byte header; re-run `tricorn preprocess`"
            )
        header = _HEADER.unpack(self._idx[: _HEADER.size].tobytes())
        if header[0] != INDEX_MAGIC:
            raise DataError(f"{idx_path}: not a Megatron index file (magic {header[0]!r}, expected {INDEX_MAGIC!r})")
        if header[1] != INDEX_VERSION:
            raise DataError(f"{idx_path}: index version {header[1]} is not supported (expected {INDEX_VERSION})")
        if header[2] not in DTYPE_CODES:
            raise DataError(f"{idx_path}: unknown dtype code {header[2]} (valid: {sorted(DTYPE_CODES)}); the file is corrupt")
        dtype = np.dtype(DTYPE_CODES[header[2]])
        if dtype.kind not in "iu":
            raise DataError(
                f"{idx_path}: holds {dtype} tokens (dtype code {header[2]}) but token ids are integers; "
                "re-run `tricorn preprocess` on the text"
            )
        return header

    def _check_documents(self, idx_path: str, count: int, doc_count: int) -> None:
        docs = self.document_indices
        if doc_count < 1 or docs[0] != 0 or docs[-1] != count:
            first, last = (int(docs[0]), int(docs[-1])) if doc_count else (None, None)
            raise DataError(
                f"{idx_path}: document indices run from {first} to {last} but must run from 0 to the sequence count {count}; the file is corrupt"
            )

    def _check_sequences(self, idx_path: str, count: int) -> None:
        """Lengths >= 0 and pointer[i] = pointer[i-1] + length[i-1] * itemsize (pointer[0] = 0), chunk by chunk."""
        lengths, pointers, size = self.sequence_lengths, self.sequence_pointers, self.dtype.itemsize
        if count and pointers[0] != 0:
            raise DataError(f"{idx_path}: sequence 0 starts at byte {int(pointers[0])}, not 0; the file is corrupt")
        for start in range(0, count, _CHUNK):
            stop = min(start + _CHUNK, count)
            negative = np.flatnonzero(lengths[start:stop] < 0)
            if negative.size:
                i = start + int(negative[0])
                raise DataError(
                    f"{idx_path}: sequence {i} has length {int(lengths[i])}; the file is corrupt, re-run `tricorn preprocess`"
                )
            lo = max(start, 1)
            expected = pointers[lo - 1 : stop - 1] + lengths[lo - 1 : stop - 1].astype(np.int64) * size
            wrong = np.flatnonzero(pointers[lo:stop] != expected)
            if wrong.size:
                i = lo + int(wrong[0])
                raise DataError(
                    f"{idx_path}: sequence {i} starts at byte {int(pointers[i])} but the lengths before it put it at "
                    f"{int(expected[wrong[0]])}; the file is corrupt, re-run `tricorn preprocess`"
                )
        docs = self.document_indices
        for start in range(1, docs.size, _CHUNK):
            stop = min(start + _CHUNK, docs.size)
            falling = np.flatnonzero(docs[start:stop] < docs[start - 1 : stop - 1])
            if falling.size:
                i = start + int(falling[0])
                raise DataError(
                    f"{idx_path}: document index {i} ({int(docs[i])}) is below the one before it ({int(docs[i - 1])}); the file is corrupt"
                )

    def token_range(self) -> tuple[int, int]:
        """(smallest, largest) token id in the whole .bin, read in chunks; (0, 0) when empty."""
        tokens = np.frombuffer(self._bin, self.dtype, self._bin.size // self.dtype.itemsize)
        if tokens.size == 0:
            return 0, 0
        parts = [(int(c.min()), int(c.max())) for c in (tokens[i : i + _CHUNK] for i in range(0, tokens.size, _CHUNK))]
        return min(p[0] for p in parts), max(p[1] for p in parts)

    def _open_bin(self, bin_path: str, idx_path: str, count: int, mmap: bool) -> np.ndarray:
        size = os.path.getsize(bin_path)
        expected = 0
        if count:
            expected = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
        if size != expected:
            raise DataError(
                f"{bin_path}: is {size} bytes but {idx_path} describes {expected} ({count} sequences of {self.dtype}); "
                "the .bin is truncated or belongs to another index, re-run `tricorn preprocess`"
            )
        if size == 0:
            return np.zeros(0, np.uint8)
        if mmap:
            return np.memmap(bin_path, dtype=np.uint8, mode="r")
        return np.fromfile(bin_path, dtype=np.uint8)

    def __len__(self) -> int:
        return int(self.sequence_lengths.size)

    def __getitem__(self, idx: Union[int, np.integer, slice]) -> Union[np.ndarray, list[np.ndarray]]:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("IndexedDataset slices must be contiguous (step 1)")
            return [self.get(i) for i in range(start, stop)]
        return self.get(int(idx))

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence idx (to its end when length is None)."""
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"sequence {idx} is out of range for {len(self)} sequences in {self.path_prefix}")
        seq_len = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"tokens [{offset}, {offset + length}) are outside sequence {idx} of length {seq_len}")
        start = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, start)

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.size - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.isfile(index_file_path(path_prefix)) and os.path.isfile(data_file_path(path_prefix))
