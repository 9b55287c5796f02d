"""Transformer Engine backend (`--transformer-impl transformer_engine`, GPU only) and FP8.

TE supplies the local GEMMs of the tensor-parallel linears; tricorn keeps its own
TP/SP collectives (tensor.py), parameter names and layouts, so a checkpoint moves
freely between `local` and `transformer_engine` and every layout keeps working.
`--fp8-format e4m3|hybrid` runs each model chunk's forward under TE's fp8_autocast
with delayed scaling (the backward follows the autocast of its forward).

Imported only when asked for: Transformer Engine does not import without a GPU.
No collectives of its own beyond TE's FP8 amax reduction; memory: FP8 weight/activation
copies and amax histories held by TE.

The amax reduction group (fp8_group) is TP x DP x CP, every rank of one pipeline stage, as
Megatron's get_amax_reduction_group(with_context_parallel=True) and TE recommend: with
sequence parallelism each TP rank sees a different sequence shard, so TP peers must agree
on the scaling factors of the weights they share a GEMM with; DP/CP peers see other data.
FP8 with recompute is refused at validation: the recomputed forward would run outside
fp8_autocast and so compute different activations from the forward it replays.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tricorn.config import Config
from tricorn.model.spec import LayerSpec
from tricorn.parallel.state import flatten
from tricorn.parallel.tensor import ColumnParallelLinear, RowParallelLinear, reduce_from_tp, reduce_scatter_to_sequence


class TransformerEngineUnavailable(RuntimeError):
    pass


def import_te() -> Any:
    try:
        import transformer_engine.pytorch as te  # noqa: PLC0415 - lazy on purpose
    except Exception as e:  # ImportError, or TE's own error without a GPU/driver
        raise TransformerEngineUnavailable(
            f"--transformer-impl transformer_engine needs Transformer Engine on a GPU node "
            f"(pip install -e '.[te]'); importing it failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    return te


def _gemm(te: Any, in_features: int, out_features: int, bias: bool, device: torch.device) -> nn.Module:
    # Weights stay ours (skip allocation) so names/shapes match the local implementation.
    return te.Linear(in_features, out_features, bias=bias, skip_weight_param_allocation=True, device=device)


class TEColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group, sequence_parallel: bool, device):
        super().__init__(in_features, out_features, bias, group=group, sequence_parallel=sequence_parallel)
        self.gemm = _gemm(import_te(), in_features, self.weight.shape[0], bias, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(self._enter(x), weight=self.weight, bias=self.bias)


class TERowParallelLinear(RowParallelLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group, sequence_parallel: bool, device):
        super().__init__(in_features, out_features, bias, group=group, sequence_parallel=sequence_parallel)
        self.gemm = _gemm(import_te(), self.weight.shape[1], out_features, False, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.gemm(x, weight=self.weight, bias=None)
        out = reduce_scatter_to_sequence(out, self.group) if self.sequence_parallel else reduce_from_tp(out, self.group)
        return out if self.bias is None else out + self.bias


def te_spec(spec: LayerSpec, cfg: Config, tp_group: dist.ProcessGroup, device: torch.device) -> LayerSpec:
    """`spec` with TE GEMMs in the column/row linears (embedding, head and attention core unchanged)."""
    import_te()
    sp = cfg.parallel.sequence_parallel and dist.get_world_size(tp_group) > 1
    return dataclasses.replace(
        spec,
        column_linear=functools.partial(TEColumnParallelLinear, group=tp_group, sequence_parallel=sp, device=device),
        row_linear=functools.partial(TERowParallelLinear, group=tp_group, sequence_parallel=sp, device=device),
    )


AMAX_DIMS = ("dp", "cp", "tp")  # mesh dimensions of the amax reduction group (not pp: stages have own layers)


def amax_reduction_group(mesh) -> dist.ProcessGroup:
    """TP x DP x CP of this rank's pipeline stage (see the module docstring). A collective: all ranks call it."""
    return flatten(mesh, AMAX_DIMS)


def enable_fp8(chunks: list[nn.Module], cfg: Config, amax_group: dist.ProcessGroup) -> None:
    """Run every chunk's forward under fp8_autocast (delayed scaling, amax reduced over `amax_group`)."""
    te = import_te()
    from transformer_engine.common.recipe import DelayedScaling, Format  # noqa: PLC0415

    fmt = Format.E4M3 if cfg.training.fp8_format == "e4m3" else Format.HYBRID
    recipe = DelayedScaling(fp8_format=fmt, amax_history_len=1024, amax_compute_algo="max")
    for chunk in chunks:
        inner = chunk.forward

        def forward(*args, _inner=inner, **kwargs):
            with te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=amax_group):
                return _inner(*args, **kwargs)

        chunk.forward = forward  # an instance attribute: parameter names stay unprefixed
