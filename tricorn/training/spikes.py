"""--check-for-spiky-loss: skip an iteration whose loss or grad norm spikes, on the device, and stop when they pile up.

Megatron's flag of the same name reruns a spiky iteration to tell a hardware fault from the data; tricorn
skips it instead, the way an fp16 overflow is skipped. An iteration is spiky when, after the first
MIN_HISTORY accepted iterations,

    loss > F x running mean of the loss,  or  grad norm > F x running mean of the grad norm,

or at any time when the loss or the grad norm is not finite (F: --spiky-loss-factor; an fp16 overflow is the
loss scaler's skip, not a spike). The running means are exponential moving averages over the accepted
iterations (decay DECAY, about the last 100; bias-corrected), kept as 0-dim device tensors and updated
with torch.where: the decision never reaches the host. It goes to the optimizer as a veto
(Optimizer.step), which skips the step through fused AdamW's found_inf exactly like an overflow: no
parameter, moment or step count changes. The loss the guard sees is the global one (reduced over DP x CP
and PP before the step instead of after it); the grad norm is the global norm before clipping.

At each log line the trainer reads the interval's records with its other values (one host read) and the
guard names every spiky iteration with its loss, grad norm, the running means and the sample indices of its
global batch (in --skip-samples syntax), counts them in TensorBoard ("spiky-iterations"), and raises
SpikeLimit when --max-skipped-iterations of them fell within the last WINDOW iterations: main.py then saves a
checkpoint and exits 1 with one line naming them. The means, their count and the recent spiky iterations
are part of the checkpoint (state_dict), so a resume decides bitwise as the uninterrupted run.

Test hook: TRICORN_TEST_SPIKE_AT_ITER=N multiplies the loss of iteration N by SPIKE_INJECTION before the
guard sees it (and the log reports it). Tests use it; nothing else may.

Collectives: none of its own (the loss all-reduce moves before the step). Memory: a few scalars, and a
3-element record per iteration until the next log line.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from tricorn.checkpoint.io import CheckpointError
from tricorn.config import Config
from tricorn.data.skip_samples import format_samples

MIN_HISTORY = 10  # accepted iterations before loss and grad norm are compared with their means
DECAY = 0.99  # the running means weigh about the last 1 / (1 - DECAY) = 100 accepted iterations
WINDOW = 100  # --max-skipped-iterations counts the spiky iterations of the last WINDOW iterations
SPIKE_AT_ITER = "TRICORN_TEST_SPIKE_AT_ITER"
SPIKE_INJECTION = 1000.0


class SpikeLimit(RuntimeError):
    """Too many spiky iterations: raised alike on every rank at a log line (the flags are global)."""


@dataclass
class Spike:
    iteration: int
    loss: float
    grad_norm: float
    loss_mean: float
    norm_mean: float
    samples: str  # the global batch's sample indices, in --skip-samples syntax


@dataclass
class _Pending:
    iteration: int
    samples: Sequence[int]
    record: torch.Tensor  # [spiky, loss, grad norm, loss mean, norm mean] (float64, device)


@dataclass
class SpikeGuard:
    factor: float
    max_skipped: int
    device: torch.device
    total: int = 0  # spiky iterations of this run
    recent: list[Spike] = field(default_factory=list)  # those of the last WINDOW iterations (checkpointed)
    _pending: list[_Pending] = field(default_factory=list)

    def __post_init__(self) -> None:
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        self.loss_ema, self.norm_ema, self.count = zero.clone(), zero.clone(), zero.clone()
        self._inject_at = int(os.environ.get(SPIKE_AT_ITER, "0"))

    @classmethod
    def from_config(cls, cfg: Config, device: torch.device) -> Optional[SpikeGuard]:
        t = cfg.training
        return cls(t.spiky_loss_factor, t.max_skipped_iterations, device) if t.check_for_spiky_loss else None

    # ------------------------------------------------------------ in the step (device only)

    def observed(self, loss: torch.Tensor, iteration: int) -> torch.Tensor:
        """The global loss as the guard judges it (the test hook's spike applied)."""
        return loss * SPIKE_INJECTION if iteration == self._inject_at else loss

    def veto(self, loss: torch.Tensor, iteration: int, samples: Sequence[int]) -> Callable[..., torch.Tensor]:
        """The optimizer's veto for this iteration: decides, updates the means, keeps the record."""

        def decide(norm: torch.Tensor, overflow: Optional[torch.Tensor]) -> torch.Tensor:
            lossd, normd = loss.detach().double(), norm.detach().double()
            armed = self.count >= MIN_HISTORY
            debias = 1.0 - torch.pow(DECAY, self.count)  # 0 before the first accepted iteration: masked by armed
            loss_mean, norm_mean = self.loss_ema / debias, self.norm_ema / debias
            bad = ~(torch.isfinite(lossd) & torch.isfinite(normd))
            high = armed & ((lossd > self.factor * loss_mean) | (normd > self.factor * norm_mean))
            spike = bad | high
            if overflow is not None:
                spike = spike & ~overflow
                accept = ~(spike | overflow)
            else:
                accept = ~spike
            self.loss_ema = torch.where(accept, DECAY * self.loss_ema + (1 - DECAY) * lossd, self.loss_ema)
            self.norm_ema = torch.where(accept, DECAY * self.norm_ema + (1 - DECAY) * normd, self.norm_ema)
            self.count = torch.where(accept, self.count + 1, self.count)
            record = torch.stack([spike.double(), lossd, normd, loss_mean, norm_mean])
            self._pending.append(_Pending(iteration, samples, record))
            return spike

        return decide

    # ------------------------------------------------------------ at the log line (host)

    def records(self) -> Optional[torch.Tensor]:
        """The unread records, flat, for the trainer's one host read at the log line."""
        return torch.cat([p.record for p in self._pending]) if self._pending else None

    def report(self, values: list[float], iteration: int, console: Callable[[str], None]) -> dict[str, float]:
        """Name the spiky iterations among the read records (their TensorBoard count returned)."""
        pending, self._pending = self._pending, []
        new = self._spikes(pending, values)
        self.total += len(new)
        self.recent = [s for s in self.recent + new if s.iteration > iteration - WINDOW]
        for s in new:
            console(
                f" skipped iteration {s.iteration} (spiky: lm loss {s.loss:.6E}, grad norm {s.grad_norm:.6E}; "
                f"running means {s.loss_mean:.6E} and {s.norm_mean:.6E}, --spiky-loss-factor {self.factor:g}): "
                f"samples {s.samples}"
            )
        return {"spiky-iterations": float(self.total)}

    def check_limit(self, iteration: int) -> None:
        """Raise SpikeLimit when --max-skipped-iterations spiky iterations fell within the last WINDOW."""
        if len(self.recent) >= self.max_skipped:
            named = "; ".join(f"iteration {s.iteration} samples {s.samples}" for s in self.recent)
            raise SpikeLimit(
                f"{len(self.recent)} spiky iterations within the last {WINDOW} (--max-skipped-iterations {self.max_skipped}), "
                f"stopping after iteration {iteration}: {named}; add those samples to a --skip-samples file "
                "and resume (from an earlier checkpoint with --ckpt-step to retrain without them)"
            )

    def _spikes(self, pending: list[_Pending], values: list[float]) -> list[Spike]:
        out = []
        for i, p in enumerate(pending):
            flag, loss, norm, loss_mean, norm_mean = values[5 * i : 5 * i + 5]
            if flag:
                out.append(Spike(p.iteration, loss, norm, loss_mean, norm_mean, format_samples(p.samples)))
        return out

    # ------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Host values (a save reads the device anyway); unread records are resolved, not consumed (the log names them)."""
        unread = self._spikes(self._pending, self.records().tolist()) if self._pending else []
        loss_ema, norm_ema, count = torch.stack([self.loss_ema, self.norm_ema, self.count]).tolist()
        recent = [[s.iteration, s.loss, s.grad_norm, s.loss_mean, s.norm_mean, s.samples] for s in self.recent + unread]
        return {"loss_ema": loss_ema, "norm_ema": norm_ema, "count": count, "recent": recent}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """From a checkpoint's meta.json; CheckpointError (one line) when the record is damaged."""
        try:
            values = [float(state[k]) for k in ("loss_ema", "norm_ema", "count")]
            recent = [Spike(int(r[0]), *map(float, r[1:5]), str(r[5])) for r in state.get("recent", [])]
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise CheckpointError(
                f"checkpoint damaged: its meta.json spiky_loss record is unreadable ({type(e).__name__}: {e}); "
                "pick another iteration with --ckpt-step"
            ) from None
        self.loss_ema, self.norm_ema, self.count = (torch.full((), v, dtype=torch.float64, device=self.device) for v in values)
        self.recent = recent
