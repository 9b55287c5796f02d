"""Runs one pipeline rank's schedule (``schedules.schedule_for``) on real model chunks.

The executor is the pipelined counterpart of ``training.step.forward_backward_no_pipelining``
and has the same signature: ``executor(chunks, microbatches, ctx) -> this rank's loss sum``.
It walks the rank's action list step by step (``schedules.group_steps``):

* FORWARD m,c: the input is microbatch m's tokens (after ``ctx.prepare``, the CP slice) on
  virtual stage 0, otherwise the activation received for (m, c), made a leaf that requires
  grad. The output is kept for the backward. On the last virtual stage the output is the
  loss ``sum(per_token * mask) / ctx.denominator(m)`` (``step.py``: Megatron's normalisation, by the
  microbatch's tokens x the microbatches x DP, or by the global batch's tokens), never again by the
  pipeline size; the run's total adds ``sum / ctx.num_tokens``, the logged loss.
* BACKWARD m,c: ``scale_loss(loss).backward()`` on the last virtual stage, otherwise
  ``torch.autograd.backward(output, received output gradient)``, inside
  ``ctx.optimizer.microbatch(is_last=<last backward of chunk c>, chunk=c)``. The input's
  ``.grad`` is what SEND_BACKWARD sends. Output, input and gradients of (m, c) are dropped
  as soon as they are sent or used, so a rank holds only the activations the schedule keeps
  in flight.
* WEIGHT m,c (zero-bubble schedules): the weight gradients that the B of (m, c) left in the
  iteration's ``wgrad.WeightGradStore``, inside ``ctx.optimizer.microbatch(is_last=<last W
  of chunk c>, chunk=c)``. A B that has a W runs inside ``microbatch(is_last=False)`` and
  ``store.backward_input((m, c))``: the linears, the norms and the experts' loop of GEMMs queue
  their weight gradients instead of computing them. The last W of a chunk comes after its last B, so the chunk's DP buckets
  start their reduction only once every gradient is in.
* On the v placement (zbv, dualpipev) the edge between the two chunks of rank pp-1 is local:
  chunk 0's output becomes chunk 1's input (a leaf of the same storage) and chunk 1's input
  gradient becomes chunk 0's output gradient, with no message.
* Each run of send/recv actions is one ``batch_isend_irecv`` (``p2p.PipelineP2P``) whose
  receives are waited on before the next compute, and which also posts the receives of the
  next run, one compute early (they arrive while this rank computes); sends complete lazily,
  all of them waited for before the call returns. A sent stage output keeps its autograd node
  for the backward but loses its data once its send is done (``p2p.free_data``).

Gradients accumulate in the parameters over all microbatches; the DP reduction, the tied
embedding reduction and grad scaling run once afterwards in ``optimizer.finish_grad_sync``
(called by the trainer). With ``ctx.forward_only`` (evaluation) the forward-only schedule
runs under ``no_grad``.

``order`` holds the actions of the last call in the order they completed and ``peak_in_flight``
the most (microbatch, chunk) pairs it held at once (from forward to the last backward action:
the W where there is one); tests compare both with the simulator.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from tricorn.config import Config
from tricorn.data.base import Batch
from tricorn.parallel.pipeline.p2p import PipelineP2P, activation_shape, wire_dtype
from tricorn.parallel.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    RECV_BACKWARD,
    RECV_FORWARD,
    SEND_BACKWARD,
    V_SCHEDULES,
    WEIGHT,
    Action,
    V,
    group_steps,
    is_first_stage,
    is_last_stage,
    next_stage,
    placement_of,
    prev_stage,
    schedule_for,
    sends_done_by,
    virtual_stage,
)
from tricorn.parallel.pipeline.stages import layout_from_config
from tricorn.parallel.state import world_timeout
from tricorn.parallel.step import StepContext, new_global_batch, set_moe_aux_weight
from tricorn.parallel.wgrad import WeightGradStore
from tricorn.profiling import span
from tricorn.timers import PIPELINE_P2P_WAIT

Key = tuple[int, int]  # (microbatch, chunk)


@dataclass
class _Run:
    """Tensors of one call, keyed by (microbatch, chunk); each entry lives only as long as the schedule needs it."""

    ctx: StepContext
    microbatches: list[Batch]
    prepared: dict[int, Batch] = field(default_factory=dict)
    inputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # received activations (leaves) until their forward
    leaves: dict[Key, torch.Tensor] = field(default_factory=dict)  # a forward's input until its backward (for .grad)
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # stage output, or the loss on the last stage
    to_send: dict[Key, torch.Tensor] = field(default_factory=dict)  # output until SEND_FORWARD (forward-only)
    output_grads: dict[Key, torch.Tensor] = field(default_factory=dict)  # received gradients of the outputs
    input_grads: dict[Key, torch.Tensor] = field(default_factory=dict)  # until SEND_BACKWARD
    held: set[Key] = field(default_factory=set)  # forwarded, last backward action not yet run
    store: Optional[WeightGradStore] = None  # the deferred weight gradients (zero-bubble schedules)
    total: Optional[torch.Tensor] = None

    def batch(self, m: int) -> Batch:
        if m not in self.prepared:
            self.prepared[m] = self.ctx.prepare(self.microbatches[m])
        return self.prepared[m]


class PipelineExecutor:
    """``forward_backward`` for PP > 1: runs this rank's action list with batched P2P over the pipeline group."""

    def __init__(self, cfg: Config, state, schedule: Optional[str] = None):
        layout = layout_from_config(cfg)
        self.pp, self.vpp, self.pp_rank = layout.pp, layout.vpp, state.pp_rank
        # Megatron's rule: interleaved whenever there are virtual stages, else the configured one; zbv and
        # dualpipev are the schedules of the v placement's 2 chunks.
        kind = schedule or cfg.parallel.pipeline_schedule
        self.kind = kind if (self.vpp == 1 or kind in V_SCHEDULES) else None
        self.placement = placement_of(self.kind)
        assert layout.placement == self.placement, (layout.placement, self.placement)
        self.p2p = PipelineP2P(
            group=state.pp_group,
            pp_rank=self.pp_rank,
            pp=self.pp,
            vpp=self.vpp,
            shape=activation_shape(cfg),
            dtype=wire_dtype(cfg),
            device=state.device,
            global_rank=state.pp_global_rank,
            placement=self.placement,
            grad_group=_gradient_group(state) if self.placement == V else None,
        )
        self.order: list[Action] = []
        self.peak_in_flight = 0  # most (microbatch, chunk) pairs held for a backward during the last call
        self.weights_deferred = 0  # weight-gradient products the W's of the last call computed

    def actions(self, num_microbatches: int, forward_only: bool = False) -> list[Action]:
        """This rank's action list for one global batch."""
        return schedule_for(self.pp, self.vpp, num_microbatches, self.kind, forward_only)[self.pp_rank]

    def is_last_stage(self, chunk: int) -> bool:
        """Chunk ``chunk`` of this rank holds the head and the loss."""
        return is_last_stage(self.pp_rank, chunk, self.pp, self.vpp, self.placement)

    def _local(self, chunk: int, towards_next: bool) -> Optional[int]:
        """The chunk of this rank on the other side of a local edge (the tip of the V), else None."""
        peer = (next_stage if towards_next else prev_stage)(self.pp_rank, chunk, self.pp, self.vpp, self.placement)
        return peer[1] if peer is not None and peer[0] == self.pp_rank else None

    def __call__(self, chunks: list[nn.Module], microbatches: list[Batch], ctx: StepContext) -> torch.Tensor:
        """Forward (and backward) of all microbatches; returns this rank's detached loss sum (0 off the last stage)."""
        if len(chunks) != self.vpp:
            raise ValueError(f"pipeline rank {self.pp_rank} got {len(chunks)} model chunks, the layout has {self.vpp}")
        everyone = schedule_for(self.pp, self.vpp, len(microbatches), self.kind, ctx.forward_only)
        actions = everyone[self.pp_rank]
        self._done_by = sends_done_by(everyone, self.pp_rank, self.pp, self.vpp, self.placement)
        split = any(a.kind is WEIGHT for a in actions)
        # The final backward action of each chunk (its last W where there are W's) closes its gradients.
        last_backward = {a.chunk: a for a in actions if a.kind is (WEIGHT if split else BACKWARD)}
        run = _Run(ctx, microbatches, total=torch.zeros((), dtype=torch.float32, device=microbatches[0].tokens.device))
        run.store = WeightGradStore() if split else None
        self.order, self.peak_in_flight, self.weights_deferred = [], 0, 0
        new_global_batch(chunks)  # each chunk's first forward (microbatch 0) casts the FP8 weights again
        with torch.set_grad_enabled(not ctx.forward_only), run.store.collecting() if split else contextlib.nullcontext():
            steps = group_steps(actions)
            ahead = _next_communication(steps)
            for i, step in enumerate(steps):
                head = step[0]
                with span(self._range_name, step):  # "F stage1 mb0", "p2p SF0,RB1" in a profile window
                    if head.kind is FORWARD:
                        self._forward(chunks[head.chunk], head, run)
                    elif head.kind is BACKWARD:
                        self._backward(head, run, is_last=not split and last_backward[head.chunk] == head)
                    elif head.kind is WEIGHT:
                        self._weight(head, run, is_last=last_backward[head.chunk] == head)
                    else:
                        self._communicate(step, run, ahead[i])
                self.order.extend(step)
            self.p2p.complete_sends()
        return run.total

    def _range_name(self, step: tuple[Action, ...]) -> str:
        """A step's name in the profiler's trace: a compute action with its virtual stage, or the batched messages."""
        head = step[0]
        if head.kind.is_compute:
            return (
                f"{head.kind.value} stage{virtual_stage(self.pp_rank, head.chunk, self.pp, self.placement)} mb{head.microbatch}"
            )
        return "p2p " + ",".join(str(a) for a in step)

    # ------------------------------------------------------------ compute

    def _forward(self, model: nn.Module, a: Action, run: _Run) -> None:
        key = (a.microbatch, a.chunk)
        mb = run.batch(a.microbatch)
        last = self.is_last_stage(a.chunk)
        x = mb.tokens if is_first_stage(self.pp_rank, a.chunk) else run.inputs.pop(key)
        out = model(x, mb.labels if last else None, mb.sample_ids)
        if last:
            out = (out * mb.loss_mask).sum()
            run.total += out.detach().float() / run.ctx.num_tokens
            out = out / run.ctx.denominator(a.microbatch)
        else:
            nxt = self._local(a.chunk, towards_next=True)
            if nxt is None:
                run.to_send[key] = out
            else:  # the tip of the V: the next chunk's input, a leaf over the same storage
                run.inputs[(a.microbatch, nxt)] = out.detach().requires_grad_(not run.ctx.forward_only)
        if not run.ctx.forward_only:
            run.outputs[key] = out
            run.leaves[key] = x
            run.held.add(key)
            self.peak_in_flight = max(self.peak_in_flight, len(run.held))

    def _backward(self, a: Action, run: _Run, is_last: bool) -> None:
        key = (a.microbatch, a.chunk)
        out = run.outputs.pop(key)
        set_moe_aux_weight(run.ctx, a.microbatch, run.batch(a.microbatch))
        deferred = run.store.backward_input(key) if run.store is not None else contextlib.nullcontext()
        with run.ctx.optimizer.microbatch(is_last=is_last, chunk=a.chunk), deferred:
            if self.is_last_stage(a.chunk):
                run.ctx.optimizer.scale_loss(out).backward()
            else:
                grad = run.output_grads.pop(key)
                torch.autograd.backward(out, grad.to(out.dtype))
        x = run.leaves.pop(key)
        if run.store is None:
            run.held.discard(key)
        if not is_first_stage(self.pp_rank, a.chunk):
            prev = self._local(a.chunk, towards_next=False)
            if prev is None:
                run.input_grads[key] = x.grad
            else:
                run.output_grads[(a.microbatch, prev)] = x.grad

    def _weight(self, a: Action, run: _Run, is_last: bool) -> None:
        key = (a.microbatch, a.chunk)
        assert run.store is not None
        # The last W of a chunk delivers only its weights' gradients (every other one is in): the DP buckets
        # are complete as those arrive, and start their reduction from the W's hooks (--overlap-grad-reduce).
        expected = run.store.weights(key) if is_last else None
        with run.ctx.optimizer.microbatch(is_last=is_last, chunk=a.chunk, expected=expected):
            self.weights_deferred += run.store.run(key)
        run.held.discard(key)

    # ------------------------------------------------------------ communication

    def _communicate(self, step: tuple[Action, ...], run: _Run, ahead: tuple[Action, ...]) -> None:
        outgoing, release = {}, {}
        for a in step:
            key = (a.microbatch, a.chunk)
            if a.kind.is_send:
                # The gradient is not needed after sending. The activation stays in `outputs` as the root of its
                # backward, but its data goes once the send is done (p2p.free_data): nothing reads it again.
                store = run.input_grads if a.kind is SEND_BACKWARD else run.to_send
                outgoing[a] = store.pop(key)
                if a.kind is not SEND_BACKWARD and key in run.outputs:
                    release[a] = run.outputs[key]
        with run.ctx.timers(PIPELINE_P2P_WAIT):
            received = self.p2p.exchange(step, outgoing, ahead, release)
            for a in received:  # the sends these receives prove done: their buffers go now
                self.p2p.complete_sends(self._done_by.get(a, []))
        for a, tensor in received.items():
            key = (a.microbatch, a.chunk)
            if a.kind is RECV_FORWARD:
                run.inputs[key] = tensor.requires_grad_(not run.ctx.forward_only)
            elif a.kind is RECV_BACKWARD:
                run.output_grads[key] = tensor


def _next_communication(steps: list[tuple[Action, ...]]) -> dict[int, tuple[Action, ...]]:
    """For each communication step (by index), the next one: its receives are posted one compute early."""
    out: dict[int, tuple[Action, ...]] = {}
    later: tuple[Action, ...] = ()
    for i in reversed(range(len(steps))):
        if not steps[i][0].kind.is_compute:
            out[i], later = later, steps[i]
    return out


def _gradient_group(state) -> dist.ProcessGroup:
    """A second group over each pipeline's ranks: the gradients' own FIFO channel on the v placement.

    A collective of the whole world (every rank builds its executor at the same point), with the world's timeout.
    Under the fake backend (``tricorn simulate``: one rank of the world, no messages) the pipeline group serves."""
    if dist.get_backend() == "fake":
        return state.pp_group
    mesh = state.mesh.mesh
    pp_dim = state.mesh.mesh_dim_names.index("pp")
    pipelines = mesh.movedim(pp_dim, -1).reshape(-1, mesh.shape[pp_dim]).tolist()
    group, _ = dist.new_subgroups_by_enumeration(pipelines, timeout=world_timeout())
    return group
