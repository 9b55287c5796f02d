"""Runs one pipeline rank's schedule (``schedules.schedule_for``) on real model chunks.

The executor is the pipelined counterpart of ``training.step.forward_backward_no_pipelining``
and has the same signature: ``executor(chunks, microbatches, ctx) -> this rank's loss sum``.
It walks the rank's action list step by step (``schedules.group_steps``):

* FORWARD m,c: the input is microbatch m's tokens (after ``ctx.prepare``, the CP slice) on
  virtual stage 0, otherwise the activation received for (m, c), made a leaf that requires
  grad. The output is kept for the backward. On the last virtual stage the output is the
  loss ``sum(per_token * mask) / ctx.num_tokens`` - normalised by the valid tokens of the
  whole global batch, never again by the microbatch count or the pipeline size.
* BACKWARD m,c: ``scale_loss(loss).backward()`` on the last virtual stage, otherwise
  ``torch.autograd.backward(output, received output gradient)``, inside
  ``ctx.optimizer.microbatch(is_last=<last backward of chunk c>, chunk=c)``. The input's
  ``.grad`` is what SEND_BACKWARD sends. Output, input and gradients of (m, c) are dropped
  as soon as they are sent or used, so a rank holds only the activations the schedule keeps
  in flight.
* Each run of send/recv actions is one ``batch_isend_irecv`` (``p2p.PipelineP2P``), waited
  on before the next compute.

Gradients accumulate in the parameters over all microbatches; the DP reduction, the tied
embedding reduction and grad scaling run once afterwards in ``optimizer.finish_grad_sync``
(called by the trainer). With ``ctx.forward_only`` (evaluation) the forward-only schedule
runs under ``no_grad``.

``order`` holds the actions of the last call in the order they completed and ``peak_in_flight``
the most microbatch outputs it held at once; tests compare both with the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
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
    Action,
    group_steps,
    is_first_stage,
    is_last_stage,
    schedule_for,
)
from tricorn.parallel.pipeline.stages import layout_from_config
from tricorn.parallel.step import StepContext, new_global_batch, set_moe_aux_weight
from tricorn.timers import PIPELINE_P2P_WAIT

Key = tuple[int, int]  # (microbatch, chunk)


@dataclass
class _Run:
    """Tensors of one call, keyed by (microbatch, chunk); each entry lives only as long as the schedule needs it."""

    ctx: StepContext
    microbatches: list[Batch]
    prepared: dict[int, Batch] = field(default_factory=dict)
    inputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # received activations (leaves)
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # stage output, or the loss on the last stage
    to_send: dict[Key, torch.Tensor] = field(default_factory=dict)  # output until SEND_FORWARD (forward-only)
    output_grads: dict[Key, torch.Tensor] = field(default_factory=dict)  # received gradients of the outputs
    input_grads: dict[Key, torch.Tensor] = field(default_factory=dict)  # until SEND_BACKWARD
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
        # Megatron's rule: interleaved whenever there are virtual stages, else the configured one.
        self.kind = schedule or (None if self.vpp > 1 else cfg.parallel.pipeline_schedule)
        self.p2p = PipelineP2P(
            group=state.pp_group,
            pp_rank=self.pp_rank,
            pp=self.pp,
            vpp=self.vpp,
            shape=activation_shape(cfg),
            dtype=wire_dtype(cfg),
            device=state.device,
            global_rank=state.pp_global_rank,
        )
        self.order: list[Action] = []
        self.peak_in_flight = 0  # most (microbatch, chunk) outputs held for a backward during the last call

    def actions(self, num_microbatches: int, forward_only: bool = False) -> list[Action]:
        """This rank's action list for one global batch."""
        return schedule_for(self.pp, self.vpp, num_microbatches, self.kind, forward_only)[self.pp_rank]

    def __call__(self, chunks: list[nn.Module], microbatches: list[Batch], ctx: StepContext) -> torch.Tensor:
        """Forward (and backward) of all microbatches; returns this rank's detached loss sum (0 off the last stage)."""
        if len(chunks) != self.vpp:
            raise ValueError(f"pipeline rank {self.pp_rank} got {len(chunks)} model chunks, the layout has {self.vpp}")
        actions = self.actions(len(microbatches), ctx.forward_only)
        last_backward = {a.chunk: a for a in actions if a.kind is BACKWARD}  # the final one per chunk wins
        run = _Run(ctx, microbatches, total=torch.zeros((), dtype=torch.float32, device=microbatches[0].tokens.device))
        self.order, self.peak_in_flight = [], 0
        new_global_batch(chunks)  # each chunk's first forward (microbatch 0) casts the FP8 weights again
        with torch.set_grad_enabled(not ctx.forward_only):
            for step in group_steps(actions):
                head = step[0]
                if head.kind is FORWARD:
                    self._forward(chunks[head.chunk], head, run)
                elif head.kind is BACKWARD:
                    self._backward(head, run, is_last=last_backward[head.chunk] == head)
                else:
                    self._communicate(step, run)
                self.order.extend(step)
        return run.total

    # ------------------------------------------------------------ compute

    def _forward(self, model: nn.Module, a: Action, run: _Run) -> None:
        key = (a.microbatch, a.chunk)
        mb = run.batch(a.microbatch)
        last = is_last_stage(self.pp_rank, a.chunk, self.pp, self.vpp)
        x = mb.tokens if is_first_stage(self.pp_rank, a.chunk) else run.inputs[key]
        out = model(x, mb.labels if last else None, mb.sample_ids)
        if last:
            out = (out * mb.loss_mask).sum() / run.ctx.num_tokens
            run.total += out.detach().float()
        else:
            run.to_send[key] = out
        if run.ctx.forward_only:
            run.inputs.pop(key, None)
        else:
            run.outputs[key] = out
            self.peak_in_flight = max(self.peak_in_flight, len(run.outputs))

    def _backward(self, a: Action, run: _Run, is_last: bool) -> None:
        key = (a.microbatch, a.chunk)
        out = run.outputs.pop(key)
        set_moe_aux_weight(run.ctx, run.batch(a.microbatch))
        with run.ctx.optimizer.microbatch(is_last=is_last, chunk=a.chunk):
            if is_last_stage(self.pp_rank, a.chunk, self.pp, self.vpp):
                run.ctx.optimizer.scale_loss(out).backward()
            else:
                grad = run.output_grads.pop(key)
                torch.autograd.backward(out, grad.to(out.dtype))
        x = run.inputs.pop(key, None)
        if not is_first_stage(self.pp_rank, a.chunk):
            run.input_grads[key] = x.grad

    # ------------------------------------------------------------ communication

    def _communicate(self, step: tuple[Action, ...], run: _Run) -> None:
        outgoing = {}
        for a in step:
            key = (a.microbatch, a.chunk)
            if a.kind.is_send:
                # The activation is also kept in `outputs` for the backward; the gradient is not needed after sending.
                store = run.input_grads if a.kind is SEND_BACKWARD else run.to_send
                outgoing[a] = store.pop(key)
        with run.ctx.timers(PIPELINE_P2P_WAIT):
            received = self.p2p.exchange(step, outgoing)
        for a, tensor in received.items():
            key = (a.microbatch, a.chunk)
            if a.kind is RECV_FORWARD:
                run.inputs[key] = tensor.requires_grad_(not run.ctx.forward_only)
            elif a.kind is RECV_BACKWARD:
                run.output_grads[key] = tensor
