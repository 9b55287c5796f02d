"""The Transformer Engine backend's wiring, on CPU with a stand-in for TE's Linear.

TE itself does not import without a GPU, so this checks what tricorn adds around it: the TE spec keeps
parameter names and values identical to the local layers (checkpoints move between backends), routes every
column/row GEMM through TE's module with our weights, and --fp8-format runs each forward under fp8_autocast.
The real kernels are exercised only on a GPU node.
"""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tricorn.config import config_from_args
from tricorn.model import GPTModel
from tricorn.parallel.tensor import tensor_parallel_spec
from tricorn.validation import validate

FLAGS = "--device cpu --mock-data --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --vocab-size 100 --swiglu".split()


class _StandInLinear(nn.Module):
    """TE's Linear with skip_weight_param_allocation: the caller passes weight and bias each call."""

    calls = 0

    def __init__(self, in_features, out_features, bias=True, skip_weight_param_allocation=False, device=None):
        super().__init__()
        assert skip_weight_param_allocation, "tricorn must keep its own weights"

    def forward(self, x, weight=None, bias=None):
        _StandInLinear.calls += 1
        return F.linear(x, weight, bias)


@pytest.fixture
def fake_te(monkeypatch, tmp_path):
    autocasts = []

    @contextlib.contextmanager
    def fp8_autocast(enabled, fp8_recipe, fp8_group):
        autocasts.append(fp8_recipe)
        yield

    te = types.ModuleType("transformer_engine")
    te_pt = types.ModuleType("transformer_engine.pytorch")
    te_pt.Linear, te_pt.fp8_autocast = _StandInLinear, fp8_autocast
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format = types.SimpleNamespace(E4M3="E4M3", HYBRID="HYBRID")
    recipe.DelayedScaling = lambda **kw: kw
    te.pytorch, te.common, common.recipe = te_pt, common, recipe
    for name, mod in [
        ("transformer_engine", te),
        ("transformer_engine.pytorch", te_pt),
        ("transformer_engine.common", common),
        ("transformer_engine.common.recipe", recipe),
    ]:
        monkeypatch.setitem(sys.modules, name, mod)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    yield autocasts
    dist.destroy_process_group()


def test_te_spec_keeps_names_values_and_outputs(fake_te):
    from tricorn.parallel.te import enable_fp8, te_spec

    cfg = config_from_args(FLAGS + ["--bf16", "--fp8-format", "hybrid"], world_size=1)
    group = dist.group.WORLD
    local = GPTModel(cfg.model, tensor_parallel_spec(cfg, group))
    te_model = GPTModel(
        cfg.model,
        te_spec(tensor_parallel_spec(cfg, group), cfg, group, torch.device("cpu")),
    )
    local.init_weights(7)
    te_model.init_weights(7)
    assert [n for n, _ in local.named_parameters()] == [n for n, _ in te_model.named_parameters()]
    for (_, a), (_, b) in zip(local.named_parameters(), te_model.named_parameters()):
        assert torch.equal(a, b)
    tokens = torch.randint(0, 100, (2, 16))
    _StandInLinear.calls = 0
    enable_fp8([te_model], cfg, group)
    out = te_model(tokens, tokens)
    assert _StandInLinear.calls == 2 * 4  # qkv, out proj, w1, w2 per layer go through TE
    assert len(fake_te) == 1 and fake_te[0]["fp8_format"] == "HYBRID"
    # Bitwise: the stand-in TE linear calls the same F.linear on the same weights in the same order.
    torch.testing.assert_close(out, local(tokens, tokens), rtol=0, atol=0)


def test_transformer_engine_is_refused_on_cpu_with_one_line():
    errs = validate(config_from_args(FLAGS + ["--transformer-impl", "transformer_engine"], world_size=1))
    assert any("needs --device cuda" in e for e in errs), errs


def test_fp8_with_recompute_is_refused_with_one_line():
    cfg = config_from_args(FLAGS + ["--bf16", "--fp8-format", "hybrid", "--recompute-granularity", "full"], world_size=1)
    errs = [e for e in validate(cfg) if "recompute" in e]
    assert len(errs) == 1 and "--fp8-format with --recompute-granularity is not supported" in errs[0], errs


@pytest.mark.parametrize(
    "flags, expected",
    [(["--tensor-model-parallel-size", "2", "--sequence-parallel"], [0, 1]), (["--pipeline-model-parallel-size", "2"], [0])],
)
def test_amax_reduction_group_is_tp_dp_cp_of_one_stage(flags, expected):
    """TE's recommendation for sequence-parallel layers: TP peers reduce amax together; pipeline stages do not."""
    from pathlib import Path

    from harness import run_script

    out = run_script(Path(__file__).parent / "workers" / "amax_group.py", 2, flags)
    assert out.strip().splitlines()[-1] == str(expected)
