"""The optimizer the trainer drives: gradient sync, norm, clipping, AdamW step.

This is the plain data-parallel version: fp32 parameters, one coalesced
all-reduce (sum) of all gradients over the DP x CP group after the last
microbatch, torch's AdamW (foreach). Memory: params + grads + 2 fp32 moments.

Contract with the trainer (kept by every optimizer variant):
    zero_grad(); microbatch(is_last) context around each backward; scale_loss(loss);
    finish_grad_sync(); step() -> StepInfo; set_lr(lr); state_dict()/load_state_dict().
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from tricorn.config import Config
from tricorn.parallel.grads import (
    _all_reduce_coalesced,
    clip_grads,
    global_grad_norm,
    reduce_sequence_parallel_grads,
    reduce_tied_embedding_grads,
)
from tricorn.parallel.state import ParallelState


@dataclass
class StepInfo:
    grad_norm: float
    skipped: bool = False
    loss_scale: float = 1.0


def param_groups(modules: list[nn.Module], weight_decay: float) -> list[dict]:
    """No weight decay on biases and norm weights (every 1-D parameter), as in Megatron."""
    decay, no_decay = [], []
    for m in modules:
        for p in m.parameters():
            if p.requires_grad:
                (no_decay if p.ndim == 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class Optimizer:
    def __init__(self, cfg: Config, state: ParallelState, modules: list[nn.Module]):
        self.cfg = cfg
        self.state = state
        self.modules = modules
        self.params = [p for m in modules for p in m.parameters() if p.requires_grad]
        t = cfg.training
        self.adam = torch.optim.AdamW(
            param_groups(modules, t.weight_decay), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, foreach=True
        )

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @contextlib.contextmanager
    def microbatch(self, is_last: bool) -> Iterator[None]:
        yield

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def finish_grad_sync(self) -> None:
        # Loss is normalised by the global token count, so DP replicas' gradients add up (sum, not mean).
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        _all_reduce_coalesced([p.grad for p in self.params], self.state.dp_cp_group)
        reduce_sequence_parallel_grads(self.modules, self.state)
        tied = not self.cfg.model.untie_embeddings_and_output_weights
        reduce_tied_embedding_grads(self.modules, self.state, tied)

    def step(self) -> StepInfo:
        norm = global_grad_norm(self.params, self.state)
        clip_grads(self.params, self.cfg.training.clip_grad, norm)
        self.adam.step()
        return StepInfo(grad_norm=norm)

    def set_lr(self, lr: float) -> None:
        for group in self.adam.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict:
        return self.adam.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.adam.load_state_dict(state)
