"""What a run reports: console line, TensorBoard scalars (Megatron's tag names), JSON lines.

Only rank 0 writes; the values it writes are already reduced over the grid by
the trainer. TensorBoard is imported lazily so that runs without
--tensorboard-dir do not pay for it. No collectives; no device memory.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Optional

from tricorn.config import Config


class MetricsLogger:
    def __init__(self, cfg: Config, rank: int):
        self.cfg = cfg
        self.enabled = rank == 0
        self.writer: Optional[Any] = None
        self.metrics_file = None
        if not self.enabled:
            return
        if cfg.logging.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=cfg.logging.tensorboard_dir)
        if cfg.logging.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.logging.metrics_file)), exist_ok=True)
            self.metrics_file = open(cfg.logging.metrics_file, "a")

    def scalars(self, iteration: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, iteration)

    def record(self, iteration: int, values: dict[str, Any]) -> None:
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps({"iteration": iteration, **values}) + "\n")
            self.metrics_file.flush()

    def console(self, line: str) -> None:
        if self.enabled:
            print(line, flush=True)

    def text(self, tag: str, text: str) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        if self.metrics_file is not None:
            self.metrics_file.close()


def warn(message: str) -> None:
    """Warnings from any rank reach stderr (rank-tagged by the launcher)."""
    print(f"tricorn: warning: {message}", file=sys.stderr, flush=True)
