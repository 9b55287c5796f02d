"""CRC-32 checksums of checkpoint files: computed while a file is written, or by reading it back.

`HashingFileSystem` is DCP's local file system with every written file hashed as its bytes go by,
on a second thread beside the writer (zlib releases the GIL), so the hash overlaps serialisation,
writes and fsync instead of re-reading the file after them. `file_checksum` reads a file back (for
small files and for verification). No collectives; at most 256 MiB of copies wait for the hasher.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import zlib
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem

_HASH_BLOCK = 16 << 20  # bytes per read when reading a file back: large reads, bounded memory


def file_checksum(path: Path) -> dict:
    """{"size", "crc32"} of one file, read in large blocks (zlib releases the GIL while it hashes)."""
    crc, size = 0, 0
    buf = bytearray(min(_HASH_BLOCK, max(path.stat().st_size, 1)))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return {"size": size, "crc32": f"{crc:08x}"}


def file_checksums(root: Path, names: list[str]) -> dict[str, dict]:
    return {name: file_checksum(root / name) for name in names}


class _HashingStream:
    """The file a shard is written through: every byte is also CRC-32'd, on a second thread, as it goes by.

    The hash overlaps the serialisation, the writes and the fsync instead of re-reading the file after
    them. At most _IN_FLIGHT bytes wait for the hasher (copies: the caller may reuse its buffer).
    """

    _IN_FLIGHT = 256 << 20

    def __init__(self, raw: Any):
        self.raw = raw
        self._crc, self._size, self._queued = 0, 0, 0
        self._pending: collections.deque = collections.deque()
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tricorn-crc32")

    def write(self, data: Any) -> int:
        written = self.raw.write(data)
        chunk = bytes(data)
        self._pending.append((self._hasher.submit(self._update, chunk), len(chunk)))
        self._queued += len(chunk)
        while self._queued > self._IN_FLIGHT:  # the hasher is behind: wait for its oldest chunk
            done, size = self._pending.popleft()
            done.result()
            self._queued -= size
        return written

    def _update(self, chunk: bytes) -> None:  # zlib releases the GIL: this runs beside the writer
        self._crc = zlib.crc32(chunk, self._crc)
        self._size += len(chunk)

    def checksum(self) -> dict:
        for done, _ in self._pending:
            done.result()
        self._hasher.shutdown(wait=True)
        return {"size": self._size, "crc32": f"{self._crc:08x}"}

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno (fsync), ...
        return getattr(self.raw, name)


class HashingFileSystem(FileSystem):
    """DCP's local file system, with a checksum of every file it writes (file name -> size and CRC-32)."""

    def __init__(self) -> None:
        super().__init__()
        self.checksums: dict[str, dict] = {}

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _HashingStream(raw)
            yield stream
        self.checksums[Path(path).name] = stream.checksum()

    def rename(self, path: Any, new_path: Any) -> None:  # DCP writes .metadata.tmp, then renames it
        super().rename(path, new_path)
        if Path(path).name in self.checksums:
            self.checksums[Path(new_path).name] = self.checksums.pop(Path(path).name)
