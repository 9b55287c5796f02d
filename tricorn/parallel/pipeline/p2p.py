"""Point-to-point messages between pipeline stages: one batched post per communication step, sends lazy.

A communication step is a maximal run of send/recv actions in a rank's schedule
(``schedules.group_steps``). :meth:`PipelineP2P.exchange` posts all of them, in list order,
as ONE ``torch.distributed.batch_isend_irecv`` over the pipeline group and waits for its
receives only, so the next forward/backward sees complete inputs. Sends complete lazily:
their requests (and tensors) are kept and waited for in :meth:`complete_sends` once a
receive proves them done (``schedules.sends_done_by``), or at the end of the schedule, so a
rank never stalls on a peer that has not yet posted the matching
receive (Megatron's ``overlap_p2p_comm``; the zero-bubble v-schedules need it to be free of
deadlock, ``simulate(..., lazy_sends=True)``). The peer of each action comes from
``schedules.counterpart``; messages between two ranks match in posting order (NCCL has no
tags, gloo matches by (peer, tag 0) in order), which the schedules guarantee. On the v
placement gradients travel on a second group over the same ranks (``grad_group``): a pair
of ranks then carries one FIFO channel per direction, which is what the simulator checks.

Shapes need no handshake: every activation and activation gradient between stages is
``[seq / CP (/ TP under sequence parallel), micro_batch, hidden]`` (sequence-first) in the wire dtype (the
parameter dtype: fp32, bf16 or fp16), all known from the config. Sends are checked against
that shape so a wrong split fails with a message instead of a hang or a garbled tensor.

Works on gloo (CPU) and nccl. Before the first batched P2P the group runs one tiny
all-reduce: NCCL requires the first operation on a communicator to involve every rank of
the group, and a pipeline step only involves neighbours.

Memory: one receive buffer per received message (it becomes the next chunk's input or the
output gradient, owned by the executor); a sent gradient lives until its send completes.
Bytes sent are counted in ``bytes_sent``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from tricorn.parallel.pipeline.schedules import LOOP, RECV_BACKWARD, SEND_BACKWARD, Action, counterpart

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
    placement: str = LOOP
    grad_group: Optional[dist.ProcessGroup] = None  # gradients' own channel (v placement); None: ``group``
    bytes_sent: int = 0
    _warmed_up: bool = False
    _sends: dict = field(default_factory=dict)  # action -> (request, tensor) of the sends not yet waited for

    def _warm_up(self) -> None:
        if not self._warmed_up:
            for group in [self.group] + ([self.grad_group] if self.grad_group is not None else []):  # one order on every rank
                dist.all_reduce(torch.zeros(1, device=self.device), group=group)
            self._warmed_up = True

    def exchange(self, step: tuple[Action, ...], outgoing: dict[Action, torch.Tensor]) -> dict[Action, torch.Tensor]:
        """Post every send/recv of ``step`` as one batch and wait for the receives; returns them by action.

        ``outgoing`` holds the tensor of each send action of the step; the sends complete in
        :meth:`complete_sends`.
        """
        self._warm_up()
        ops: list[dist.P2POp] = []
        actions: dict[int, Action] = {}  # id(op) -> its action
        received: dict[Action, torch.Tensor] = {}
        for action in step:
            peer, _ = counterpart(action, self.pp_rank, self.pp, self.vpp, self.placement)
            gradient = action.kind in (SEND_BACKWARD, RECV_BACKWARD)
            group = self.grad_group if gradient and self.grad_group is not None else self.group
            if action.kind.is_send:
                tensor = self._check(action, outgoing[action])
                ops.append(dist.P2POp(dist.isend, tensor, self.global_rank(peer), group))
                actions[id(ops[-1])] = action
                self.bytes_sent += tensor.numel() * tensor.element_size()
            else:
                buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buffer, self.global_rank(peer), group))
                actions[id(ops[-1])] = action
                received[action] = buffer
        by_group: dict[dist.ProcessGroup, list[dist.P2POp]] = {}
        for op in ops:  # batch_isend_irecv takes one group: one batch per channel
            by_group.setdefault(op.group, []).append(op)
        for batch in by_group.values():
            requests = dist.batch_isend_irecv(batch)
            if len(requests) != len(batch):  # a coalesced NCCL batch answers with one request: wait for it all
                for request in requests:
                    request.wait()
                continue
            for op, request in zip(batch, requests):
                if op.op is dist.isend:
                    self._sends[actions[id(op)]] = (request, op.tensor)
                else:
                    request.wait()
        return received

    def complete_sends(self, which: Optional[list[Action]] = None) -> None:
        """Wait for the sends ``which`` (default: all still in flight); their tensors are released."""
        for action in list(self._sends) if which is None else which:
            if action in self._sends:
                self._sends.pop(action)[0].wait()

    def _check(self, action: Action, tensor: torch.Tensor) -> torch.Tensor:
        if tuple(tensor.shape) != tuple(self.shape):
            raise RuntimeError(
                f"pipeline rank {self.pp_rank} {action}: tensor of shape {tuple(tensor.shape)} does not match the "
                f"configured stage boundary shape {tuple(self.shape)} (seq / CP (/ TP with SP), micro batch, hidden)"
            )
        return tensor.detach().to(self.dtype).contiguous()
