"""Activation memory, measured: a saved-tensor probe of what each layer and microbatch keeps for backward.

Measured. ``ActivationProbe`` wraps every forward of the model chunks in
``torch.autograd.graph.saved_tensors_hooks`` and records each tensor autograd saves for backward, by storage
(views of one storage are counted once), attributed to the transformer layer running when it was first
saved, or to "other" (embedding, final norm, head, loss). Parameters and buffers are not activations and are
skipped. Sizes are read when the chunk's forward ends, so storage freed during forward (selective "norm"
recompute) counts as the 0 bytes it then holds; storage that an offloaded layer (parallel/offload.py) moves
to host memory during forward counts at its size when saved (offload tells the probe of each tensor it takes). Under ``torch.utils.checkpoint`` only what the checkpoint
keeps - its inputs - reaches the probe: with full recompute a layer measures its input. Each saved tensor is
handed to autograd inside a small holder whose release (when backward frees the graph) tells the probe
which microbatches still hold activations: the peak of that count is ``peak_microbatches_in_flight``.

Predicted: ``tricorn.planning.activations.layer_activation_terms`` / ``layer_activation_bytes`` is the formula
of what our block keeps (its module docstring has the derivation: TP, SP, selective and full recompute); the
probe equals it to the byte on CPU (tests/test_activation_probe.py), and the memory estimator uses the same
formula.

No collectives. Memory effect of the probe: one Python holder per saved tensor, released with the graph.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from tricorn.parallel import offload

_LOCK = threading.RLock()  # holders are released from autograd's thread too (and storage deaths during a count)


@dataclass
class ForwardRecord:
    """What one chunk forward (one microbatch on one model chunk) saved for backward."""

    chunk: int
    microbatch: int
    layer_bytes: dict[str, int] = field(default_factory=dict)  # global layer id -> bytes
    other_bytes: int = 0
    live: int = 0  # saved tensors autograd still holds
    # storage id -> (region, weak reference, bytes when saved); a storage that dies before the forward ends (an
    # offloaded layer's, parallel/offload.py) is counted at its saved size and its id freed for reuse.
    storages: dict[int, tuple[str, Any, int]] = field(default_factory=dict, repr=False)

    @property
    def total_bytes(self) -> int:
        return self.other_bytes + sum(self.layer_bytes.values())


class _Held:
    """What autograd stores instead of the tensor: the tensor plus a release notice to the probe."""

    __slots__ = ("tensor", "probe", "record")

    def __init__(self, tensor: Optional[torch.Tensor], probe: ActivationProbe, record: ForwardRecord):
        self.tensor, self.probe, self.record = tensor, probe, record
        probe._hold(record)

    def __del__(self) -> None:
        self.probe._release(self.record)


@dataclass(frozen=True)
class ActivationSummary:
    activation_bytes_per_layer: float  # mean over the layers of this rank, per microbatch
    activation_bytes_other: float  # embedding, final norm, head and loss, per microbatch
    activation_bytes_per_microbatch: float  # everything one microbatch saves on this rank (all its chunks)
    peak_microbatches_in_flight: int
    peak_activation_bytes: float  # largest total of saved bytes alive at once, measured at forward ends

    def report_entry(self) -> dict[str, float]:
        """The keys the trainer adds to this rank's entry of memory_report.json."""
        return {
            "activation_bytes_per_layer": self.activation_bytes_per_layer,
            "activation_bytes_other": self.activation_bytes_other,
            "peak_microbatches_in_flight": self.peak_microbatches_in_flight,
        }


class ActivationProbe:
    """Counts bytes saved for backward per layer, per microbatch and outside the layers (see module docstring).

    Use as a context manager around training steps (or attach()/detach()). Only forwards with grad enabled
    are recorded, at most `max_forwards` chunk forwards (None: all); the k-th recorded forward of each chunk
    is microbatch k.
    """

    def __init__(self, chunks: Sequence[nn.Module], max_forwards: Optional[int] = None):
        self.chunks = list(chunks)
        self.max_forwards = max_forwards
        self.records: list[ForwardRecord] = []
        self._handles: list[Any] = []
        self._skip: set[int] = set()
        self._current: Optional[ForwardRecord] = None
        self._region = "other"
        self._hooks_ctx: list[contextlib.AbstractContextManager] = []
        self._forwards: dict[int, int] = {}
        self._alive: dict[int, int] = {}  # microbatch -> records of it still holding tensors
        self.peak_microbatches_in_flight = 0
        self.peak_activation_bytes = 0

    # ------------------------------------------------------------ hooks

    def attach(self) -> ActivationProbe:
        offload.OBSERVERS.append(self.observe)
        for c, chunk in enumerate(self.chunks):
            self._handles.append(chunk.register_forward_pre_hook(lambda _m, _a, c=c: self._begin(c)))
            self._handles.append(chunk.register_forward_hook(lambda _m, _a, _o: self._end(), always_call=True))
            for layer_id, layer in getattr(chunk, "layers", nn.ModuleDict()).items():
                self._handles.append(layer.register_forward_pre_hook(lambda _m, _a, i=layer_id: self._enter_region(i)))
                self._handles.append(
                    layer.register_forward_hook(lambda _m, _a, _o: self._enter_region("other"), always_call=True)
                )
        return self

    def detach(self) -> None:
        if self.observe in offload.OBSERVERS:
            offload.OBSERVERS.remove(self.observe)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> ActivationProbe:
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def _enter_region(self, region: str) -> None:
        self._region = region

    def _begin(self, chunk: int) -> None:
        if not torch.is_grad_enabled() or self._current is not None:
            return
        if self.max_forwards is not None and len(self.records) >= self.max_forwards:
            return
        if not self._skip:  # read at the first forward: an optimizer may have moved the parameters into buffers
            for module in self.chunks:
                self._skip.update(t.untyped_storage()._cdata for t in [*module.parameters(), *module.buffers()])
        k = self._forwards.get(chunk, 0)
        self._forwards[chunk] = k + 1
        self._current = ForwardRecord(chunk, k)
        self._region = "other"
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)
        ctx.__enter__()
        self._hooks_ctx.append(ctx)

    def _end(self) -> None:
        if self._current is None:
            return
        self._hooks_ctx.pop().__exit__(None, None, None)
        record, self._current = self._current, None
        with _LOCK:
            for region, ref, saved in record.storages.values():
                storage = ref()
                _count(record, region, storage.nbytes() if storage is not None else saved)
            record.storages = {}  # sizes are taken
        for layer_id in getattr(self.chunks[record.chunk], "layers", {}):
            record.layer_bytes.setdefault(layer_id, 0)
        self.records.append(record)
        with _LOCK:
            live = sum(r.total_bytes for r in self.records if r.live > 0)
            self.peak_activation_bytes = max(self.peak_activation_bytes, live)

    def _pack(self, tensor: torch.Tensor) -> Any:
        return self._note(tensor, tensor)

    def observe(self, tensor: torch.Tensor) -> Any:
        """Count a tensor another saved-tensor hook takes (an offloaded layer's): the returned token, held as long
        as that hook's handle, stands in for the tensor (the probe keeps no reference to it)."""
        return self._note(tensor, None)

    def _note(self, tensor: torch.Tensor, keep: Optional[torch.Tensor]) -> Any:
        record = self._current
        storage = tensor.untyped_storage()
        key = storage._cdata  # the StorageImpl: unique while it lives (a dead one's id is dropped, see below)
        if record is None or key in self._skip or storage.nbytes() == 0 or isinstance(tensor, nn.Parameter):
            return _Plain(keep)
        with _LOCK:
            if key not in record.storages:
                region = self._region

                def died(_ref: Any, record: ForwardRecord = record, key: int = key, region: str = region) -> None:
                    with _LOCK:
                        entry = record.storages.pop(key, None)
                        if entry is not None:
                            _count(record, region, entry[2])

                record.storages[key] = (region, weakref.ref(storage, died), storage.nbytes())
        return _Held(keep, self, record)

    def _hold(self, record: ForwardRecord) -> None:
        with _LOCK:
            record.live += 1
            if record.live == 1:
                self._alive[record.microbatch] = self._alive.get(record.microbatch, 0) + 1
                self.peak_microbatches_in_flight = max(self.peak_microbatches_in_flight, len(self._alive))

    def _release(self, record: ForwardRecord) -> None:
        with _LOCK:
            record.live -= 1
            if record.live == 0:
                left = self._alive.get(record.microbatch, 1) - 1
                if left:
                    self._alive[record.microbatch] = left
                else:
                    self._alive.pop(record.microbatch, None)

    # ------------------------------------------------------------ results

    def layer_bytes(self) -> dict[str, list[int]]:
        """Bytes per layer id, one value per recorded microbatch."""
        out: dict[str, list[int]] = {}
        for r in self.records:
            for layer_id, nbytes in r.layer_bytes.items():
                out.setdefault(layer_id, []).append(nbytes)
        return out

    def summary(self) -> ActivationSummary:
        if not self.records:
            return ActivationSummary(0.0, 0.0, 0.0, 0, 0.0)
        per_layer = [n for values in self.layer_bytes().values() for n in values]
        microbatches = {r.microbatch for r in self.records}
        total = sum(r.total_bytes for r in self.records)
        return ActivationSummary(
            activation_bytes_per_layer=sum(per_layer) / len(per_layer) if per_layer else 0.0,
            activation_bytes_other=sum(r.other_bytes for r in self.records) / len(microbatches),
            activation_bytes_per_microbatch=total / len(microbatches),
            peak_microbatches_in_flight=self.peak_microbatches_in_flight,
            peak_activation_bytes=float(self.peak_activation_bytes),
        )


# ---------------------------------------------------------------- the trainer's probe

_trainer_probe: Optional[ActivationProbe] = None


def attach_trainer_probe(chunks: Sequence[nn.Module], forwards: int) -> ActivationProbe:
    """Probe the trainer's first `forwards` chunk forwards (its first iteration); read by trainer_report_entry()."""
    global _trainer_probe
    if _trainer_probe is not None:
        _trainer_probe.detach()
    _trainer_probe = ActivationProbe(chunks, max_forwards=forwards).attach()
    return _trainer_probe


def trainer_report_entry() -> dict[str, float]:
    """The activation keys of this rank's memory_report.json entry (empty without a probe); detaches the probe."""
    global _trainer_probe
    if _trainer_probe is None:
        return {}
    probe, _trainer_probe = _trainer_probe, None
    probe.detach()
    return probe.summary().report_entry()


class _Plain:
    """A saved tensor the probe does not count (parameters, buffers, empty tensors)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Optional[torch.Tensor]):
        self.tensor = tensor


def _count(record: ForwardRecord, region: str, nbytes: int) -> None:
    if region == "other":
        record.other_bytes += nbytes
    else:
        record.layer_bytes[region] = record.layer_bytes.get(region, 0) + nbytes


__all__ = [
    "ActivationProbe",
    "ActivationSummary",
    "ForwardRecord",
    "attach_trainer_probe",
    "trainer_report_entry",
]
