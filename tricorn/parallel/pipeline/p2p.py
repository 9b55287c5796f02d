"""Point-to-point messages between pipeline stages: one batched post per communication step, sends lazy,
receives posted one compute early, sent outputs' data freed.

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

P2P overlapped with compute: besides its own messages, each step posts the receives of the
next communication step (``exchange(..., ahead=...)``), which then arrive while this rank
computes; each is waited for only before the compute that consumes it, as before, so no wait
moved and the simulator's deadlock proof holds (messages still match per channel in posting
order: receives are posted in list order, sends too).

Memory: one receive buffer per received message, allocated one compute early (it becomes the
next chunk's input or the output gradient, owned by the executor); a sent gradient lives until
its send completes. A sent stage output stays the root of its backward but its data is freed
(``free_data``: the storage resized to 0, shape and autograd node kept) as soon as its send is
done - proven by a receive, or seen complete at a later step (``Work.is_completed``) - or at
once where the message is a converted copy; Megatron's ``deallocate_output_tensor``.
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


def free_data(t: torch.Tensor) -> None:
    """Drop a tensor's data but keep the tensor - its shape, dtype and autograd node - for a backward that
    never reads it (Megatron's ``deallocate_output_tensor``): a stage output is only the root of its
    backward, which needs the output gradient and the graph, not the output's values."""
    t.untyped_storage().resize_(0)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


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
    posted_early: int = 0  # receives posted one communication step before the one that waits for them
    outputs_freed: int = 0  # stage outputs whose data went once sent (``free_data``)
    _warmed_up: bool = False
    _sends: dict = field(default_factory=dict)  # action -> (request, tensor) of the sends not yet waited for
    _posted: dict = field(default_factory=dict)  # recv action -> (request, buffer) posted, not yet waited for
    _release: dict = field(default_factory=dict)  # send action -> stage output whose data goes once it is sent

    def _warm_up(self) -> None:
        if not self._warmed_up:
            for group in [self.group] + ([self.grad_group] if self.grad_group is not None else []):  # one order on every rank
                dist.all_reduce(torch.zeros(1, device=self.device), group=group)
            self._warmed_up = True

    def exchange(
        self,
        step: tuple[Action, ...],
        outgoing: dict[Action, torch.Tensor],
        ahead: tuple[Action, ...] = (),
        release: Optional[dict[Action, torch.Tensor]] = None,
    ) -> dict[Action, torch.Tensor]:
        """Post every send/recv of ``step`` not yet posted, then the receives of ``ahead`` (the next
        communication step: posted one compute early, waited for there); wait for ``step``'s receives only and
        return them by action.

        ``outgoing`` holds the tensor of each send action of the step; the sends complete in
        :meth:`complete_sends`. ``release``: for some sends, a tensor whose data goes once that send is done
        (a stage output kept for its backward: ``free_data``) - at once where the message is a copy of it.
        """
        self._warm_up()
        self._reap()
        ops: list[tuple[Action, dist.P2POp]] = []
        for action in step:
            if action.kind.is_send:
                tensor = self._check(action, outgoing[action])
                ops.append((action, self._op(action, dist.isend, tensor)))
                self.bytes_sent += tensor.numel() * tensor.element_size()
                kept = (release or {}).get(action)
                if kept is not None:
                    if _same_storage(kept, tensor):
                        self._release[action] = kept
                    else:
                        self._free(kept)  # the message is a converted copy: the output's own data is not needed
            elif action not in self._posted:
                ops.append((action, self._op(action, dist.irecv, self._buffer())))
        self._post(ops, waits_now=True)
        # The next step's receives in batches of their own: a coalesced NCCL batch is one request, which must
        # not be waited for before the compute that needs them.
        early = [(a, self._op(a, dist.irecv, self._buffer())) for a in ahead if not a.kind.is_send]
        self._post(early, waits_now=False)
        self.posted_early += len(early)
        received: dict[Action, torch.Tensor] = {}
        for action in step:
            if not action.kind.is_send:
                request, buffer = self._posted.pop(action)
                if request is not None:
                    request.wait()
                received[action] = buffer
        return received

    def _op(self, action: Action, fn, tensor: torch.Tensor) -> dist.P2POp:
        peer, _ = counterpart(action, self.pp_rank, self.pp, self.vpp, self.placement)
        gradient = action.kind in (SEND_BACKWARD, RECV_BACKWARD)
        group = self.grad_group if gradient and self.grad_group is not None else self.group
        return dist.P2POp(fn, tensor, self.global_rank(peer), group)

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def _post(self, ops: list[tuple[Action, dist.P2POp]], waits_now: bool) -> None:
        """One ``batch_isend_irecv`` per group (it takes one group: one batch per channel), in list order.
        A coalesced NCCL batch answers with one request: with sends in it (``waits_now``) it is waited for
        whole, at once; a batch of receives keeps it for each of them."""
        by_group: dict[dist.ProcessGroup, list[tuple[Action, dist.P2POp]]] = {}
        for action, op in ops:
            by_group.setdefault(op.group, []).append((action, op))
        for batch in by_group.values():
            requests = dist.batch_isend_irecv([op for _, op in batch])
            coalesced = len(requests) != len(batch)
            if coalesced and waits_now:
                for request in requests:
                    request.wait()
            for i, (action, op) in enumerate(batch):
                request = requests[0] if coalesced else requests[i]
                if coalesced and waits_now:
                    request = None
                if op.op is dist.isend:
                    self._sends[action] = (request, op.tensor)
                else:
                    self._posted[action] = (request, op.tensor)
            if coalesced and waits_now:
                self.complete_sends([a for a, op in batch if op.op is dist.isend])

    def _reap(self) -> None:
        """Free the data of stage outputs whose sends are already done, without waiting for any: a send that
        no receive has proven done yet may well be (a backend that cannot tell keeps them until proven)."""
        for action in list(self._release):
            request = self._sends.get(action, (None,))[0]
            if request is not None and request.is_completed():
                self.complete_sends([action])

    def complete_sends(self, which: Optional[list[Action]] = None) -> None:
        """Wait for the sends ``which`` (default: all still in flight); their tensors are released, and the
        stage outputs given to :meth:`exchange` as ``release`` lose their data."""
        for action in list(self._sends) if which is None else which:
            if action in self._sends:
                request, _ = self._sends.pop(action)
                if request is not None:
                    request.wait()
                kept = self._release.pop(action, None)
                if kept is not None:
                    self._free(kept)

    def _free(self, output: torch.Tensor) -> None:
        free_data(output)
        self.outputs_freed += 1

    def _check(self, action: Action, tensor: torch.Tensor) -> torch.Tensor:
        if tuple(tensor.shape) != tuple(self.shape):
            raise RuntimeError(
                f"pipeline rank {self.pp_rank} {action}: tensor of shape {tuple(tensor.shape)} does not match the "
                f"configured stage boundary shape {tuple(self.shape)} (seq / CP (/ TP with SP), micro batch, hidden)"
            )
        return tensor.detach().to(self.dtype).contiguous()
