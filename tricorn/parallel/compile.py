"""--torch-compile: every transformer layer's forward compiled on its own (regional compilation, as torchtitan).

What is compiled. ``TransformerBlock.forward`` of each layer of each model chunk this rank holds (each
pipeline chunk's layers, each virtual stage), through ``torch.compile`` with the inductor backend, and on
the last stage one more region: ``GPTModel.head``, the final norm and the output head. The embedding and the
loss stay eager. The loss could trace (the vocab-parallel all-reduces too), but inductor's partitioner then
keeps the logits upcast to fp32 for backward instead of the bf16 logits the chunked cross entropy keeps:
measured with the probe, +129 KB over 167 KB at bf16, 128 tokens and V 512, which at V 128k is gigabytes.
Compiled, the head region keeps exactly what eager keeps (probe, fp32 and bf16). Only the forward method is replaced,
on the instance: parameter names, the layer ModuleDict, checkpoints and every module hook (ZeRO-3's gather,
the activation probe, recompute's groups) stay as in eager mode and run eagerly around the compiled region.
All layers share one code object, and the parameters are graph inputs, so every layer of one shape runs the
graph the first layer compiled: a chunk compiles once, not once per layer.

Collectives. Dynamo rewrites the c10d calls inside tricorn's TP / SP / CP autograd Functions
(``dist.all_reduce``, ``all_gather_single``, gloo's ``all_to_all_single`` reduce-scatter) into functional
collectives, forward and backward, so they trace into the layer's graphs: no graph break at TP, TP + SP or
CP (measured: one graph per layer). Two Functions take a traced form under ``torch.compiler.is_compiling()``
(tricorn/parallel/tensor.py): the row-parallel all-reduce returns a clone instead of marking its input dirty
(dynamo traces no mark_dirty of an input it does not return), and the SP linear's backward issues its
all-gather and reduce-scatter synchronously (dynamo traces no async work objects; the compiled graph orders
functional collectives itself). Eager mode is unchanged. The MoE routed MLP runs eagerly
(``torch.compiler.disable``): routing has data-dependent shapes and, under EP, all_to_alls whose splits come
from the host; it is the one graph break of an MoE layer, whose attention and norms are compiled.

Recompute. Full: torch.utils.checkpoint (eager) around the compiled layer. Selective core_attn / mlp:
the checkpoint is traced inside the graph (dynamo's activation-checkpoint region), so the partitioner
recomputes exactly that region in backward. Selective norm / mlp_act free a tensor's storage in place
between two modules (recompute.py), which no compiled graph can honour: refused.

Saved bytes. Inductor's partitioner decides what the compiled layer keeps for backward. Measured (probe,
tests/test_compile.py): everything eager keeps, except (1) the cos / sin rows RoPE's backward reads - the
compiled backward gathers them again from the position ids (int64, s per chunk, kept once by the chunk's
first layer) and the fp32 tables (a buffer) - and (2) under SP the column-parallel linears keep their
all-gathered input rather than its shard: traced, the backward's all-gather is the forward's, merged.
planning/activations.py counts both (``compiled``).

Compile once. Shapes are static (``dynamic=False``); the only new graphs after the first iteration come from
a mode the first iteration did not run (evaluation, under no_grad). ``CompileStats`` counts the graphs and
the seconds spent compiling (dynamo's and the lazily compiled backward's); the trainer logs
"compiled N regions in S s" once, after iteration 1, and warns if a training iteration compiled again.
The inductor cache lives in TORCHINDUCTOR_CACHE_DIR (node-local in the sbatch scripts).

No collectives of its own; memory effect: the compiled layer keeps 2esd fewer bytes (the RoPE rows) and,
under SP, e*sbh(1 - 1/t) more per column-parallel linear (QKV, w1).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

UNSUPPORTED_RECOMPUTE = ("norm", "mlp_act")


def validate_compile(cfg: Any) -> list[str]:
    """Every problem with --torch-compile in a Config, one sentence each (before launch)."""
    m = cfg.model
    if not m.torch_compile:
        return []
    errs: list[str] = []
    if m.transformer_impl == "transformer_engine":
        errs.append("--torch-compile compiles tricorn's own layers; drop it with --transformer-impl transformer_engine")
    if m.recompute_granularity == "selective":
        bad = [name for name in UNSUPPORTED_RECOMPUTE if name in (m.recompute_modules or ())]
        if bad:
            errs.append(
                f"--torch-compile cannot honour --recompute-modules {' '.join(bad)} (they free storage between two modules"
                " inside the compiled layer); use core_attn and/or mlp, or --recompute-granularity full"
            )
    if m.hidden_dropout > 0 or m.attention_dropout > 0:
        errs.append(
            "--torch-compile needs --hidden-dropout 0 and --attention-dropout 0 (the layout-independent dropout masks are"
            " keyed by each microbatch's sample ids, which would compile a graph per microbatch)"
        )
    return errs


# ---------------------------------------------------------------- statistics


@dataclass
class CompileStats:
    """Graphs compiled and seconds spent compiling in this process (dynamo traces and lazy backward compiles)."""

    regions: int = 0  # compiled layer forwards
    graphs: int = 0  # graphs handed to inductor (forward graphs; a graph break starts a new one)
    training_graphs: int = 0  # of those, traced with autograd recording (training iterations)
    seconds: float = 0.0
    reported_training_graphs: Optional[int] = None  # training_graphs when "compiled N regions" was logged
    _started: Optional[float] = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def start(self, _args: Any = None) -> None:
        with self._lock:
            self._started = time.perf_counter()

    def end(self, _args: Any = None) -> None:
        with self._lock:
            if self._started is not None:
                self.seconds += time.perf_counter() - self._started
                self._started = None

    @property
    def graph_breaks(self) -> int:
        """Graph breaks dynamo met while tracing (each reason once per trace)."""
        from torch._dynamo.utils import counters

        return sum(counters["graph_break"].values())

    def summary(self) -> str:
        return (
            f"compiled {self.regions} regions in {self.seconds:.1f} s "
            f"({self.graphs} graphs, {self.graph_breaks} graph breaks; torch.compile, inductor)"
        )


STATS = CompileStats()
_callbacks_installed = False


def _install_callbacks() -> None:
    """Time every compilation (dynamo's and the backward compiled at the first backward) through dynamo's hooks."""
    global _callbacks_installed
    if _callbacks_installed:
        return
    from torch._dynamo import callback_handler

    callback_handler.register_start_callback(STATS.start)
    callback_handler.register_end_callback(STATS.end)
    _callbacks_installed = True


def _counting_backend() -> Callable[..., Any]:
    from torch._dynamo import lookup_backend

    inductor = lookup_backend("inductor")

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        STATS.graphs += 1
        STATS.training_graphs += int(torch.is_grad_enabled())
        return inductor(gm, example_inputs)

    return backend


# ---------------------------------------------------------------- applying


def _blocks(chunk: nn.Module) -> list[nn.Module]:
    return list(chunk.layers.values()) if hasattr(chunk, "layers") else []


def apply_compile(chunks: Sequence[nn.Module], enabled: bool) -> CompileStats:
    """Compile each transformer layer's forward of every chunk in place (before apply_recompute); the stats."""
    if not enabled:
        return STATS
    _install_callbacks()
    backend = _counting_backend()
    for chunk in chunks:
        for block in _blocks(chunk):
            if getattr(block, "_tricorn_compiled", False):
                raise RuntimeError("apply_compile was already applied to this layer")
            mlp = block.mlp
            if hasattr(mlp, "router"):  # a mixture of experts: routing is data-dependent (module docstring)
                mlp.forward = torch.compiler.disable(mlp.forward, recursive=True)
            block.forward = torch.compile(block.forward, backend=backend, dynamic=False)
            block._tricorn_compiled = True
            STATS.regions += 1
        if getattr(chunk, "post_process", False):  # the last stage's final norm and head: one more region
            chunk.head = torch.compile(chunk.head, backend=backend, dynamic=False)
            STATS.regions += 1
    return STATS


def report_after_first_iteration(console: Callable[[str], None]) -> None:
    """Log "compiled N regions in S s" once (rank 0's console), after the first training iteration."""
    if STATS.regions == 0 or STATS.reported_training_graphs is not None:
        return
    STATS.reported_training_graphs = STATS.training_graphs
    console(STATS.summary())


def recompiled_in_training() -> int:
    """Training graphs compiled after the first iteration's report (0 when compile happens once per shape)."""
    if STATS.reported_training_graphs is None:
        return 0
    return STATS.training_graphs - STATS.reported_training_graphs


__all__ = [
    "STATS",
    "CompileStats",
    "apply_compile",
    "recompiled_in_training",
    "report_after_first_iteration",
    "validate_compile",
]
