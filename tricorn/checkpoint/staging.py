"""--async-save staging: copy the checkpoint's tensors to host memory without stalling the next step.

On CUDA the copies go into pinned host buffers (kept between saves, one per checkpoint tensor)
and run on a side stream, so the host returns at once and the next iteration's forward and
backward overlap them. Two fences keep it correct:
- the trainer's default stream waits for the copies before the next optimizer step (the only
  thing that writes parameters and optimizer state in place): `Trainer.step_fences`;
- the background writer waits for them (`Staged.wait`) before it reads the buffers.
Source tensors are marked as used on the side stream (record_stream), so temporaries (a gathered
ZeRO-3 unit, an assembled DP shard) are not reused by the allocator before their copy is done.
On CPU the copies are plain synchronous copies, as before.

No collectives. Memory: one pinned host copy of this rank's checkpoint tensors, kept for reuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass
class Staged:
    tensors: dict[str, tuple[torch.Tensor, Any]]  # name -> (host copy, what the caller paired with it)
    done: Optional[Any] = None  # torch.cuda.Event recorded after the copies (CUDA only)

    def wait(self) -> None:
        """Block until the copies have landed (the background writer calls this, not the training thread)."""
        if self.done is not None:
            self.done.synchronize()


class HostStaging:
    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._stream = None

    def _buffer(self, name: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._buffers[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return buf

    def stage(self, local: dict[str, tuple[torch.Tensor, Any]]) -> Staged:
        """Host copies of `local`'s tensors (asynchronous on CUDA, see the module docstring)."""
        if not any(t.is_cuda for t, _ in local.values()):
            return Staged({k: (t.to("cpu", copy=True), p) for k, (t, p) in local.items()})
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())  # the values as of now, after the last step
        out = {}
        with torch.cuda.stream(self._stream):
            for k, (t, p) in local.items():
                if not t.is_cuda:
                    out[k] = (t.to("cpu", copy=True), p)
                    continue
                buf = self._buffer(k, t)
                buf.copy_(t, non_blocking=True)
                t.record_stream(self._stream)
                out[k] = (buf, p)
        done = torch.cuda.Event()
        done.record(self._stream)
        return Staged(out, done)
