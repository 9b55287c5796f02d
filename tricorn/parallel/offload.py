"""Activation offload: the tensors chosen layers save for backward wait in host memory instead of on the device.

Flags (Megatron-LM's names, its layer-level ``cpu_offloading``, which it runs through Transformer Engine):

    --cpu-offloading-num-layers N      the first N layers of each model chunk (pipeline stage, or virtual stage)
    --cpu-offloading                   implied by N > 0; alone it is refused (say which layers)

Mechanism (saved-tensor hooks, ``torch.autograd.graph.saved_tensors_hooks``). Each offloaded layer's forward
runs inside hooks whose pack takes every tensor autograd saves - except parameters and buffers, and leaves that
require grad (a pipeline stage's received input, which the executor keeps anyway) - and returns a handle.
Handles of one storage share it: the storage is moved once, and each saved view is rebuilt from it, so views
(SDPA's output and the out projection's input) stay one allocation on the way back as they were before.

- Forward: when the layer's forward ends, its storages are copied into host memory (pinned on CUDA) on a side
  stream that first waits for the compute stream; the compute stream runs on into the next layer, and the
  device memory returns to the allocator once the copies are done (``record_stream``: no host wait). A storage
  already emptied in place by then (selective ``norm`` / ``mlp_act`` recompute drops its norm and activation
  outputs this way and refills them before backward) is not moved: its handle gives the refilled tensor back.
- Backward: the layer's output passes through ``_Boundary``, whose backward runs as the gradient reaches the
  layer, before any of its own nodes: it brings the layer's storages back (if not already) and starts bringing
  back the layer before it, on the side stream, so that copy overlaps this layer's backward. Each handle's
  unpack makes the compute stream wait for its layer's copies (an event, never a host wait), and a storage not
  yet back (a node reached by another path, an MoE aux loss) is fetched then. The first layer after the
  offloaded ones carries a ``_Boundary`` too, so the last offloaded layer comes back while it runs backward.
- CPU (``--device cpu``): the same code with synchronous copies into separate host tensors (marked as host
  memory, tricorn/pinned.py, so the peak tracker leaves them out); the values are the same bits.

Composes with: recompute - selective checkpoints inside a layer keep only their inputs, which are offloaded;
under full recompute a group's first layer runs the group and saves its input, so the groups whose first layer
is among the first N go to host, and a recomputation inside backward is never offloaded; pipeline parallelism,
zero-bubble included (a ``B`` brings the layer back; what the deferred weight gradients hold until their ``W``
are the tensors it brought back, as they would hold the originals); TP/SP and CP (the hooks see local tensors
only). Refused: --torch-compile and --transformer-impl transformer_engine (their saved tensors do not all pass
through these hooks).

Collectives: none. Memory effect (planning/activations.py ``offload_activation_bytes``): an offloaded layer keeps
nothing on the device between its forward and its backward, except its input when that is a pipeline stage's
received tensor; while one runs, its own tensors and the neighbour's in flight (two layers of one microbatch)
are there. Host memory: every offloaded layer of every microbatch in flight. Traffic: each offloaded byte
crosses the host link twice per microbatch (planning/step_time.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from tricorn import pinned

# Callables told of every tensor an offloaded layer saves, before it moves (the activation probe counts them);
# each returns a token that lives as long as autograd's handle.
OBSERVERS: list[Callable[[torch.Tensor], Any]] = []


# ---------------------------------------------------------------- validation


def offloaded_layers(m: Any) -> int:
    """Layers of each model chunk whose activations go to host: --cpu-offloading-num-layers (0: none)."""
    return int(m.cpu_offloading_num_layers or 0)


def validate_offload(cfg: Any) -> list[str]:
    """Every problem with the offload flags of a Config, one sentence each (before launch)."""
    from tricorn.parallel.recompute import chunk_layer_counts

    m = cfg.model
    n = offloaded_layers(m)
    if not m.cpu_offloading and n == 0:
        return []
    chunk_layers = chunk_layer_counts(cfg)
    errs: list[str] = []
    if n == 0:
        errs.append("--cpu-offloading needs --cpu-offloading-num-layers N (the first N layers of each model chunk)")
    elif chunk_layers and n > min(chunk_layers):
        errs.append(
            f"--cpu-offloading-num-layers {n} is more than the {min(chunk_layers)} layers a model chunk holds on a "
            f"pipeline stage; use 1..{min(chunk_layers)}"
        )
    if m.torch_compile:
        errs.append("--cpu-offloading does not run with --torch-compile (compiled layers save tensors these hooks do not see)")
    if m.transformer_impl == "transformer_engine":
        errs.append(
            "--cpu-offloading runs with --transformer-impl local (Transformer Engine saves tensors these hooks do not see)"
        )
    return errs


# ---------------------------------------------------------------- streams


@dataclass(frozen=True)
class StreamOps:
    """The CUDA calls offload makes: the real ones on CUDA; recording stand-ins with the same signatures in tests
    (tests/test_activation_offload.py); none on the CPU, where every copy is synchronous."""

    new_stream: Callable[[], Any]
    current_stream: Callable[[], Any]
    use_stream: Callable[[Any], contextlib.AbstractContextManager]
    new_event: Callable[[], Any]
    record_stream: Callable[[torch.Tensor, Any], None]

    @classmethod
    def cuda(cls) -> StreamOps:
        return cls(torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream, torch.cuda.Event, torch.Tensor.record_stream)


class _Streams:
    """The side stream of one rank's offload (None on the CPU: copies run where they are issued)."""

    def __init__(self, ops: Optional[StreamOps]):
        self.ops = ops
        self.side = ops.new_stream() if ops is not None else None
        self.compute: Any = None  # the stream that was current when the side stream was entered

    @contextlib.contextmanager
    def on_side(self, after_compute: bool) -> Iterator[None]:
        """Work issued inside runs on the side stream (after the compute stream's queued work, if asked)."""
        if self.ops is None:
            yield
            return
        self.compute = self.ops.current_stream()
        if after_compute:
            self.side.wait_stream(self.compute)
        with self.ops.use_stream(self.side):
            yield

    def done(self) -> Any:
        """An event after the side stream's queued copies (None on the CPU)."""
        if self.ops is None:
            return None
        event = self.ops.new_event()
        event.record(self.side)
        return event

    def compute_waits(self, event: Any) -> None:
        if event is not None:
            self.ops.current_stream().wait_event(event)

    def used_on_side(self, t: torch.Tensor) -> None:
        if self.ops is not None:
            self.ops.record_stream(t, self.side)

    def used_on_compute(self, t: torch.Tensor) -> None:
        """A tensor allocated on the side stream (inside ``on_side``) that the compute stream will read."""
        if self.ops is not None:
            self.ops.record_stream(t, self.compute)


# ---------------------------------------------------------------- one storage, one saved tensor, one layer


def _flat(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``t`` as a 1-D tensor of its dtype (a view: no copy). Views are made with as_strided,
    not set_: FakeTensorMode's dispatch cache keeps every storage handed to set_ alive (`tricorn simulate`)."""
    return t.detach().as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)


class _Stored:
    """One device storage an offloaded layer saved: on the device until the layer's forward ends, then in host
    memory until its backward brings it back; alive while any saved tensor of it is (autograd's handles)."""

    __slots__ = ("device", "host", "event", "streams")

    def __init__(self, device: torch.Tensor, streams: _Streams):
        self.device: Optional[torch.Tensor] = device  # a flat view of the whole storage, or what came back
        self.host: Optional[torch.Tensor] = None
        self.event: Any = None
        self.streams = streams

    def offload(self) -> None:
        """Copy to host and let the device storage go; a storage emptied in place (recompute drops it) stays."""
        flat = self.device
        if flat is None or flat.untyped_storage().nbytes() == 0:
            return
        self.host = pinned.host_empty(flat.numel(), flat.dtype, pinned.pins_host_memory(flat.device))
        self.host.copy_(flat, non_blocking=pinned.is_pinned(self.host))
        self.streams.used_on_side(flat)  # the allocator reuses the block only after the side stream's copy
        self.device = None

    def reload(self, device: torch.device) -> None:
        if self.device is not None:
            return
        flat = torch.empty(self.host.numel(), dtype=self.host.dtype, device=device)
        self.device = flat.copy_(self.host, non_blocking=pinned.is_pinned(self.host))
        self.streams.used_on_compute(flat)


class _Saved:
    """What autograd keeps for one saved tensor of an offloaded layer: its storage and its view of it."""

    __slots__ = ("stored", "group", "dtype", "size", "stride", "offset", "tokens")

    def __init__(self, stored: _Stored, group: _Group, t: torch.Tensor, tokens: list):
        self.stored, self.group = stored, group
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()
        self.tokens = tokens

    def unpack(self) -> torch.Tensor:
        self.group.reload()  # no-op when the _Boundary already brought it back
        self.group.streams.compute_waits(self.stored.event)
        flat = self.stored.device
        flat = flat if flat.dtype == self.dtype else flat.view(self.dtype)  # another dtype's view of the storage
        return flat.as_strided(self.size, self.stride, self.offset)


class _Group:
    """One offloaded layer's forward for one microbatch: the storages it saved."""

    def __init__(self, offloader: Offloader, device: torch.device):
        self.streams = offloader.streams
        self.skip = offloader.skip
        self.device = device
        self.stored: dict[int, _Stored] = {}
        self.pending: Optional[list[_Stored]] = None  # between offload and reload: what is in host memory

    def pack(self, t: torch.Tensor) -> Any:
        tokens = [observe(t) for observe in OBSERVERS]
        storage = t.untyped_storage()
        if (
            storage.nbytes() == 0
            or storage._cdata in self.skip
            or isinstance(t, nn.Parameter)
            or (t.is_leaf and t.requires_grad)
            or t.device.type == "meta"
            or t.device != self.device
        ):
            # kept where it is: parameters, the stage's received input, empty storages, and tensors already off the
            # compute device (a host tensor saved on a GPU run would otherwise come back on the GPU)
            return (t, tokens)
        stored = self.stored.get(storage._cdata)
        if stored is None:
            stored = self.stored[storage._cdata] = _Stored(_flat(t), self.streams)
        return _Saved(stored, self, t, tokens)

    @staticmethod
    def unpack(handle: Any) -> torch.Tensor:
        return handle.unpack() if isinstance(handle, _Saved) else handle[0]

    def offload(self) -> None:
        """At the end of the layer's forward: its storages to host, on the side stream after the compute."""
        stored, self.stored = list(self.stored.values()), {}
        with self.streams.on_side(after_compute=True):
            for s in stored:
                s.offload()
        self.pending = [s for s in stored if s.host is not None]  # the rest stayed (emptied in place, refilled later)
        event = self.streams.done()
        for s in self.pending:
            s.event = event

    def reload(self) -> None:
        """Bring the storages back (once): on the side stream, the compute stream waits for the event."""
        if not self.pending:
            return
        pending, self.pending = self.pending, None  # handles keep what they need; the group keeps nothing
        with self.streams.on_side(after_compute=False):
            for s in pending:
                s.reload(self.device)
        event = self.streams.done()
        for s in pending:
            s.event = event


class _Boundary(torch.autograd.Function):
    """Identity on a layer's output; its backward (the layer's first) brings the layer back and prefetches the one
    before it."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: Optional[_Group], before: Optional[_Group]) -> torch.Tensor:
        ctx.groups = (group, before)
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        for g in ctx.groups:
            if g is not None:
                g.reload()
        ctx.groups = ()
        return grad, None, None


# ---------------------------------------------------------------- the model chunks


@dataclass
class _Chain:
    last: Optional[_Group] = None  # the latest offloaded layer of the running chunk forward


@dataclass
class Offloader:
    """One rank's activation offload: the side stream, and what is never moved (parameters, buffers)."""

    streams: _Streams
    chunks: list[nn.Module] = field(default_factory=list)
    skip: set[int] = field(default_factory=set)

    def _begin(self, chain: _Chain) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any) -> None:
            chain.last = None
            if not self.skip:  # read at the first forward: the optimizer moved the parameters into its buckets
                for chunk in self.chunks:
                    self.skip.update(t.untyped_storage()._cdata for t in [*chunk.parameters(), *chunk.buffers()])

        return hook

    def wrap(self, layer: nn.Module, chain: _Chain, offloaded: bool) -> None:
        forward = layer.forward

        def run(x: torch.Tensor, *args: Any) -> torch.Tensor:
            # No graph (evaluation), a recomputation inside backward, or a layer a recompute group runs: as is.
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1 or _ACTIVE[0]:
                return forward(x, *args)
            before, chain.last = chain.last, None
            if not offloaded:
                y = forward(x, *args)
                return _Boundary.apply(y, None, before) if before is not None else y
            group = _Group(self, x.device)
            _ACTIVE[0] += 1
            try:
                with torch.autograd.graph.saved_tensors_hooks(group.pack, group.unpack):
                    y = forward(x, *args)
            finally:
                _ACTIVE[0] -= 1
            group.offload()
            chain.last = group
            return _Boundary.apply(y, group, before)

        layer.forward = run


_ACTIVE = [0]  # offloaded layer forwards running (a full-recompute group's members run inside its first layer's)


def apply_offload(
    chunks: Sequence[nn.Module], cfg: Any, device: torch.device, ops: Optional[StreamOps] = None
) -> Optional[Offloader]:
    """Offload the first --cpu-offloading-num-layers layers of each model chunk (after apply_recompute, whose
    wrappers this one goes around); ``ops``: the stream calls (default: CUDA's on a CUDA device, none on CPU)."""
    from tricorn.parallel.recompute import RecomputePlan

    n = offloaded_layers(cfg.model)
    if n == 0:
        return None
    if ops is None and device.type == "cuda":
        ops = StreamOps.cuda()
    offloader = Offloader(_Streams(ops), list(chunks))
    plan = RecomputePlan.from_model_config(cfg.model)
    for chunk in chunks:
        layers = dict(chunk.layers.items())
        # Under full recompute only a group's first layer saves (the group's input); the others run inside it.
        members = {i for group in plan.full_groups(list(layers)) for i in group[1:]}
        leaders = [(k, layer) for k, (i, layer) in enumerate(layers.items()) if i not in members]
        chain = _Chain()
        chunk.register_forward_pre_hook(offloader._begin(chain))
        for k, layer in leaders:
            offloader.wrap(layer, chain, offloaded=k < n)
            if k >= n:  # the first layer kept on the device brings the last offloaded one back in its backward
                break
    return offloader


__all__ = ["OBSERVERS", "Offloader", "StreamOps", "apply_offload", "offloaded_layers", "validate_offload"]
