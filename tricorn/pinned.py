"""Pinned host memory: what feeds the GPU without making the host wait.

A host-to-device copy from pageable memory is synchronous on CUDA (the driver stages it and the host
waits); from pinned (page-locked) memory with non_blocking=True it is queued on the stream and the host
runs on. Batches and the offloaded optimizer's staging buffers are therefore pinned on CUDA.

On the CPU nothing can be pinned (torch needs an accelerator for it). While a CPU run stands in for CUDA
(tricorn.host_reads.HostReadCounter(stand_in=True), the CUDA contract test), `pins_host_memory` answers
True and `pin` / `host_buffer` register their tensors' storages as pinned host memory instead, so that
the very branches CUDA takes run, and the contract can tell host from device memory and pinned from
pageable. No collectives; memory: the registry holds weak references only.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Union

import torch

HOST, PINNED = "host", "pinned"
# untyped storage -> HOST or PINNED, for tensors a CPU stand-in run treats as host memory on CUDA.
_HOST_STORAGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_STAND_IN = [0]  # depth of active stand-in contexts


def stand_in_active() -> bool:
    return _STAND_IN[0] > 0


def pins_host_memory(device: Union[torch.device, str]) -> bool:
    """Whether host buffers that feed `device` are pinned: on CUDA, and on a CPU run standing in for it."""
    return torch.device(device).type == "cuda" or stand_in_active()


def mark_host(t: torch.Tensor, kind: str = HOST) -> torch.Tensor:
    """Register t's storage as host memory (stand-in runs; views share the mark)."""
    _HOST_STORAGES[t.untyped_storage()] = kind
    return t


def unmark(t: torch.Tensor) -> None:
    """t's storage is device memory after all (what a host-to-device copy returns)."""
    _HOST_STORAGES.pop(t.untyped_storage(), None)


def host_kind(t: torch.Tensor) -> str | None:
    """HOST, PINNED, or None for device memory (on a CPU stand-in run: what the registry says)."""
    return _HOST_STORAGES.get(t.untyped_storage())


def in_host_memory(t: torch.Tensor, device: torch.device) -> bool:
    """Whether t is host memory while the run computes on `device` (offloaded state; registered on a stand-in run)."""
    return t.device != device or host_kind(t) is not None


def pin(t: torch.Tensor) -> torch.Tensor:
    """t in pinned memory (a host copy when it was pageable); registered instead on a CPU stand-in run."""
    if t.is_pinned():
        return t
    if torch.cuda.is_available():
        return t.pin_memory()
    return mark_host(t, PINNED) if stand_in_active() else t


def is_pinned(t: torch.Tensor) -> bool:
    return t.is_pinned() or host_kind(t) == PINNED


def host_buffer(shape: Union[int, Sequence[int]], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """A zeroed host tensor, allocated pinned when `pinned` (see ``host_empty``)."""
    return host_empty(shape, dtype, pinned).zero_()


def host_empty(shape: Union[int, Sequence[int]], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """A host tensor (uninitialised), allocated pinned when `pinned`. On a CPU-only run it is registered as host
    memory - pinned on a stand-in run - so that the contract and the peak tracker (training/peak.py, which counts
    device memory) tell it from the run's device tensors."""
    if pinned and torch.cuda.is_available():
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)
    _ALLOCATING.depth = getattr(_ALLOCATING, "depth", 0) + 1
    try:
        t = torch.empty(shape, dtype=dtype, device="cpu")
    finally:
        _ALLOCATING.depth -= 1
    return mark_host(t, PINNED if pinned and stand_in_active() else HOST)


_ALLOCATING = threading.local()


def allocating_host() -> bool:
    """Inside ``host_empty``'s allocation, before its tensor is registered (the peak tracker skips it)."""
    return getattr(_ALLOCATING, "depth", 0) > 0


_HOST_SIDE = threading.local()


@contextlib.contextmanager
def stand_in() -> Iterator[None]:
    """A CPU run standing in for CUDA inside: host buffers are pinned (registered), as on CUDA."""
    _STAND_IN[0] += 1
    try:
        yield
    finally:
        _STAND_IN[0] -= 1


@contextlib.contextmanager
def host_side() -> Iterator[None]:
    """Host work by design (the data loader building batches): tensors created inside belong in host memory."""
    depth = getattr(_HOST_SIDE, "depth", 0)
    _HOST_SIDE.depth = depth + 1
    try:
        yield
    finally:
        _HOST_SIDE.depth = depth


def in_host_side() -> bool:
    return getattr(_HOST_SIDE, "depth", 0) > 0
