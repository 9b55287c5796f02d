"""The Transformer Engine backend's wiring, on CPU with the TE stand-in (tests/te_standin.py).

TE itself does not import without a GPU. The stand-in has TE 2.x's signatures - tests/test_te_signatures.py
checks it, and every keyword tricorn passes, against the pinned TE's parsed sources - and TE's semantics for
what tricorn relies on. Checked here: the TE spec keeps parameter names, shapes, shard marks and values of
the local layers (checkpoints move between backends); the trainer with TE equals the local one on TP2+SP,
PP2 and ZeRO-3; TE's Linear is built hollow (on meta); the microbatch loop passes is_first_microbatch (True
on a global batch's first forward of each module, False after; None under ZeRO-3, which caches nothing); the
recipes and the autocast entry point; the pre-launch refusals. The real kernels run only on a GPU node
(scripts/gpu_check.py check b).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import te_standin
import torch
import torch.distributed as dist

from tricorn.config_args import config_from_args
from tricorn.model import GPTModel
from tricorn.model.init import SHARD_ATTR
from tricorn.parallel.tensor import tensor_parallel_spec
from tricorn.validation import validate

FLAGS = "--device cpu --mock-data --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --vocab-size 100 --swiglu".split()


@pytest.fixture
def world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("old_autocast", [False, True], ids=["autocast", "fp8_autocast"])
def test_te_spec_keeps_names_shapes_values_and_outputs(monkeypatch, world, old_autocast):
    from tricorn.parallel.te import enable_fp8, te_spec

    calls = te_standin.install(monkeypatch, old_autocast=old_autocast)
    cfg = config_from_args(FLAGS + ["--bf16", "--fp8-format", "hybrid"], world_size=1)
    local = GPTModel(cfg.model, tensor_parallel_spec(cfg, world))
    te_model = GPTModel(cfg.model, te_spec(tensor_parallel_spec(cfg, world), cfg, world, torch.device("cpu")))
    local.init_weights(7)
    te_model.init_weights(7)
    ours, theirs = dict(local.named_parameters()), dict(te_model.named_parameters())
    assert list(ours) == list(theirs)
    for name, p in ours.items():
        assert torch.equal(p, theirs[name]), name
        assert getattr(p, SHARD_ATTR, None) == getattr(theirs[name], SHARD_ATTR, None), name
    linears = [m for m in te_model.modules() if isinstance(m, te_standin.Linear)]
    assert len(linears) == 2 * 4  # qkv, out proj, w1, w2 per layer are TE's Linear
    assert [kw["parallel_mode"] for _, kw in calls["Linear.__init__"]] == ["column", "row"] * 4
    enable_fp8([te_model], cfg, world)
    tokens = torch.randint(0, 100, (16, 2))
    first, second = te_model(tokens, tokens), te_model(tokens, tokens)
    # Bitwise: the stand-in runs the same F.linear on the same weights in the same order.
    torch.testing.assert_close(first, local(tokens, tokens), rtol=0, atol=0)
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    assert [kw["is_first_microbatch"] for _, kw in calls["Linear.forward"]] == [True] * 8 + [False] * 8
    entry = "fp8_autocast" if old_autocast else "autocast"
    assert len(calls[entry]) == 2 and not calls["autocast" if old_autocast else "fp8_autocast"]
    recipe = calls[entry][0][1]["fp8_recipe" if old_autocast else "recipe"]
    assert isinstance(recipe, te_standin.DelayedScaling) and recipe.fp8_format is te_standin.Format.HYBRID


@pytest.mark.parametrize(
    "recipe, cls, fmt",
    [
        ("delayed", "DelayedScaling", "E4M3"),
        ("tensorwise", "Float8CurrentScaling", "E4M3"),
        ("mxfp8", "MXFP8BlockScaling", "E4M3"),
    ],
)
def test_recipes(monkeypatch, recipe, cls, fmt):
    from tricorn.parallel.te import make_recipe

    te_standin.install(monkeypatch)
    cfg = config_from_args(FLAGS + ["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", recipe], world_size=1)
    got = make_recipe(te_standin, cfg)
    assert type(got).__name__ == cls and got.fp8_format is te_standin.Format[fmt]


@pytest.mark.parametrize(
    "flags",
    [
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ["--pipeline-model-parallel-size", "2"],
        ["--zero-stage", "3"],
    ],
    ids=["tp2-sp", "pp2", "zero3"],
)
def test_trainer_with_te_equals_local(flags):
    """TE's TP/SP communication (parallel_mode, tp_group, sequence_parallel), PP, ZeRO-3 from a hollow build, and
    the microbatch loop's is_first_microbatch, through the real trainer."""
    from harness import run_script

    out = json.loads(run_script(Path(__file__).parent / "workers" / "te_trainer.py", 2, flags).strip().splitlines()[-1])
    # Bitwise (rtol 0): the stand-in computes with the same ops, in the same order, as the local layers.
    assert out["te_losses"] == out["local_losses"]
    assert out["te_devices"] == ["meta"]  # built hollow: the DP buckets fill what this rank owns
    n = out["te_modules"]
    for per_iteration in out["te_first_microbatch"]:
        if "--zero-stage" in flags:  # ZeRO-3 keeps no FP8 weight cache
            assert set(per_iteration) == {None}
        else:  # each module's first forward of the global batch casts, the other microbatches reuse
            assert per_iteration.count(True) == n and set(per_iteration[:n]) == {True}
            assert set(per_iteration[n:]) == {False} and per_iteration[n:]


# ---------------------------------------------------------------- bad input


def test_transformer_engine_is_refused_on_cpu_with_one_line():
    errs = validate(config_from_args(FLAGS + ["--transformer-impl", "transformer_engine"], world_size=1))
    assert sum("needs --device cuda" in e for e in errs) == 1, errs


@pytest.mark.parametrize(
    "version, ok",
    [("2.8.0", True), ("2.20.2", True), ("2.9.0+cu12.abc", True), ("2.7.0", False), ("2.21.0", False), ("1.13.0", False)],
)
def test_te_outside_the_pinned_range_is_refused_naming_the_version(version, ok):
    from tricorn.parallel.te import TE_PIN, te_version_error

    err = te_version_error(version)
    assert (err is None) == ok, err
    if not ok:
        assert version in err and TE_PIN in err and "\n" not in err


def test_te_not_installed_is_one_line():
    from tricorn.parallel.te import te_version_error

    assert "not installed" in te_version_error(None)


@pytest.mark.parametrize("capability, ok", [((9, 0), False), ((8, 9), False), ((10, 0), True), ((12, 0), False), (None, True)])
def test_mxfp8_needs_blackwell(capability, ok):
    from tricorn.parallel.te import mxfp8_error

    err = mxfp8_error(capability)
    assert (err is None) == ok
    if not ok:
        assert f"{capability[0]}.{capability[1]}" in err and "--fp8-recipe delayed or tensorwise" in err


def test_fp8_with_recompute_is_refused_with_one_line_for_te():
    te = FLAGS + ["--transformer-impl", "transformer_engine", "--bf16", "--fp8-format", "hybrid"]
    errs = [e for e in validate(config_from_args(te + ["--recompute-granularity", "full"], world_size=1)) if "recompute" in e]
    assert len(errs) == 1 and "--fp8-format with --recompute-granularity is not supported" in errs[0], errs


def test_rowwise_recipe_is_refused_with_te():
    te = FLAGS + ["--transformer-impl", "transformer_engine", "--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "rowwise"]
    errs = [e for e in validate(config_from_args(te, world_size=1)) if "rowwise" in e]
    assert len(errs) == 1 and "delayed, tensorwise or mxfp8" in errs[0], errs


@pytest.mark.parametrize(
    "flags, expected",
    [(["--tensor-model-parallel-size", "2", "--sequence-parallel"], [0, 1]), (["--pipeline-model-parallel-size", "2"], [0])],
)
def test_amax_reduction_group_is_tp_dp_cp_of_one_stage(flags, expected):
    """TE's recommendation for sequence-parallel layers: TP peers reduce amax together; pipeline stages do not."""
    from harness import run_script

    out = run_script(Path(__file__).parent / "workers" / "amax_group.py", 2, flags)
    assert out.strip().splitlines()[-1] == str(expected)


# ---------------------------------------------------------------- the estimate's FP8 terms


ESTIMATE = (
    "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
    "--seq-length 512 --vocab-size 32000 --swiglu --disable-bias-linear --bf16 --transformer-impl transformer_engine"
).split()


def _te_linear_weights(cfg) -> int:
    """Weight elements of the layers' TE linears, counted on the model itself (built on meta)."""
    from tricorn.model.spec import local_spec

    with torch.device("meta"):
        model = GPTModel(cfg.model, local_spec())
    return sum(m.weight.numel() for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in ("wqkv", "wo", "w1", "w2"))


@pytest.mark.parametrize("zero3", [False, True])
def test_estimate_prints_the_fp8_terms(zero3):
    from tricorn.parallel.te import AMAX_HISTORY_LEN
    from tricorn.planning.estimate import config_for_estimate, estimate_record, format_report

    layout = ["--zero-stage", "3"] if zero3 else []
    world = 2 if zero3 else None
    fp8 = config_for_estimate(ESTIMATE + layout + ["--fp8-format", "hybrid"], world)  # TE not installed here: planned anyway
    bf16 = estimate_record(config_for_estimate(ESTIMATE + layout, world))
    rec = estimate_record(fp8)
    terms = rec["fp8"]
    copies = 2 * _te_linear_weights(fp8)  # the FP8 weight and its transpose, 1 byte each
    assert (terms["weight_cache_bytes"], terms["saved_weights_bytes"]) == ((0, copies) if zero3 else (copies, 0))
    assert terms["scales_bytes"] == 4 * 4 * (3 + 2) * (AMAX_HISTORY_LEN + 2) * 4  # layers x linears x quantizers x fp32
    assert rec["fp8_bytes"] == copies + terms["scales_bytes"]
    assert rec["activation_bytes"] == bf16["activation_bytes"] + terms["activation_delta_bytes"]
    assert rec["total_bytes"] == bf16["total_bytes"] + rec["fp8_bytes"] + terms["activation_delta_bytes"]
    assert terms["activation_delta_bytes"] < 0  # FP8 linear inputs: 1 byte instead of 2
    report = format_report(fp8, gpu_memory_bytes=80 * 2**30)
    assert "FP8 (transformer_engine, delayed): weight cache" in report and "FP8 weights + scales" in report


# ---------------------------------------------------------------- the step-time model and the planner under FP8


def test_fp8_step_time_runs_the_linears_at_the_fp8_peak():
    import dataclasses

    from tricorn.planning.hardware import get_gpu
    from tricorn.planning.layout import Layout
    from tricorn.planning.step_time import Cluster, _head_time, fp8_cast_bytes, step_time

    model = config_from_args(["--model-preset", "llama3-8b"], world_size=8).model
    gpu = get_gpu("h100-80gb")
    bf16 = Layout(tp=2, dp=4, sequence_parallel=True, zero_stage=1, num_microbatches=2)
    fp8 = dataclasses.replace(bf16, transformer_impl="transformer_engine", fp8_recipe="delayed")
    t16, _ = step_time(model, bf16, Cluster(8, 8, gpu, gpu.peak_tflops("bf16")), 64)
    fast = Cluster(8, 8, gpu, gpu.peak_tflops("fp8"))  # under FP8 the cluster's peak is the FP8 one (MFU's)
    t8, _ = step_time(model, fp8, fast, 64)
    # The linears are most of the compute, but attention, the head, the casts and the communication stay: faster
    # than bf16, never twice as fast.
    assert t16 / 2 < t8 < t16
    assert _head_time(model, fp8, fast) == _head_time(model, bf16, Cluster(8, 8, gpu, gpu.peak_tflops("bf16")))
    assert fp8_cast_bytes(model, bf16, 8192) == 0 < fp8_cast_bytes(model, fp8, 8192)


def test_planner_offers_no_recompute_with_te_fp8():
    from tricorn.planning.hardware import get_gpu
    from tricorn.planning.planner import layout_groups
    from tricorn.planning.step_time import Cluster

    model = config_from_args(["--model-preset", "llama3-8b"], world_size=8).model
    cluster = Cluster(8, 8, get_gpu("h100-80gb"), get_gpu("h100-80gb").peak_tflops("fp8"))
    layouts = [lay for group in layout_groups(model, cluster, 64, "bf16", ("transformer_engine", "delayed")) for lay in group]
    assert layouts and {lay.recompute for lay in layouts} == {None}  # refused with TE's FP8 (validation)
    assert {lay.fp8_recipe for lay in layouts} == {"delayed"}


def test_fp8_shapes_te_cannot_take_are_refused_with_the_sizes_named():
    te = FLAGS + ["--transformer-impl", "transformer_engine", "--bf16", "--fp8-format", "hybrid"]
    assert not [e for e in validate(config_from_args(te, world_size=1)) if "divisible by 8" in e]
    errs = [e for e in validate(config_from_args(te + ["--ffn-hidden-size", "200"], world_size=1)) if "TE's FP8 GEMM" in e]
    assert len(errs) == 1 and "--ffn-hidden-size / TP = 200" in errs[0], errs
    errs = [
        e
        for e in validate(config_from_args(te + ["--seq-length", "12", "--micro-batch-size", "1"], world_size=1))
        if "FP8 GEMM" in e
    ]
    assert len(errs) == 1 and "tokens per microbatch (micro batch x seq / CP) = 12" in errs[0], errs
