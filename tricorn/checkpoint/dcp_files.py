"""tricorn's subclasses of torch.distributed.checkpoint's reader, planner, writer and file system.

Split from io.py so that importing io (every run does, for its checks before launch) does not import DCP,
about a second of each process's start-up that a run without checkpoints never needs (bench/startup.py);
``io.Writer`` and the others still work: io imports this module on first use of those names.

- ``SafeReader``: DCP's metadata read through io's allowlist unpickler.
- ``SafeLoadPlanner``: refuses pickled objects (only tensors are ever loaded).
- ``Writer``: one file per rank, fsync'ed, each file hashed as it is written (``HashingFileSystem``), and the
  kill-during-save test hook (KILL_DURING_SAVE).
No collectives of its own (DCP's save and load run them).
"""

from __future__ import annotations

import contextlib
import io as _bytes_io
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem

from tricorn.checkpoint.checksums import HashingStream
from tricorn.checkpoint.errors import CheckpointError

# Test hook: "ITER:RANK" kills that rank with SIGKILL right after it wrote its shard file of
# iteration ITER's save, before the checkpoint is complete. Tests use it; nothing else may.
KILL_DURING_SAVE = "TRICORN_TEST_KILL_DURING_SAVE"


class HashingFileSystem(FileSystem):
    """DCP's local file system, with a checksum of every file it writes (file name -> size and digest)."""

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
            stream = HashingStream(raw)
            yield stream
        self.checksums[Path(path).name] = stream.checksum()

    def rename(self, path: Any, new_path: Any) -> None:  # DCP writes .metadata.tmp, then renames it
        super().rename(path, new_path)
        if Path(path).name in self.checksums:
            self.checksums[Path(new_path).name] = self.checksums.pop(Path(path).name)


class SafeReader(FileSystemReader):
    """`read_metadata(checkpoint dir)` is io.read_dcp_metadata: DCP's pickle through the allowlist."""

    def __init__(self, path: str, read_metadata: Callable[[Path], Any]):
        super().__init__(path)
        self._read = read_metadata

    def read_metadata(self, *args: Any, **kwargs: Any):
        md = self._read(Path(self.path))
        from torch.distributed.checkpoint.metadata import StorageMeta

        md.storage_meta = md.storage_meta or StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: _bytes_io.BytesIO) -> None:
        raise CheckpointError(f"checkpoint holds a pickled object under {read_item.dest_index.fqn!r}; tricorn never loads those")


class Writer(FileSystemWriter):
    """DCP's file writer (one file per rank, fsync'ed), the checksums of what it wrote, and the kill-during-save test hook."""

    def __init__(self, path: Path, iteration: int, rank: int):
        super().__init__(str(path), single_file_per_rank=True, sync_files=True, overwrite=True)
        self.iteration, self.rank = iteration, rank
        self.fs = HashingFileSystem()
        self.checksums = self.fs.checksums  # the files this rank wrote -> size and XXH3-64 digest

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        hook = os.environ.get(KILL_DURING_SAVE, "")
        if hook and hook == f"{self.iteration}:{self.rank}":
            fut.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return fut
