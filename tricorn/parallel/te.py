"""Transformer Engine backend (`--transformer-impl transformer_engine`, GPU only) and its FP8 recipes.

Every column- and row-parallel linear of the decoder is a `transformer_engine.pytorch.Linear` built the way
TE 2.x expects: `parallel_mode="column" | "row"`, `tp_group` and `sequence_parallel`, so TE itself runs the
TP/SP communication of the linear (as Megatron's TELinear does). Which side saves what:

    column  forward: TE all-gathers the sequence shard under SP (in FP8 when the input is quantized, half
            the bytes of bf16), else the input is the TP fan-out; backward: TE all-gathers the input again
            and reduce-scatters (SP) or all-reduces the input gradient. TE saves the LOCAL input - the
            sequence shard under SP, quantized to FP8 under --fp8-format - as tricorn's own layer does.
    row     forward: TE reduce-scatters (SP) or all-reduces the partial output, then adds the bias once;
            backward: all-gathers the output gradient under SP. It saves its input shard (FP8 under FP8).

Parameter names and shapes stay tricorn's: TE's Linear registers `weight` [out/TP, in] (column) or
[out, in/TP] (row) and `bias` directly on itself, the names the local layers use, so a checkpoint moves
freely between `local` and `transformer_engine` (TE's `_extra_state`, the FP8 scaling state, is not a
parameter and is not saved: a resumed delayed-scaling run rebuilds its amax history). tricorn's own
marks (shard info for checkpoints, `sequence_parallel` on the row bias for the TP gradient all-reduce) are
set on TE's parameters here. The modules are built on meta and left hollow like the local ones, so ZeRO-3
with TE materialises only the owned shard.

FP8 (`--fp8-format e4m3|hybrid --fp8-recipe delayed|tensorwise|mxfp8`): every chunk's forward runs under
`te.autocast(recipe=...)` (`te.fp8_autocast` on TE 2.8, before autocast existed), with DelayedScaling,
Float8CurrentScaling or MXFP8BlockScaling (Blackwell only). The microbatch loop tells TE which forward is a
global batch's first (`new_global_batch`), so the FP8 copy of each weight (and its transpose) is cast once
per global batch and cached; under ZeRO-3 nothing is cached (`is_first_microbatch=None`: the weight is cast
every microbatch), since a cache of every layer's weights is what ZeRO-3 exists not to hold.

The amax reduction group is TP x DP x CP, every rank of one pipeline stage, as Megatron's
get_amax_reduction_group(with_context_parallel=True) and TE recommend: with sequence parallelism each TP rank
sees a different sequence shard, so TP peers must agree on the scaling factors of the weights they share a
GEMM with; DP/CP peers see other data.

FP8 with recompute stays refused: tricorn's recompute replays the forward with torch.utils.checkpoint,
outside the autocast, and delayed scaling would also record the replay's amaxes a second time; TE's own
FP8-aware checkpoint (te.distributed.checkpoint) is not what tricorn's recompute plan calls.

Imported only when asked for: Transformer Engine does not import without a GPU. Collectives: TE's TP/SP
ones per linear (above) and the FP8 amax all-reduce per forward (delayed scaling). Memory: FP8 weight caches,
scales and amax histories held by TE (tricorn/planning/fp8_terms.py counts them).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from importlib import metadata
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from tricorn.config import Config
from tricorn.model.spec import LayerSpec
from tricorn.parallel.state import flatten
from tricorn.parallel.tensor import _mark

# The tested range, the `te` extra's pin in pyproject.toml: the signature test (tests/test_te_signatures.py)
# parses both ends' sources.
TE_MIN, TE_BELOW = (2, 8), (2, 21)
TE_PIN = f"transformer-engine[pytorch]>={TE_MIN[0]}.{TE_MIN[1]},<{TE_BELOW[0]}.{TE_BELOW[1]}"
# Errors about the node rather than the config carry this phrase: `tricorn estimate` plans on a login node.
ON_THIS_NODE = "on this node"
AMAX_HISTORY_LEN = 1024  # DelayedScaling's amax history (TE's default); planning/fp8_terms.py counts it
RECIPES = {"delayed": "DelayedScaling", "tensorwise": "Float8CurrentScaling", "mxfp8": "MXFP8BlockScaling"}


class TransformerEngineUnavailable(RuntimeError):
    pass


# ---------------------------------------------------------------- checks before launch


def te_version_error(version: Optional[str]) -> Optional[str]:
    """One line when the installed TE `version` (None: not installed) is outside the tested range."""
    if version is None:
        return (
            f"--transformer-impl transformer_engine: Transformer Engine is not installed {ON_THIS_NODE}; pip install '{TE_PIN}'"
        )
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or not TE_MIN <= (int(found[1]), int(found[2])) < TE_BELOW:
        return (
            f"--transformer-impl transformer_engine: Transformer Engine {version} is installed {ON_THIS_NODE}, outside "
            f"the tested range {TE_PIN.split(']')[1]}; pip install '{TE_PIN}'"
        )
    return None


def installed_te_version() -> Optional[str]:
    """The version pip recorded for TE (its python wheel `transformer_engine`), without importing it."""
    for name in ("transformer_engine", "transformer-engine"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def mxfp8_error(capability: Optional[tuple[int, int]]) -> Optional[str]:
    """--fp8-recipe mxfp8 on a GPU of compute `capability` (None: none visible, nothing to check here)."""
    if capability is None or (10, 0) <= tuple(capability) < (12, 0):  # TE's own rule: Blackwell data-centre parts
        return None
    return (
        f"--fp8-recipe mxfp8 needs a Blackwell GPU (compute capability 10.x); the GPU {ON_THIS_NODE} is "
        f"{capability[0]}.{capability[1]}: use --fp8-recipe delayed or tensorwise"
    )


def fp8_shape_error(cfg: Config) -> Optional[str]:
    """TE's FP8 GEMM takes a [rows, cols] operand only with rows divisible by 8 and cols by 16 (its
    assert_dim_for_fp8_exec, on each linear's input and weight): one line naming the sizes that are not."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    q, kv = m.num_attention_heads * m.head_dim, m.kv_heads * m.head_dim
    up = m.ffn_size * (2 if m.swiglu else 1)
    tokens = cfg.training.micro_batch_size * m.seq_length // cfg.parallel.context_parallel_size
    sp = cfg.parallel.sequence_parallel and tp > 1
    rows = {"QKV's output features / TP": (q + 2 * kv) // tp, "w1's output features / TP": up // tp}
    rows["tokens per microbatch (micro batch x seq / CP" + (" / TP under SP)" if sp else ")")] = tokens // (tp if sp else 1)
    cols = {"--hidden-size": m.hidden_size, "attention width / TP": q // tp, "--ffn-hidden-size / TP": m.ffn_size // tp}
    bad = [f"{k} = {v}" for k, v in rows.items() if v % 8] + [f"{k} = {v}" for k, v in cols.items() if v % 16]
    if not bad:
        return None
    return (
        "--fp8-format with Transformer Engine needs each linear's rows divisible by 8 and columns by 16 (TE's FP8 GEMM); "
        f"not so: {', '.join(bad)}"
    )


def validate_te(cfg: Config) -> list[str]:
    """The TE backend's and TE FP8's checks, one sentence each (called by tricorn.validation)."""
    m, t = cfg.model, cfg.training
    if m.transformer_impl != "transformer_engine":
        return []
    errs = []
    if cfg.device != "cuda":
        errs.append("--transformer-impl transformer_engine needs --device cuda (Transformer Engine has no CPU path)")
    if t.fp8_recipe == "rowwise":
        errs.append(
            "--fp8-recipe rowwise is the native FP8 path's (--transformer-impl local); with Transformer Engine use "
            "delayed, tensorwise or mxfp8"
        )
    if t.fp8_format and m.recompute_granularity:
        errs.append(
            "--fp8-format with --recompute-granularity is not supported with --transformer-impl transformer_engine: "
            "the recomputed forward would run outside TE's FP8 autocast and differ from the forward it replays; "
            "drop one of them"
        )
    if t.fp8_format:
        errs += [e for e in [fp8_shape_error(cfg)] if e]
    if cfg.device == "cuda":
        version_error = te_version_error(installed_te_version())
        if version_error:
            errs.append(version_error)
        else:
            try:
                import_te()
            except TransformerEngineUnavailable as e:
                errs.append(str(e))
        if t.fp8_recipe == "mxfp8" and torch.cuda.is_available():
            errs += [e for e in [mxfp8_error(torch.cuda.get_device_capability(0))] if e]
    return errs


def import_te() -> Any:
    try:
        import transformer_engine.pytorch as te  # noqa: PLC0415 - lazy on purpose
    except Exception as e:  # ImportError, or TE's own error without a GPU/driver
        raise TransformerEngineUnavailable(
            f"--transformer-impl transformer_engine needs Transformer Engine {ON_THIS_NODE} (pip install '{TE_PIN}'); "
            f"importing it failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    return te


# ---------------------------------------------------------------- the linears


def te_linear_kwargs(mode: str, group: dist.ProcessGroup, sequence_parallel: bool, bias: bool, device: Any) -> dict:
    """Keywords of `te.pytorch.Linear(in, out, **kwargs)` (the signature test checks each against TE's source)."""
    return dict(
        bias=bias,
        parallel_mode=mode,
        tp_group=group,
        tp_size=dist.get_world_size(group),
        sequence_parallel=sequence_parallel,
        device=device,
    )


@functools.cache
def _linear_class(te_linear: type) -> type:
    """`te_linear` (TE's Linear) with tricorn's parameter marks and the microbatch loop's is_first_microbatch."""

    class TELinear(te_linear):
        def __init__(
            self,
            in_features: int,
            out_features: int,
            bias: bool = True,
            *,
            mode,
            group,
            sequence_parallel,
            cache_fp8_weights,
            device,
        ):
            # Built under torch.device("meta") (a hollow build): TE's deferred initialisation, nothing allocated.
            device = "meta" if torch.empty(()).is_meta else device
            super().__init__(in_features, out_features, **te_linear_kwargs(mode, group, sequence_parallel, bias, device))
            full, dim = (out_features, 0) if mode == "column" else (in_features, 1)
            _mark(self.weight, dim, group, full)
            if bias and mode == "column":
                _mark(self.bias, 0, group, out_features)
            elif bias and sequence_parallel:  # added after the reduce-scatter: a partial gradient per TP rank
                self.bias.sequence_parallel = True
            # None: no FP8 weight cache (ZeRO-3); True: the next forward starts a global batch.
            self.first_microbatch: Optional[bool] = True if cache_fp8_weights else None

        def new_global_batch(self) -> None:
            if self.first_microbatch is not None:
                self.first_microbatch = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x, is_first_microbatch=self.first_microbatch)
            if self.first_microbatch:
                self.first_microbatch = False  # later microbatches reuse the FP8 weight cast by this one
            return out

    return TELinear


def te_spec(spec: LayerSpec, cfg: Config, tp_group: dist.ProcessGroup, device: torch.device) -> LayerSpec:
    """`spec` with TE's Linear as the column/row linears (embedding, head and attention core unchanged)."""
    te = import_te()
    sp = cfg.parallel.sequence_parallel and dist.get_world_size(tp_group) > 1
    linear = functools.partial(
        _linear_class(te.Linear),
        group=tp_group,
        sequence_parallel=sp,
        cache_fp8_weights=cfg.parallel.zero_stage_in_effect < 3,
        device=device,
    )
    return dataclasses.replace(
        spec, column_linear=functools.partial(linear, mode="column"), row_linear=functools.partial(linear, mode="row")
    )


# ---------------------------------------------------------------- FP8


AMAX_DIMS = ("dp", "cp", "tp")  # mesh dimensions of the amax reduction group (not pp: stages have own layers)


def amax_reduction_group(mesh) -> dist.ProcessGroup:
    """TP x DP x CP of this rank's pipeline stage (see the module docstring). A collective: all ranks call it."""
    return flatten(mesh, AMAX_DIMS)


def fp8_recipe_name(cfg: Config) -> str:
    return cfg.training.fp8_recipe or "delayed"  # Megatron's and TE's default recipe


def make_recipe(recipes: Any, cfg: Config) -> Any:
    """The TE recipe object of --fp8-recipe / --fp8-format, from `recipes` (transformer_engine.common.recipe)."""
    name = fp8_recipe_name(cfg)
    fmt = recipes.Format.E4M3 if cfg.training.fp8_format == "e4m3" else recipes.Format.HYBRID
    kwargs: dict[str, Any] = dict(fp8_format=fmt)
    if name == "delayed":
        kwargs.update(amax_history_len=AMAX_HISTORY_LEN, amax_compute_algo="max")
    return getattr(recipes, RECIPES[name])(**kwargs)


def fp8_autocast(te: Any, recipe: Any, group: dist.ProcessGroup):
    """TE's autocast context: `te.autocast` (TE >= 2.9), else the older `te.fp8_autocast` (TE 2.8)."""
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe, amax_reduction_group=group)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=group)


def enable_fp8(chunks: list[nn.Module], cfg: Config, amax_group: dist.ProcessGroup) -> None:
    """Run every chunk's forward under TE's FP8 autocast (the backward follows the autocast of its forward)."""
    te = import_te()
    from transformer_engine.common import recipe as recipes  # noqa: PLC0415

    recipe = make_recipe(recipes, cfg)
    for chunk in chunks:
        inner = chunk.forward

        def forward(*args, _inner=inner, **kwargs):
            with fp8_autocast(te, recipe, amax_group):
                return _inner(*args, **kwargs)

        chunk.forward = forward  # an instance attribute: parameter names stay unprefixed
