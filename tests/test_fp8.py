"""Native FP8 (tricorn/parallel/fp8.py): the three FP8 GEMMs of a linear, the layouts, the bad inputs.

- Layer level (this process): forward, dgrad and wgrad of the FP8 linear against a float64 reference built
  from the same quantised values, for e4m3/hybrid x tensorwise/rowwise; the quantiser and its scales exactly.
- Layer level on TP=2 with SP (tests/workers/fp8_layer.py): every rank's outputs and gradients against one
  process's FP8 of the whole tensors, with shards whose magnitudes differ so that per-shard scales would show.
- Whole model: every layout equals the single-process FP8 run over 5 iterations; recompute bitwise.
- FP8 against bf16 on the same tokens (the 50-iteration demo-corpus figure is bench/fp8.py's).
- Bad inputs: one line each, before launch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from badinput import assert_refused
from fp8_reference import assert_gemm, dequantized
from harness import BASE_FLAGS, assert_close, reference, run_layout, run_script, with_flag
from torch._subclasses.fake_tensor import FakeTensorMode

from tricorn.config_args import config_from_args
from tricorn.parallel.fp8 import DTYPES, FP8Recipe, quantize, scale_for, scaled_mm
from tricorn.planning.memory import estimate_config

E4M3, E5M2 = DTYPES["e4m3"], DTYPES["e5m2"]


def _recipe(fmt: str, rowwise: bool) -> FP8Recipe:
    """One process: no group splits anything, so no amax is reduced."""
    return FP8Recipe.from_config(fmt, "rowwise" if rowwise else "tensorwise", None, None, None)


def _operands(seed: int = 0):
    """x [tokens, in], W [out, in], g [tokens, out] in bf16, with rows and columns of very different size
    so that rowwise scales differ from tensorwise ones (and from each other)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(48, 64, generator=gen) * torch.logspace(-3, 1, 48).unsqueeze(1)
    w = torch.randn(32, 64, generator=gen) * 0.02 * torch.logspace(-1, 1, 64)
    g = torch.randn(48, 32, generator=gen) * torch.logspace(-6, -2, 32)
    return x.bfloat16(), w.bfloat16(), g.bfloat16()


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_three_gemms_against_the_same_quantised_values(fmt, rowwise):
    x, w, g = _operands()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = _recipe(fmt, rowwise).linear(xr, wr, None)
    y.backward(g)
    gdt = E5M2 if fmt == "hybrid" else E4M3
    if rowwise:  # each GEMM's operands scaled along its contraction (fp8.py's docstring)
        fwd = (dequantized(x, 1, E4M3), dequantized(w, 1, E4M3).t())
        dgrad = (dequantized(g, 1, gdt), dequantized(w, 0, E4M3))
        wgrad = (dequantized(g, 0, gdt).t(), dequantized(x, 0, E4M3))
    else:  # one scale per tensor, the forward's x and W reused by the backward
        xq, wq, gq = dequantized(x, None, E4M3), dequantized(w, None, E4M3), dequantized(g, None, gdt)
        fwd, dgrad, wgrad = (xq, wq.t()), (gq, wq), (gq.t(), xq)
    assert_gemm(y, *fwd, "forward")
    assert_gemm(xr.grad, *dgrad, "dgrad")
    assert_gemm(wr.grad, *wgrad, "wgrad")
    if rowwise:  # the recipe is not tensorwise in disguise: these operands quantise differently per row
        assert not torch.equal(fwd[0], dequantized(x, None, E4M3))


@pytest.mark.parametrize("first", [E4M3, E5M2])
def test_the_cpu_gemm_is_scaled_mms_product_and_fake_tensors_keep_scaled_mm(first):
    """On real CPU tensors scaled_mm is dequantised_mm (torch's CPU `_scaled_mm` takes a scalar loop for an e4m3
    first operand on some CPUs, ~1000x slower): the same float64-bounded product as `_scaled_mm`'s (assert_gemm's
    bound, both ways), with rowwise scales too. Under fake tensors (`tricorn simulate`) it is `_scaled_mm` itself,
    so the measured peak holds no fp32 operand copies that the GPU would not make."""
    x, w, _ = _operands(2)
    # rowwise (per row along the contraction), the case with the most scales; tensorwise is a single one of them
    a_scale, b_scale = (
        scale_for(x.float().abs().amax(1, keepdim=True), first),
        scale_for(w.float().abs().amax(1, keepdim=True), E4M3),
    )
    a, b = quantize(x, a_scale, first), quantize(w, b_scale, E4M3).t()  # b column-major, as CUDA's layout needs
    a_inv, b_inv = 1 / a_scale, (1 / b_scale).reshape(1, -1)
    reference = (a.double() * a_inv.double(), b.double() * b_inv.double())
    assert_gemm(scaled_mm(a, a_inv, b, b_inv), *reference, "dequantised_mm")
    assert_gemm(torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=torch.bfloat16), *reference, "_scaled_mm")

    class Calls(torch.overrides.TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with Calls() as real:
        scaled_mm(a, a_inv, b, b_inv)
    assert "mm" in real.names and "_scaled_mm" not in real.names, real.names
    with FakeTensorMode() as mode, Calls() as calls:
        fake = [mode.from_tensor(t) for t in (a, a_inv, b, b_inv)]
        out = scaled_mm(*fake)
    assert out.dtype == torch.bfloat16 and out.shape == (a.shape[0], b.shape[1])
    assert "_scaled_mm" in calls.names and "mm" not in calls.names, calls.names


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantiser_is_one_rounding_with_the_largest_power_of_two_scale(dtype):
    x, _, _ = _operands(1)
    amax = x.float().abs().amax()
    s = scale_for(amax, dtype)
    top = torch.finfo(dtype).max
    # A power of two, the largest that keeps amax within the format (so FP8's range is used, never exceeded).
    assert float(torch.log2(s)) == int(torch.log2(s)) and float(amax * s) <= top < float(2 * amax * s)
    q = quantize(x, s, dtype)
    # x * s is exact (a power of two), so the cast is the only rounding: the same as rounding the float64 value.
    assert torch.equal(q.view(torch.uint8), (x.double() * float(s)).to(dtype).view(torch.uint8))
    assert scale_for(torch.tensor(0.0), dtype).isfinite()  # an all-zero tensor quantises to zeros, no NaN


def test_tensor_parallel_layer_equals_one_process():
    """TP=2 with SP, both recipes, and rowwise's CP reduction: every rank against one process's FP8
    (tests/workers/fp8_layer.py)."""
    run_script(Path(__file__).parent / "workers" / "fp8_layer.py", 2)


# ---------------------------------------------------------------- whole model

FLAGS = BASE_FLAGS + ["--bf16", "--fp8-format", "e4m3"]
ROWWISE = with_flag(FLAGS, "--fp8-format", "hybrid") + ["--fp8-recipe", "rowwise"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
DIST = ["--use-distributed-optimizer"]
# Why these bounds. FP8 scales are layout-independent (an amax is a max, exact in any order, reduced over the
# ranks that split the tensor), so every layout quantises the same values as one process as long as its bf16
# inputs are the same. They are not, exactly: TP sums bf16 partial outputs of the row-parallel GEMMs (one
# more bf16 rounding, 2^-8), CP and PP sum gradients in another order, and a bf16 element one ulp away moves
# its FP8 value by a whole FP8 step (2^-3 relative) when it sits on a rounding boundary. Measured on this
# CPU over 5 iterations: loss within 2.1e-4 relative (rowwise TP2+SP), grad norm within 6.7e-3. The bounds
# are 2-3x that. What they catch: scales taken per shard instead of over TP (measured on TP2+SP: loss off
# by 1.0e-3 at iteration 2, 1.5e-3 at 4 and 5; grad norm 1.8e-2 at iteration 1). The layer test above is
# the sharp check of the scales; this one checks that the trainer wires them through every layout.
LOSS_RTOL = 5e-4
GRAD_NORM_RTOL = 1.5e-2
# FP8 changes the linears only: documents and a window (their masked attention, per-sample RoPE positions) ride
# on the CP layout, whose ring plans its blocks by global positions (tricorn/model/masking.py).
DOCUMENTS = ["--reset-position-ids", "--reset-attention-mask", "--window-size", "8"]
LAYOUTS = {
    "tp2_sp_cp2_documents": (
        FLAGS + DOCUMENTS,
        4,
        ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2"],
    ),
    # --tensorboard-dir: memory_report.json, whose probed activations the estimator must predict (below)
    "pp2_dp2_distopt": (FLAGS, 4, ["--pipeline-model-parallel-size", "2", "--tensorboard-dir", "tb"] + DIST),
    "zero3_dp2_recompute": (FLAGS, 2, DIST + ["--zero-stage", "3"] + RECOMPUTE),
    # rowwise at TP2+SP; its CP reduction (the weight gradient's per-feature maxima over tokens) is checked at
    # layer level (tests/workers/fp8_layer.py). Two ranks keep the file within its time budget.
    "rowwise_tp2_sp": (ROWWISE, 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_single_process_fp8(tmp_path, layout):
    flags, nproc, extra = LAYOUTS[layout]
    ref = reference(flags, tmp_path / "ref")
    run = run_layout(flags + extra, nproc, tmp_path / "run")
    assert_close(run.losses, ref.losses, LOSS_RTOL, "lm loss")
    assert_close(run.grad_norms, ref.grad_norms, GRAD_NORM_RTOL, "grad norm")
    if "--tensorboard-dir" in extra:
        _assert_estimated_activations(flags + extra, nproc, tmp_path / "run" / "tb" / "memory_report.json")


def _assert_estimated_activations(flags: list[str], nproc: int, report: Path) -> None:
    """The estimator counts what the FP8 linears keep (an FP8 copy of each input and two scales, not the bf16
    input): every rank's probed bytes per layer and outside the layers equal the estimate, to the byte."""
    cfg = config_from_args(flags, world_size=nproc)
    entries = json.loads(report.read_text())
    assert len(entries) == nproc
    for entry in entries:
        est = estimate_config(cfg, stage=entry["pp_rank"])
        for key in ("activation_bytes_per_layer", "activation_bytes_other"):
            # Byte counts of saved tensors against the formula: no rounding anywhere, so exact.
            assert entry[key] == getattr(est, key), (entry["rank"], key, entry[key], getattr(est, key))


def test_recompute_replays_the_forward_bitwise(tmp_path):
    """Dynamic scaling keeps no state: the recomputed forward quantises exactly as the forward did."""
    ref = reference(ROWWISE, tmp_path / "ref")
    run = run_layout(ROWWISE + RECOMPUTE, 1, tmp_path / "run")
    # Bitwise: the same ops in the same order (docs/testing.md).
    assert_close(run.losses, ref.losses, 0.0, "lm loss")
    assert_close(run.grad_norms, ref.grad_norms, 0.0, "grad norm")


def test_fp8_trains_like_bf16(tmp_path):
    """The same 5 iterations in bf16 and in FP8 (bench/fp8.py runs 50 on the demo corpus)."""
    fp8 = reference(FLAGS, tmp_path / "fp8")
    bf16 = run_layout(BASE_FLAGS + ["--bf16"], 1, tmp_path / "bf16")
    # FP8 rounds each GEMM operand to 4 significant bits (at most 2^-4 relative, random in sign across the
    # 64-256-term dot products); measured here the loss moves by ~1e-4 relative (1.4e-4 at iteration 1). 5e-3 is 25x that,
    # and well below what a broken GEMM does (a wrong scale or a transposed operand: the loss no longer falls
    # from ln(500) = 6.2, or is off by more than 1e-2 from the first iteration).
    assert_close(fp8.losses, bf16.losses, 5e-3, "FP8 against bf16 lm loss")
    assert fp8.losses[-1] < fp8.losses[0]


# ---------------------------------------------------------------- bad inputs

BAD = [
    (
        ["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "delayed"],
        "--fp8-recipe delayed needs --transformer-impl transformer_engine",
    ),
    (["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"], "with --transformer-impl local use tensorwise or rowwise"),
    (["--fp8-format", "e4m3"], "--fp8-format needs --bf16"),
    (["--fp16", "--fp8-format", "e4m3"], "needs --bf16, not --fp16"),
    (["--bf16", "--fp8-format", "e4m3", "--num-experts", "2"], "does not run MoE experts"),
    (["--bf16", "--fp8-format", "e4m3", "--torch-compile"], "drop --torch-compile"),
    (["--bf16", "--fp8-format", "e4m3", "--ffn-hidden-size", "200"], "MLP input width per TP rank (--ffn-hidden-size / TP) 200"),
    (
        ["--bf16", "--fp8-format", "e4m3", "--hidden-size", "72", "--num-attention-heads", "4"],
        "not: --hidden-size 72, query/key/value projection width per TP rank 216",
    ),
    (["--bf16", "--fp8-format", "e4m3", "--seq-length", "36", "--micro-batch-size", "1", "--global-batch-size", "2"], "tokens"),
]


def _argv(extra: list[str]) -> list[str]:
    """BASE_FLAGS with `extra`'s flags set (replaced where the base has them)."""
    argv, i = list(BASE_FLAGS), 0
    while i < len(extra):
        if i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            argv, i = with_flag(argv, extra[i], extra[i + 1]), i + 2
        else:
            argv, i = argv + [extra[i]], i + 1
    return argv


@pytest.mark.parametrize("extra,needle", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_fp8_input_is_one_line(tmp_path, extra, needle):
    assert_refused(_argv(extra), tmp_path, needle=needle)


def test_estimate_prints_the_fp8_terms():
    """`tricorn estimate` names what native FP8 keeps per layer, against bf16 (the formula checked above)."""
    from tricorn.planning.estimate import format_report

    fp8 = [line for line in format_report(config_from_args(FLAGS, world_size=1)).splitlines() if "FP8" in line]
    assert len(fp8) == 1 and "FP8 (native, tensorwise)" in fp8[0], fp8
    assert not [line for line in format_report(config_from_args(ROWWISE, world_size=1)).splitlines() if "FP8" in line]
