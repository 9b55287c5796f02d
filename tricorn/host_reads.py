"""Count host reads of tensor values: the device synchronisations a training step must not have.

A host read is any call that hands a tensor's value to Python: ``.item()``, ``float(t)``,
``bool(t)``, ``int(t)`` (all dispatch ``aten._local_scalar_dense``), ``.tolist()`` and
``.numpy()`` (on CPU these read memory without dispatching any operator, so they are caught
at the Python level by a TorchFunctionMode), and a blocking copy of a CUDA tensor to the CPU.
On CUDA each of them waits for every kernel queued before it.

    with HostReadCounter() as reads:
        trainer.run_iteration()
    reads.count, reads.where  # how many, and which operator each was

Used by tests/test_host_reads.py, bench/overhead.py and scripts/gpu_check.py. No collectives,
no memory.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR = torch.ops.aten._local_scalar_dense.default
_COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
_PYTHON_READS = {torch.Tensor.tolist, torch.Tensor.numpy}


def _blocking_device_to_host(func, args, kwargs) -> bool:
    if func is torch.ops.aten._to_copy.default:
        src, device = args[0], kwargs.get("device")
        return src.device.type != "cpu" and device is not None and torch.device(device).type == "cpu"
    if func is torch.ops.aten.copy_.default:
        dst, src = args[0], args[1]
        non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
        return src.device.type != "cpu" and dst.device.type == "cpu" and not non_blocking
    return False


_SKIP = (os.path.dirname(torch.__file__), __file__)


def _caller() -> str:
    """file:line of the innermost frame outside torch and this module (where the read was asked for)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
        frame = frame.f_back
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}" if frame is not None else "?"


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: HostReadCounter):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SCALAR and not self.owner.ignored(args[0]):
            self.owner.add(str(func))
        elif func in _COPIES and _blocking_device_to_host(func, args, kwargs):
            self.owner.add(str(func))
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, owner: HostReadCounter):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _PYTHON_READS and not self.owner.ignored(args[0]):
            self.owner.add(func.__name__)
        return func(*args, **(kwargs or {}))


class HostReadCounter:
    """Context manager: ``count`` host reads inside the block (``where`` names each one and its caller).

    ``host_tensors``: tensors that live in host memory by design even on CUDA (AdamW's step counters,
    which torch's non-capturable foreach AdamW reads with .item() at no device cost); reads of them are
    not counted. ``device``: on a GPU, only reads of tensors on that device type count (a CPU test
    cannot tell device memory from host memory, so there every read counts but ``host_tensors``).
    """

    def __init__(self, host_tensors: Iterable[torch.Tensor] = (), device: Optional[torch.device] = None) -> None:
        self.where: list[str] = []
        self._host = {t.untyped_storage().data_ptr() for t in host_tensors}
        self._device_type = torch.device(device).type if device is not None else "cpu"
        self._modes = (_Function(self), _Dispatch(self))

    def ignored(self, t: torch.Tensor) -> bool:
        if self._device_type != "cpu" and t.device.type != self._device_type:
            return True
        return t.untyped_storage().data_ptr() in self._host

    def add(self, what: str) -> None:
        self.where.append(f"{what} at {_caller()}")

    @property
    def count(self) -> int:
        return len(self.where)

    def __enter__(self) -> HostReadCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
