"""On-disk cache of index arrays (GPT sample indices, blending indices), keyed by what determines them.

Files are `<cache>/<md5>-<Kind>-<split>-<name>.npy` plus a `-description.txt`
(Megatron's naming), where md5 hashes the JSON description of every input of
the build. Each file is written to a temporary name and renamed, so a reader
never sees half an array.

Collectives: when torch.distributed is initialised, rank 0 builds (if the
files are missing) while every other rank waits in one barrier on the default
group, then memory-maps the files; so every rank must call this in the same
order. If rank 0 fails, it still reaches the barrier (the others do not hang)
and then raises. A rank that cannot see the files afterwards (a cache
directory that is not shared between nodes) builds the arrays in memory.
Without torch.distributed, or without a cache directory, arrays are built in
memory on each call. `read_only` reads a cache but never writes one (checks
before launch, when a refused run must leave nothing behind).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np

log = logging.getLogger(__name__)


def description_key(description: dict[str, Any]) -> str:
    return hashlib.md5(json.dumps(description, sort_keys=True).encode("utf-8")).hexdigest()


def _distributed() -> Any:
    """torch.distributed when a process group exists; checked without importing torch."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def _save_atomic(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.tmp-{os.getpid()}.npy"  # np.save appends .npy to names without it
    np.save(tmp, np.ascontiguousarray(array), allow_pickle=False)
    os.replace(tmp, path)


def _write_text_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


class CachedArrays:
    """The arrays of one build, and whether this process built them or read them from the cache."""

    def __init__(self, arrays: dict[str, np.ndarray], from_cache: bool, key: str):
        self.arrays = arrays
        self.from_cache = from_cache
        self.key = key

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]


def load_or_build(
    cache_dir: Optional[str],
    kind: str,
    split: str,
    description: dict[str, Any],
    names: Sequence[str],
    build: Callable[[], dict[str, np.ndarray]],
    read_only: bool = False,
) -> CachedArrays:
    """The arrays, from the cache when it holds them; else built (and saved unless `read_only`: no collective then)."""
    key = description_key(description)
    if not cache_dir:
        return CachedArrays(build(), False, key)
    stem = os.path.join(cache_dir, f"{key}-{kind}-{split}")
    paths = {name: f"{stem}-{name}.npy" for name in names}
    if read_only:
        if all(os.path.isfile(p) for p in paths.values()):
            return CachedArrays({name: np.load(path, mmap_mode="r") for name, path in paths.items()}, True, key)
        return CachedArrays(build(), False, key)
    dist = _distributed()
    built: Optional[dict[str, np.ndarray]] = None
    if dist is None or dist.get_rank() == 0:
        error: Optional[BaseException] = None
        if not all(os.path.isfile(p) for p in paths.values()):
            try:
                built = build()
                os.makedirs(cache_dir, exist_ok=True)
                for name, path in paths.items():
                    _save_atomic(path, built[name])
                _write_text_atomic(f"{stem}-description.txt", json.dumps(description, indent=2, sort_keys=True) + "\n")
            except BaseException as e:  # reach the barrier first so the other ranks do not hang
                error = e
        if dist is not None:
            dist.barrier()
        if error is not None:
            raise error
        if built is not None:
            return CachedArrays(built, False, key)
    else:
        dist.barrier()
    if not all(os.path.isfile(p) for p in paths.values()):
        log.warning(
            "data cache %s is not visible on this rank (is --data-cache-path on a shared filesystem?); building in memory", stem
        )
        return CachedArrays(build(), False, key)
    return CachedArrays({name: np.load(path, mmap_mode="r") for name, path in paths.items()}, True, key)
