"""The memory frontier of one 70B layout: `tricorn estimate` under each memory feature, alone and together.

One layout - llama3-70b on 16 H100s as TP 8 x PP 2, sequence parallel, seq 8192, micro batch 1, global batch
512, bf16 - estimated with today's defaults, with each memory feature alone, step by step down to the leanest
(``WALK``: every step keeps the ones before it), and with all of them. bench/memory_frontier.py prints the table,
docs/memory.md walks it category by category, and tests/test_memory_frontier.py checks the page against it.
No collectives, no device work.
"""

from __future__ import annotations

from dataclasses import dataclass

from tricorn.planning.estimate import config_for_estimate, estimate_record
from tricorn.planning.hardware import get_gpu

LAYOUT = (
    "--model-preset llama3-70b --bf16 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 --sequence-parallel "
    "--seq-length 8192 --micro-batch-size 1 --global-batch-size 512"
).split()
WORLD_SIZE = 16
GPU = "h100-80gb"
MARGIN = 0.10  # tricorn plan's default --memory-margin
KEYS = (
    "params_bytes",
    "grads_bytes",
    "master_params_bytes",
    "optimizer_state_bytes",
    "activation_bytes",
    "embedding_logits_bytes",
    "buffer_bytes",
    "fp8_bytes",
    "overhead_bytes",
)
PRECISION_AWARE = ["--use-precision-aware-optimizer"]
# (name, flags): the features, each alone against the defaults.
FEATURES: tuple[tuple[str, list[str]], ...] = (
    ("bf16 moments", [*PRECISION_AWARE, "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]),
    ("bf16 main grads", [*PRECISION_AWARE, "--main-grads-dtype", "bf16"]),
    ("FP8 + FP8 primary weights", ["--fp8-format", "e4m3", "--use-distributed-optimizer", "--fp8-param-gather"]),
    ("activation offload, 40 layers", ["--cpu-offloading-num-layers", "40"]),
    ("optimizer offload", ["--optimizer-cpu-offload"]),
)
# The walk from the defaults to the leanest: each step adds its flags to all the steps before it.
WALK: tuple[tuple[str, list[str]], ...] = (
    ("defaults", []),
    ("bf16 moments", FEATURES[0][1]),
    ("bf16 main grads", ["--main-grads-dtype", "bf16"]),
    ("optimizer offload", ["--optimizer-cpu-offload"]),
    ("activation offload, 40 layers", ["--cpu-offloading-num-layers", "40"]),
    ("FP8 primary weights", FEATURES[2][1]),
)


@dataclass(frozen=True)
class Row:
    name: str
    flags: list[str]
    bytes: dict  # KEYS -> bytes on the worst rank
    total: float
    host: float

    @property
    def fits(self) -> bool:
        return self.total <= get_gpu(GPU).memory_bytes * (1 - MARGIN)


def row(name: str, flags: list[str]) -> Row:
    """The estimate of the layout with ``flags``."""
    rec = estimate_record(config_for_estimate(LAYOUT + flags, WORLD_SIZE))
    return Row(name, flags, {k: rec[k] for k in KEYS}, rec["total_bytes"], rec["host_bytes"])


def alone() -> list[Row]:
    """The defaults, each feature alone, then all of them together."""
    together = PRECISION_AWARE + [f for _, flags in FEATURES for f in flags if f not in PRECISION_AWARE]
    return [row("defaults", []), *(row(n, f) for n, f in FEATURES), row("all together", together)]


def walk() -> list[Row]:
    """The cumulative walk (``WALK``)."""
    flags: list[str] = []
    rows = []
    for name, more in WALK:
        flags = flags + [f for f in more if not (f == PRECISION_AWARE[0] and f in flags)]
        rows.append(row(name, flags))
    return rows


def markdown(rows: list[Row]) -> str:
    """The walk as docs/memory.md shows it (tests/test_memory_frontier.py holds the page to this text)."""
    gib = 1024**3
    head = (
        "| step | adds | parameters | gradients | master | optimizer state | activations | logits, buffers, CUDA | "
        "total | host |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    previous: list[str] = []
    for r in rows:
        added = " ".join(r.flags[len(previous) :]) or "-"
        previous = r.flags
        b = r.bytes
        rest = b["embedding_logits_bytes"] + b["buffer_bytes"] + b["fp8_bytes"] + b["overhead_bytes"]
        cells = [b[k] / gib for k in ("params_bytes", "grads_bytes", "master_params_bytes", "optimizer_state_bytes")]
        cells += [b["activation_bytes"] / gib, rest / gib, r.total / gib, r.host / gib]
        lines.append(f"| {r.name} | `{added}` | " + " | ".join(f"{x:.2f}" for x in cells) + " |")
    return "\n".join(lines)
