"""A CPU stand-in for the parts of Transformer Engine 2.x that tricorn calls, with TE's own signatures.

TE does not import without CUDA, so the CPU tests install this module as `transformer_engine`. Its
signatures are a subset of TE's real ones - tests/test_te_signatures.py parses the pinned TE's sources and
checks every parameter here (name, kind and default) and every keyword tricorn passes (recorded in CALLS)
against them, so the stand-in cannot drift into our own idea of TE.

Its semantics are TE's for what tricorn relies on (read in TE 2.8/2.20's module/linear.py): `Linear` holds
`weight` [out/TP, in] (parallel_mode "column") or [out, in/TP] ("row") and `bias`; a column linear under
sequence parallelism all-gathers its input and saves the local shard (tricorn's _GatherLinear does exactly
that), otherwise its input gradient is all-reduced over TP; a row linear reduce-scatters (SP) or all-reduces
its output and then adds the bias. FP8 itself is not modelled: the GEMMs run in the input's dtype.
"""

from __future__ import annotations

import contextlib
import enum
import sys
import types
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from tricorn.parallel.tensor import _GatherLinear, copy_to_tp, reduce_from_tp, reduce_scatter_to_sequence

CALLS: dict[str, list] = defaultdict(list)  # what tricorn passed: name -> [(args, kwargs)]


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        tp_group=None,
        tp_size: int = 1,
        bias: bool = True,
        parallel_mode: Optional[str] = None,
        device: Union[torch.device, str] = "cuda",
    ) -> None:
        super().__init__()
        CALLS["Linear.__init__"].append(
            (
                (in_features, out_features),
                dict(
                    sequence_parallel=sequence_parallel,
                    tp_group=tp_group,
                    tp_size=tp_size,
                    bias=bias,
                    parallel_mode=parallel_mode,
                    device=device,
                ),
            )
        )
        tp = torch.distributed.get_world_size(tp_group) if tp_group is not None else tp_size
        assert parallel_mode in (None, "column", "row"), parallel_mode
        self.parallel_mode, self.tp_group, self.tp_size = parallel_mode, tp_group, tp
        self.sequence_parallel = tp > 1 and sequence_parallel
        rows = out_features // tp if parallel_mode == "column" else out_features
        cols = in_features // tp if parallel_mode == "row" else in_features
        self.weight = nn.Parameter(torch.empty(rows, cols, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(rows, device=device))
        else:
            self.bias = torch.Tensor().to(device=device)  # TE keeps an empty tensor, not a parameter
        self.use_bias = bias

    def forward(
        self,
        inp: torch.Tensor,
        is_first_microbatch: Optional[bool] = None,
        fp8_output: Optional[bool] = False,
        fp8_grad: Optional[bool] = False,
    ) -> torch.Tensor:
        CALLS["Linear.forward"].append(((inp,), dict(is_first_microbatch=is_first_microbatch)))
        bias = self.bias if self.use_bias else None
        if self.parallel_mode == "row":
            out = F.linear(inp, self.weight)
            group = self.tp_group
            out = reduce_scatter_to_sequence(out, group) if self.sequence_parallel else reduce_from_tp(out, group)
            return out if bias is None else out + bias
        if self.parallel_mode == "column" and self.sequence_parallel:
            return _GatherLinear.apply(inp, self.weight, bias, self.tp_group)
        if self.parallel_mode == "column":
            inp = copy_to_tp(inp, self.tp_group)
        return F.linear(inp, self.weight, bias)


# ---------------------------------------------------------------- transformer_engine.common.recipe


class Format(enum.Enum):
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


@dataclass
class DelayedScaling:
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable] = "max"

    def __post_init__(self) -> None:
        CALLS["DelayedScaling"].append(
            (
                (),
                dict(
                    fp8_format=self.fp8_format, amax_history_len=self.amax_history_len, amax_compute_algo=self.amax_compute_algo
                ),
            )
        )


@dataclass
class Float8CurrentScaling:
    fp8_format: Format = Format.HYBRID

    def __post_init__(self) -> None:
        CALLS["Float8CurrentScaling"].append(((), dict(fp8_format=self.fp8_format)))


@dataclass
class MXFP8BlockScaling:
    margin: int = 0
    fp8_format: Format = Format.E4M3

    def __post_init__(self) -> None:
        CALLS["MXFP8BlockScaling"].append(((), dict(fp8_format=self.fp8_format)))


# ---------------------------------------------------------------- autocast (TE >= 2.9) and fp8_autocast (2.8)


class autocast:  # noqa: N801 - TE's name
    def __init__(
        self, enabled: bool = True, calibrating: bool = False, recipe=None, amax_reduction_group=None, _graph: bool = False
    ) -> None:
        CALLS["autocast"].append(((), dict(enabled=enabled, recipe=recipe, amax_reduction_group=amax_reduction_group)))

    def __enter__(self) -> autocast:
        return self

    def __exit__(self, *exc) -> None:
        return None


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe=None, fp8_group=None, _graph: bool = False):
    CALLS["fp8_autocast"].append(((), dict(enabled=enabled, fp8_recipe=fp8_recipe, fp8_group=fp8_group)))
    yield


def install(monkeypatch, old_autocast: bool = False) -> dict[str, list]:
    """Put the stand-in into sys.modules (as TE 2.8 with only fp8_autocast when `old_autocast`); returns CALLS."""
    CALLS.clear()
    te = types.ModuleType("transformer_engine")
    te_pt = types.ModuleType("transformer_engine.pytorch")
    te_pt.Linear, te_pt.fp8_autocast = Linear, fp8_autocast
    if not old_autocast:
        te_pt.autocast = autocast
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format, recipe.DelayedScaling = Format, DelayedScaling
    recipe.Float8CurrentScaling, recipe.MXFP8BlockScaling = Float8CurrentScaling, MXFP8BlockScaling
    te.pytorch, te.common, common.recipe = te_pt, common, recipe
    modules = {
        "transformer_engine": te,
        "transformer_engine.pytorch": te_pt,
        "transformer_engine.common": common,
        "transformer_engine.common.recipe": recipe,
    }
    for name, mod in modules.items():
        if monkeypatch is None:
            sys.modules[name] = mod
        else:
            monkeypatch.setitem(sys.modules, name, mod)
    return CALLS
