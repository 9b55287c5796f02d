"""Point-to-point messages between pipeline stages: one ``batch_isend_irecv`` per communication step.

A communication step is a maximal run of send/recv actions in a rank's schedule
(``schedules.group_steps``). :meth:`PipelineP2P.exchange` posts all of them, in list order,
as ONE ``torch.distributed.batch_isend_irecv`` over the pipeline group and waits for every
request before returning, so the next forward/backward sees complete tensors. The peer of
each action comes from ``schedules.counterpart``; messages between two ranks match in
posting order (NCCL has no tags, gloo matches by (peer, tag 0) in order), which the
schedules guarantee.

Shapes need no handshake: every activation and activation gradient between stages is
``[seq / CP (/ TP under sequence parallel), micro_batch, hidden]`` (sequence-first) in the wire dtype (the
parameter dtype: fp32, bf16 or fp16), all known from the config. Sends are checked against
that shape so a wrong split fails with a message instead of a hang or a garbled tensor.

Works on gloo (CPU) and nccl. Before the first batched P2P the group runs one tiny
all-reduce: NCCL requires the first operation on a communicator to involve every rank of
the group, and a pipeline step only involves neighbours.

Memory: one receive buffer per received message (it becomes the next chunk's input or the
output gradient, owned by the executor). Bytes sent are counted in ``bytes_sent``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tricorn.parallel.pipeline.schedules import Action, counterpart

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def activation_shape(cfg) -> tuple[int, int, int]:
    """[local sequence, micro batch, hidden] of the (sequence-first) hidden states passed between stages."""
    p, m = cfg.parallel, cfg.model
    seq = m.seq_length // p.context_parallel_size
    if p.sequence_parallel and p.tensor_model_parallel_size > 1:
        seq //= p.tensor_model_parallel_size
    return seq, cfg.training.micro_batch_size, m.hidden_size


def wire_dtype(cfg) -> torch.dtype:
    """Activations travel in the parameter dtype (Megatron's ``params_dtype``)."""
    return _DTYPES[cfg.param_dtype_name]


@dataclass
class PipelineP2P:
    """Batched sends/recvs of one rank of a pipeline of ``pp`` ranks x ``vpp`` chunks."""

    group: dist.ProcessGroup
    pp_rank: int
    pp: int
    vpp: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    global_rank: Callable[[int], int]  # pipeline rank -> world rank (what P2POp's peer means)
    bytes_sent: int = 0
    _warmed_up: bool = False

    def _warm_up(self) -> None:
        if not self._warmed_up:
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)
            self._warmed_up = True

    def exchange(self, step: tuple[Action, ...], outgoing: dict[Action, torch.Tensor]) -> dict[Action, torch.Tensor]:
        """Post every send/recv of ``step`` as one batch and wait; returns the received tensors by action.

        ``outgoing`` holds the tensor of each send action of the step.
        """
        self._warm_up()
        ops: list[dist.P2POp] = []
        received: dict[Action, torch.Tensor] = {}
        for action in step:
            peer, _ = counterpart(action, self.pp_rank, self.pp, self.vpp)
            if action.kind.is_send:
                tensor = self._check(action, outgoing[action])
                ops.append(dist.P2POp(dist.isend, tensor, self.global_rank(peer), self.group))
                self.bytes_sent += tensor.numel() * tensor.element_size()
            else:
                buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buffer, self.global_rank(peer), self.group))
                received[action] = buffer
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        return received

    def _check(self, action: Action, tensor: torch.Tensor) -> torch.Tensor:
        if tuple(tensor.shape) != tuple(self.shape):
            raise RuntimeError(
                f"pipeline rank {self.pp_rank} {action}: tensor of shape {tuple(tensor.shape)} does not match the "
                f"configured stage boundary shape {tuple(self.shape)} (seq / CP (/ TP with SP), micro batch, hidden)"
            )
        return tensor.detach().to(self.dtype).contiguous()
