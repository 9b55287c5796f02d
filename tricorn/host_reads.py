"""Count what makes a training step wait for the host on CUDA, and what would not run there as intended.

One counter, four records (each entry names the operator and its caller, file:line):

- ``where`` / ``count``: device-to-host reads. Any call that hands a tensor's value to Python: ``.item()``,
  ``float(t)``, ``bool(t)``, ``int(t)`` (all dispatch ``aten._local_scalar_dense``), ``.tolist()`` and
  ``.numpy()`` (caught at the Python level by a TorchFunctionMode: on CPU they dispatch nothing), ``.cpu()``
  and a blocking copy of a device tensor into host memory. On CUDA each waits for every queued kernel.
- ``copies``: host-to-device copies (`Copy`), with whether each is non-blocking from pinned memory: ``.to()``,
  ``.cuda()``, ``copy_`` and ``torch.tensor`` / ``torch.as_tensor`` of Python data onto the device. On CUDA a
  pageable or blocking one is a ``cudaStreamSynchronize``; only non-blocking copies from pinned memory are not.
- ``wrong_device``: tensors created without ``device=`` (on CUDA they land in host memory) outside the data
  loader's host-side work (tricorn.pinned.host_side), host tensors of more than 0 dimensions meeting device
  tensors in an operator (an error on CUDA), host tensors in a collective (NCCL takes device tensors only).
- ``attention``: every ``scaled_dot_product_attention`` call as a tricorn.attention_kernels.AttentionCall, whose
  CUDA kernel ``cuda_sdpa_kernel`` tells, and every context-parallel block's CPU kernel call as the CUDA call
  blocks.py makes for it (attention_kernels.cp_block_call); a document-masked or windowed attention
  (model/masking.py's custom op, opaque here) as the calls of the blocks it plans.

On a GPU (``device`` cuda) host memory is what is on the CPU. On a CPU run the host cannot be told from the
device by the tensors, so the counter keeps a registry of host storages (tricorn.pinned): what the data loader
creates, what is created without ``device=``, ``host_tensors`` (host by design: AdamW's CPU step counters,
offloaded optimizer state), what is computed from host tensors only, and views of them. The run's device
stands in for CUDA: a ``.to(device)`` of a host tensor is the copy CUDA would make (on CPU it may return the
same tensor; the counter then hands back a copy, as CUDA would). Under ``tricorn.pinned.stand_in()`` the code
takes CUDA's pinned-memory branches, and ``pin()`` / ``host_buffer()`` register pinned storages.

This is the meta-default-device trick (``torch.set_default_device("meta")`` makes a factory call without
``device=`` fail when its tensor meets a real one), done as a recording mode: torch's DeviceContext is itself
a TorchFunctionMode over ``torch.utils._device._device_constructors()``; this one watches the same list and
records every site, where the meta trick would stop at the first.

    with HostReadCounter(trainer.optimizer.host_scalars()) as c:
        trainer.run_iteration()
    c.count, c.where, c.copies, c.wrong_device, c.attention, c.violations(fused_attention=True)

Used by tests/test_cuda_contract.py, tests/test_host_reads.py, bench/overhead.py and scripts/gpu_check.py.
Limits: ``device="cpu"`` written out is indistinguishable from the run's device on a CPU run (such tensors
count as device tensors); copies that torch makes inside one C++ operator are not seen. No collectives, no
memory (weak references).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tricorn import pinned
from tricorn.attention_kernels import CP_CPU_BLOCK_OPS, FUSED, AttentionCall, cp_block_call, cuda_sdpa_kernel, fused_refusals
from tricorn.model.masking import planned_calls  # also registers the tricorn:: ops named in HOST_PLANNED_OPS

_SCALAR = torch.ops.aten._local_scalar_dense.default
_COPY = torch.ops.aten.copy_.default
_TO_COPY = torch.ops.aten._to_copy.default
_SCALAR_TENSOR = torch.ops.aten.scalar_tensor.default
_DATA_FACTORIES = (torch.tensor, torch.as_tensor, torch.asarray)
_SDPA = torch._C._nn.scaled_dot_product_attention
# Custom ops that take a host tensor beside device ones and read it on the host to plan their kernel calls
# (tricorn/model/masking.py: the document bounds); the kernels they call are recorded one by one.
HOST_PLANNED_OPS = (torch.ops.tricorn.attend_masked.default, torch.ops.tricorn.attend_masked_backward.default)
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@dataclass(frozen=True)
class Copy:
    """One host-to-device copy; only a non-blocking one from pinned memory leaves the host free on CUDA."""

    where: str
    non_blocking: bool
    pinned: bool

    @property
    def blocking(self) -> bool:
        return not (self.non_blocking and self.pinned)

    def __str__(self) -> str:
        how = "non-blocking" if self.non_blocking else "blocking"
        return f"{how} host-to-device copy from {'pinned' if self.pinned else 'pageable'} memory at {self.where}"


_SKIP = (os.path.dirname(torch.__file__), __file__, pinned.__file__)


def _caller() -> str:
    """file:line of the innermost frame outside torch and this module (where the operation was asked for)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
        frame = frame.f_back
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}" if frame is not None else "?"


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: HostReadCounter):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        o = self.owner
        if func is _SCALAR:
            if not o.is_host(args[0]):
                o.read(str(func))
        elif func is _COPY:
            dst, src = args[0], args[1]
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            if o.is_host(src) and not o.is_host(dst):
                o.copies.append(Copy(_caller(), bool(non_blocking), pinned.is_pinned(src)))
            elif o.is_host(dst) and not o.is_host(src) and not non_blocking:
                o.read("blocking device-to-host copy_")
        elif func is _TO_COPY and o.real and not o.is_host(args[0]):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cpu":
                o.read("device-to-host copy")
        out = func(*args, **kwargs)
        if o.real:
            return out
        if func is _SCALAR_TENSOR:  # a Python number wrapped by an operator (torch.where(c, x, 1.0)): neutral
            pinned.mark_host(out)
        elif func is not _COPY:  # a .to() onto the device is unmarked again by the function mode
            o.propagate(func, _tensors((args, kwargs)), out)
        return out


def _bind_sdpa(args: tuple, kwargs: dict) -> dict:
    bound = dict(zip(_SDPA_ARGS, args))
    bound.update(kwargs)
    return bound


class _Function(TorchFunctionMode):
    def __init__(self, owner: HostReadCounter):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        o = self.owner
        name = getattr(func, "__name__", "")
        method = getattr(func, "__objclass__", None) is torch._C.TensorBase
        if func is _SDPA:
            b = _bind_sdpa(args, kwargs)
            keys = ("attn_mask", "dropout_p", "is_causal", "enable_gqa")
            o.attention.append(
                AttentionCall.of(b["query"], b["key"], b["value"], **{k: b[k] for k in keys if k in b}, where=_caller())
            )
        elif func in CP_CPU_BLOCK_OPS:  # a context-parallel block (parallel/context/blocks.py): its CUDA call
            q, k, v, causal = args[0], args[1], args[2], args[4] if len(args) > 4 else kwargs.get("is_causal", False)
            call = AttentionCall.of(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1], where=_caller())
            o.attention.append(cp_block_call(call))
        elif func is HOST_PLANNED_OPS[0]:  # documents / window (model/masking.py): each block's CUDA call
            o.attention.extend(c if c.varlen else cp_block_call(c) for c in planned_calls(*args, **kwargs))
        elif func in _device_constructors():
            return o.created(func, args, kwargs)
        elif method and name in ("to", "cuda", "cpu"):
            return o.moved(func, name, args, kwargs)
        elif method and name in ("tolist", "numpy") and not o.is_host(args[0]):
            o.read(name)
        elif method and name == "new_tensor" and not o.is_host(args[0]):
            o.copies.append(Copy(_caller(), False, False))  # Python data onto self's device
        elif method and name == "is_pinned" and not o.real:
            return pinned.is_pinned(args[0])
        elif method and name == "pin_memory" and not o.real and not torch.cuda.is_available():
            return pinned.mark_host(args[0].clone(), pinned.PINNED)
        return func(*args, **kwargs)


class HostReadCounter:
    """Context manager: every device-to-host read, host-to-device copy, wrong-device tensor and attention call
    inside the block (module docstring). ``count`` / ``where`` are the reads.

    ``host_tensors``: tensors that live in host memory by design even on CUDA (AdamW's step counters, which
    torch's non-capturable foreach AdamW reads with .item() at no device cost; offloaded optimizer state);
    reads of them are not counted. ``device``: the run's device; on a GPU, host memory is the CPU's.
    """

    def __init__(self, host_tensors: Iterable[torch.Tensor] = (), device: Optional[torch.device] = None) -> None:
        self.where: list[str] = []
        self.copies: list[Copy] = []
        self.wrong_device: list[str] = []
        self.attention: list[AttentionCall] = []
        self.real = torch.device(device).type != "cpu" if device is not None else False
        self._host = [pinned.mark_host(t) if pinned.host_kind(t) is None else t for t in host_tensors]
        self._modes = (_Function(self), _Dispatch(self))

    # ------------------------------------------------------------ what is host memory

    def is_host(self, t: torch.Tensor) -> bool:
        if t.device.type != "cpu":
            return False
        return self.real or pinned.host_kind(t) is not None

    def propagate(self, func, inputs: list[torch.Tensor], out: Any) -> None:
        """CPU stand-in: an operator on host tensors only runs on the host; host meeting device is an error on CUDA."""
        if not inputs:
            return
        host = [t for t in inputs if self.is_host(t)]
        if len(host) == len(inputs):
            for t in _tensors(out):
                if pinned.host_kind(t) is None:
                    pinned.mark_host(t)
            return
        if func in HOST_PLANNED_OPS:  # they read their host tensor (document bounds) on the host, by design
            return
        if host and str(func.namespace) == "c10d":
            self.wrong_device.append(f"host tensor in collective {func} at {_caller()}")
        elif any(t.dim() > 0 for t in host):
            self.wrong_device.append(f"host tensor {tuple(host[0].shape)} meets device tensors in {func} at {_caller()}")

    # ------------------------------------------------------------ records

    def read(self, what: str) -> None:
        self.where.append(f"{what} at {_caller()}")

    def created(self, func, args: tuple, kwargs: dict) -> torch.Tensor:
        device = kwargs.get("device")
        if func in _DATA_FACTORIES and args and isinstance(args[0], torch.Tensor):
            if device is None:
                return func(*args, **kwargs)  # as_tensor(t) is t; tensor(t) copies on t's device
            src = args[0]
            out = func(*args, **kwargs)
            return self._moved_to_device(src, out, False) if self.is_host(src) else out
        pin = kwargs.pop("pin_memory", False) if not self.real and not torch.cuda.is_available() else False
        out = func(*args, **kwargs)
        if device is None and out.device.type == "cpu":
            pinned.mark_host(out, pinned.PINNED if pin else pinned.HOST)  # on CUDA: in host memory
            if not pinned.in_host_side():
                self.wrong_device.append(f"torch.{func.__name__} without device= at {_caller()}")
        elif func in _DATA_FACTORIES and not self.is_host(out):
            self.copies.append(Copy(_caller(), False, False))  # Python data: a pageable host buffer copied over
            pinned.unmark(out)
        elif pin:
            pinned.mark_host(out, pinned.PINNED)
        return out

    def moved(self, func, name: str, args: tuple, kwargs: dict) -> Any:
        src = args[0]
        if name == "cpu":
            if self.real:  # the dispatch mode sees the device-to-host _to_copy
                return func(*args, **kwargs)
            if not self.is_host(src):
                self.read(".cpu()")
            return pinned.mark_host(func(*args, **kwargs))
        if name == "cuda":
            non_blocking = bool(kwargs.get("non_blocking", False))
            device: Optional[torch.device] = torch.device("cuda")
        else:
            parse = {k: v for k, v in kwargs.items() if k != "copy"}
            device, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **parse)
        out = func(*args, **kwargs)
        if device is None or not self.is_host(src):
            return out
        if self.real and device.type == "cpu":
            return out  # host to host
        return self._moved_to_device(src, out, non_blocking)

    def _moved_to_device(self, src: torch.Tensor, out: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        self.copies.append(Copy(_caller(), bool(non_blocking), pinned.is_pinned(src)))
        if not self.real:
            if out.untyped_storage() is src.untyped_storage():
                out = out.clone()  # CUDA would hand back new device memory, never the host tensor itself
            pinned.unmark(out)
        return out

    # ------------------------------------------------------------ results

    @property
    def count(self) -> int:
        return len(self.where)

    def blocking_copies(self) -> list[Copy]:
        return [c for c in self.copies if c.blocking]

    def unfused_attention(self, cap: tuple[int, int] = (9, 0)) -> list[str]:
        """Attention calls that neither flash nor the efficient kernel would take on this compute capability."""
        out = []
        for call in self.attention:
            if cuda_sdpa_kernel(call, cap) not in FUSED:
                out.append(f"attention at {call.where} runs {cuda_sdpa_kernel(call, cap)} on CUDA: {fused_refusals(call, cap)}")
        return out

    def violations(self, fused_attention: bool = False) -> list[str]:
        """Everything that breaks the CUDA contract in the block (attention only when `fused_attention`)."""
        out = [f"device-to-host read: {w}" for w in self.where]
        out += [str(c) for c in self.blocking_copies()]
        out += [f"wrong device: {w}" for w in self.wrong_device]
        return out + (self.unfused_attention() if fused_attention else [])

    def clear(self) -> None:
        for record in (self.where, self.copies, self.wrong_device, self.attention):
            record.clear()

    def __enter__(self) -> HostReadCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
