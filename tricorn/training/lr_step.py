"""Stepping the lr schedule from the training loop with no host read (DESIGN principle 10).

Megatron steps its scheduler after a successful optimizer step only (not after an fp16-skipped one), and
reads the step's `update_successful` on the host every iteration to know. tricorn decides a skip on the device
(fused AdamW's found_inf) and reads it once per log line, so:

- **Runs whose steps cannot be skipped** (no loss scaler, no --check-for-spiky-loss: bf16 and fp32 runs) step
  the schedule on the host by each iteration's global batch size; the lr and weight decay are Python floats,
  Megatron's to the bit.
- **Runs whose steps can be skipped** (fp16, --loss-scale, --check-for-spiky-loss) hand fused AdamW the lr as a
  0-dim device tensor, picked on the device from values the host computed. The host knows the schedule's count
  as of the last read of the skip flags (`settle`: each log line, each save) and the global batch sizes run
  since; the device adds up the samples of the skipped steps among them. For every sum those skips could make
  the host computes Megatron's lr (Python floats, as above) and copies the table to the device (pinned,
  non-blocking); the step's lr is the entry whose sum equals the device's (a torch.where, exact: one entry
  matches, the others add zeros). With a constant global batch the table holds one entry per iteration since
  the last log line. A non-constant weight decay would need the same on the device, which fused AdamW's float
  `weight_decay` cannot take: lr_schedule.schedule_errors refuses that combination. On CUDA the tensor lr is
  float32 (torch's CUDA kernel reads a tensor lr as float), the rounding Transformer Engine's and Apex's FusedAdam
  give every lr; on the CPU it is float64 and the kernel steps bit for bit as with the float.

Collectives: none. Memory: two 0-dim tensors and the table (two float64 rows of at most MAX_CANDIDATES).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from tricorn import pinned
from tricorn.lr_schedule import LRSchedule
from tricorn.training.logging import warn

MAX_CANDIDATES = 1024  # beyond this many possible skip sums the driver reads the skips (and says so once)
Lr = Union[float, torch.Tensor]


class ScheduleDriver:
    def __init__(self, schedule: LRSchedule, device: torch.device, skippable: bool):
        self.schedule = schedule  # its count is exact as of the last settle
        self.device = device
        self.skippable = skippable
        self._ran = 0  # samples of the iterations since the last settle
        self._sums = [0]  # every sum of skipped samples those iterations can have made (host)
        self._skipped = torch.zeros((), dtype=torch.float64, device=device) if skippable else None
        self._warned = False

    # ------------------------------------------------------------ the training loop

    def for_step(self) -> tuple[Lr, float]:
        """(lr, weight decay) of the next optimizer step; the weight decay is a float (constant when skippable)."""
        wd = self.schedule.weight_decay()
        if not self.skippable:
            return self.schedule.lr(), wd
        if len(self._sums) > MAX_CANDIDATES:
            self._settle_now()
        base = self.schedule.num_steps + self._ran
        with pinned.host_side():  # built on the host by design, then copied over without making the host wait
            table = torch.tensor([self._sums, [self.schedule.lr(base - s) for s in self._sums]], dtype=torch.float64)
        table = pinned.pin(table).to(self.device, non_blocking=True)
        lr = torch.where(table[0] == self._skipped, table[1], 0.0).sum()
        return (lr.to(torch.float32) if self.device.type == "cuda" else lr), wd  # CUDA's kernel reads a float tensor

    def after_step(self, global_batch_size: int, skipped: Union[bool, torch.Tensor]) -> None:
        """After an optimizer step of `global_batch_size` samples; `skipped` stays on the device."""
        if not self.skippable:  # no loss scaler and no spike guard: every step is taken
            self.schedule.step(global_batch_size)
            return
        if isinstance(skipped, torch.Tensor):
            self._skipped += skipped.to(torch.float64) * global_batch_size
        elif skipped:  # a host decision (none of tricorn's today): the same count
            self._skipped += float(global_batch_size)
        self._ran += global_batch_size
        self._sums = sorted(set(self._sums) | {s + global_batch_size for s in self._sums})

    def pending(self) -> Optional[torch.Tensor]:
        """The device's skipped samples since the last settle, for the log line's one host read (None: nothing to read)."""
        return self._skipped.reshape(1) if self.skippable and self._ran else None

    def settle(self, skipped_samples: float) -> None:
        """The host has read the skipped samples (`pending`): the schedule's count is exact again."""
        self.schedule.step(self._ran - int(skipped_samples))
        self._ran, self._sums = 0, [0]
        self._skipped.zero_()

    def _settle_now(self) -> None:
        if not self._warned:
            self._warned = True
            warn(
                f"the lr schedule read the skipped steps before a log line: more than {MAX_CANDIDATES} possible "
                "counts since the last one (a smaller --log-interval avoids the host read)"
            )
        self.settle(self._skipped.item())

    # ------------------------------------------------------------ checkpoints and logs (they read the device anyway)

    def exact(self) -> LRSchedule:
        """The schedule with every step's skip accounted for (reads the device once if anything is pending)."""
        if self.skippable and self._ran:
            self.settle(self._skipped.item())
        return self.schedule

    def current_lr(self) -> float:
        """The lr of the next step: what Megatron logs after an iteration, and a checkpoint records."""
        return self.exact().lr()
