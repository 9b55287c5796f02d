"""Loss scaling for fp16 training (Megatron's ConstantGradScaler / DynamicGradScaler).

fp16 gradients underflow unless the loss is multiplied by a large factor before
backward; the optimizer divides the gradients by the same factor before it uses
them. The dynamic scaler starts at --initial-loss-scale and

- halves the scale when an overflow (inf/nan in any gradient on any rank) has
  been seen --hysteresis times since the last growth, never below --min-loss-scale;
- doubles it after --loss-scale-window consecutive iterations without overflow
  (and then re-arms the hysteresis).

Every overflowing iteration is skipped by the optimizer (parameters and state
untouched), whether or not the scale backs off. --loss-scale gives a static
scale instead. bf16 and fp32 need no scaler unless --loss-scale is given.

The dynamic scaler keeps its scale and counters as 0-dim device tensors and updates them with
torch.where, so the skip decision never reaches the host (read once per log line). No
collectives here (the optimizer agrees on overflow with one all-reduce); memory: three scalars.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from tricorn.config import Config


@dataclass
class ConstantLossScaler:
    scale: float

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


@dataclass
class DynamicLossScaler:
    """State lives in 0-dim tensors on ``device`` and `update` is branch-free (torch.where): the
    trainer never reads the overflow flag on the host. Plain bools are accepted too (tests)."""

    scale: Union[float, torch.Tensor]
    min_scale: float = 1.0
    growth_interval: int = 1000
    hysteresis: int = 2
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self) -> None:
        self.scale = torch.tensor(float(self.scale), dtype=torch.float32, device=self.device)
        self.growth_tracker = torch.zeros(
            (), dtype=torch.int64, device=self.device
        )  # iterations since the last overflow (or growth)
        self.hysteresis_tracker = torch.full(
            (), self.hysteresis, dtype=torch.int64, device=self.device
        )  # overflows left before back-off

    def update(self, found_inf: Union[bool, torch.Tensor]) -> None:
        found = torch.as_tensor(found_inf, device=self.device).bool()
        # Overflow: restart the growth window, spend one hysteresis, halve when none is left.
        hyst_inf = self.hysteresis_tracker - 1
        scale_inf = torch.where(hyst_inf <= 0, (self.scale * self.backoff_factor).clamp(min=self.min_scale), self.scale)
        # No overflow: count; at the window's end double the scale and re-arm the hysteresis.
        growth = self.growth_tracker + 1
        grow = growth == self.growth_interval
        scale_ok = torch.where(grow, self.scale * self.growth_factor, self.scale)
        self.scale = torch.where(found, scale_inf, scale_ok)
        self.hysteresis_tracker = torch.where(found, hyst_inf, torch.where(grow, self.hysteresis, self.hysteresis_tracker))
        self.growth_tracker = torch.where(found | grow, 0, growth)

    def state_dict(self) -> dict:
        return {
            "scale": float(self.scale),
            "growth_tracker": int(self.growth_tracker),
            "hysteresis_tracker": int(self.hysteresis_tracker),
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = torch.tensor(float(state["scale"]), dtype=torch.float32, device=self.device)
        self.growth_tracker = torch.tensor(int(state["growth_tracker"]), device=self.device)
        self.hysteresis_tracker = torch.tensor(int(state["hysteresis_tracker"]), device=self.device)


LossScaler = Union[ConstantLossScaler, DynamicLossScaler]


def build_loss_scaler(cfg: Config, device: Optional[torch.device] = None) -> Optional[LossScaler]:
    """Dynamic scaling for fp16, a static scale wherever --loss-scale is given, otherwise none."""
    t = cfg.training
    if t.loss_scale:
        return ConstantLossScaler(float(t.loss_scale))
    if t.fp16:
        return DynamicLossScaler(
            float(t.initial_loss_scale),
            float(t.min_loss_scale),
            int(t.loss_scale_window),
            int(t.hysteresis),
            device=device or torch.device("cpu"),
        )
    return None
