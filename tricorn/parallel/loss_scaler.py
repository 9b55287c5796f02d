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

No collectives here (the optimizer agrees on overflow with one all-reduce);
no memory beyond a few Python numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

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
    scale: float
    min_scale: float = 1.0
    growth_interval: int = 1000
    hysteresis: int = 2
    growth_factor: float = 2.0
    backoff_factor: float = 0.5

    def __post_init__(self) -> None:
        self.growth_tracker = 0  # iterations since the last overflow (or growth)
        self.hysteresis_tracker = self.hysteresis  # overflows left before the next back-off

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker, "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


LossScaler = Union[ConstantLossScaler, DynamicLossScaler]


def build_loss_scaler(cfg: Config) -> Optional[LossScaler]:
    """Dynamic scaling for fp16, a static scale wherever --loss-scale is given, otherwise none."""
    t = cfg.training
    if t.loss_scale:
        return ConstantLossScaler(float(t.loss_scale))
    if t.fp16:
        return DynamicLossScaler(
            float(t.initial_loss_scale), float(t.min_loss_scale), int(t.loss_scale_window), int(t.hysteresis)
        )
    return None
