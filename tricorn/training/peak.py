"""Peak memory of a stretch of training, by kind: every storage the code allocates, counted while it lives.

``PeakTracker`` is a TorchDispatchMode: each op's outputs register their storages (by StorageImpl, with a
weak reference whose callback subtracts the bytes when the storage dies); ``UntypedStorage.resize_`` - which
no dispatch mode sees, and which ZeRO-3 uses to gather and free layers - is wrapped while the tracker is
active. Storages alive when tracking starts (``existing`` tensors: the model state) are counted from the start.
At the highest total the bytes are split by kind: a storage held by one of the optimizer's model-state
tensors at that moment is params / grads / master_params / optimizer_state (ZeRO-3's gathered layers are
params, ZeRO-2/3's transient gradient buckets are grads); everything else - saved activations, logits,
pipeline buffers, temporaries - is activations. Host memory is not counted: on a CPU run, what tricorn/pinned.py
registers as host (the offloaded optimizer state, offloaded activations, made by ``pinned.host_empty``).

Why not torch's MemTracker: it sorts memory by module and autograd phase (parameter, gradient, activation,
temporary, optimizer), not by the estimator's kinds, and it has no notion of master copies or DP buckets.
This tracker is the same mechanism (dispatch mode + weak references + resize_) with the estimator's kinds.

Works on real and on fake tensors (FakeTensorMode: `tricorn simulate`). Cost: a dict update per allocated
tensor, and one classification per new peak; the trainer tracks iteration 1 only. No collectives.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from functools import wraps
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tricorn import pinned

KINDS = ("params_bytes", "grads_bytes", "master_params_bytes", "optimizer_state_bytes", "activations_bytes")


class PeakTracker(TorchDispatchMode):
    """Live bytes of every storage; at the highest total, the split by kind (module docstring)."""

    def __init__(self, model_state: Callable[[], dict[str, list[torch.Tensor]]], existing: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.model_state = model_state  # e.g. Optimizer.memory_tensors: kind (without _bytes) -> tensors
        self.live: dict[int, int] = {}  # StorageImpl -> bytes
        self._refs: dict[int, weakref.ref] = {}
        self.total = 0
        self.peak_bytes = 0
        self.peak_by_kind: dict[str, int] = dict.fromkeys(KINDS, 0)
        self._unrecorded_peak = False
        self._orig_resize: Any = None
        for t in existing:
            self._track(t)
        self._new_peak()

    # ------------------------------------------------------------ bookkeeping

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":  # shapes only (a model being built on meta): no memory
            return
        if pinned.host_kind(t) is not None:  # host memory on CUDA (offloaded state or activations): not the device's
            return
        st = t.untyped_storage()
        key, nbytes = st._cdata, st.nbytes()
        old = self.live.get(key)
        if old is None:
            self._refs[key] = weakref.ref(st, lambda _r, key=key: self._forget(key))
        elif old == nbytes:
            return
        self._change(key, nbytes - (old or 0), nbytes)

    def _forget(self, key: int) -> None:
        nbytes = self.live.get(key, 0)
        if nbytes:
            self._change(key, -nbytes, 0)
        self.live.pop(key, None)
        self._refs.pop(key, None)

    def _change(self, key: int, delta: int, nbytes: int) -> None:
        if delta < 0 and self._unrecorded_peak:
            self._record_peak()  # the total is about to fall from its highest point: split it by kind now
        self.live[key] = nbytes
        self.total += delta
        if self.total > self.peak_bytes:
            self.peak_bytes = self.total
            self._unrecorded_peak = True

    def _new_peak(self) -> None:
        self.peak_bytes = self.total
        self._record_peak()

    def _record_peak(self) -> None:
        split = dict.fromkeys(KINDS, 0)
        seen: set[int] = set()
        for kind, tensors in self.model_state().items():
            for t in tensors:
                key = t.untyped_storage()._cdata
                if key in self.live and key not in seen:
                    seen.add(key)
                    split[kind + "_bytes"] += self.live[key]
        split["activations_bytes"] = self.total - sum(split.values())
        self.peak_by_kind = split
        self._unrecorded_peak = False

    # ------------------------------------------------------------ the mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if pinned.allocating_host():  # a host buffer being made (pinned.host_empty): registered as host right after
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def __enter__(self) -> PeakTracker:
        self._orig_resize = orig = torch.UntypedStorage.resize_
        tracker = self

        @wraps(orig)
        def resize_(st: torch.UntypedStorage, size: int):
            result = orig(st, size)
            key = st._cdata
            if key in tracker.live or size:
                old = tracker.live.get(key)
                if old is None:
                    tracker._refs[key] = weakref.ref(st, lambda _r, key=key: tracker._forget(key))
                tracker._change(key, st.nbytes() - (old or 0), st.nbytes())
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        if self._unrecorded_peak:
            self._record_peak()
        super().__exit__(*exc)
