"""The precision-aware optimizer (tricorn/parallel/precision.py) and FP8 primary weights (fp8_params.py).

- Rounding (this process): stochastic rounding picks one of the two neighbours, unbiased; its random numbers
  depend on the global coordinates only (a TP/DP split of a tensor draws what the whole tensor draws); fp16
  moments' power-of-two scales are exact.
- Layouts: each equals one process with the same settings (fp32 parameters: relative 1e-5, tests/harness.py);
  resume is bitwise; a checkpoint reshards and switches dtype on load with one line.
- FP8 primary weights: the gathered FP8 bytes equal one process's cast of the master (tests/workers/fp8_params.py);
  layouts and resume as above.
- Numerics: 20 iterations with bf16 moments stay within the argued bound of the fp32 optimizer
  (bench/precision_optimizer.py runs 50 on the demo corpus).
- Bad inputs: one line each. The estimator's bytes per parameter, and the memory report's against them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from badinput import assert_refused
from harness import BASE_FLAGS, FP32_RTOL, assert_close, reference, run_layout, run_script, with_flag

from tricorn.config_args import config_from_args
from tricorn.model.init import SHARD_ATTR, ShardInfo
from tricorn.parallel.precision import (
    from_storage,
    keyed_ranges,
    moment_scale,
    stochastic_round,
    stochastic_round_bf16,
    stochastic_store,
    to_storage,
    validate_precision,
)
from tricorn.planning.memory import estimate_config

PA = ["--use-precision-aware-optimizer"]
DIST = ["--use-distributed-optimizer"]

# ---------------------------------------------------------------- rounding


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_picks_a_neighbour_without_bias(dtype):
    """Each value goes to one of its two neighbours in `dtype`, the far one with probability equal to its
    relative distance: over a grid of N uniforms the mean is the value itself to within one spacing / N."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, generator=gen) * torch.logspace(-6, 3, 64)
    if dtype == torch.float16:  # fp16's subnormals and its top binade too
        x = torch.cat([x.clamp(-6e4, 6e4), torch.tensor([3e-7, -5e-8, 1.5e-5, 6.5e4])])
    n = 4096
    u = (torch.arange(n, dtype=torch.float32) + 0.5) / n  # a uniform grid on [0, 1)
    rounded = stochastic_round(x[:, None].expand(-1, n), dtype, u[None, :].expand(x.numel(), -1)).float()
    down, up = rounded.min(1).values, rounded.max(1).values
    assert torch.all((rounded == down[:, None]) | (rounded == up[:, None]))
    assert torch.all((down <= x) & (x <= up)), "a value rounds to its own neighbours only"
    nearest = x.to(dtype).float()
    spacing = torch.where(
        up > down, up - down, (torch.nextafter(x.to(dtype), torch.tensor(float("inf"), dtype=dtype)).float() - nearest).abs()
    )
    # The grid decides 'far' for exactly ceil(p N - 1/2) of N points: the mean is off by at most a spacing / N.
    assert torch.all((rounded.mean(1) - x).abs() <= spacing / n + 1e-30)
    exact = x.to(dtype).float()  # values the dtype holds are kept whatever u says
    assert torch.equal(stochastic_round(exact, dtype, torch.rand(exact.shape, generator=gen)).float(), exact)
    if dtype == torch.bfloat16:  # the masters' integer path: over all 2^16 values of its bits, exactly unbiased
        bits = torch.arange(1 << 16, dtype=torch.int64) << 16  # stochastic_round_bf16 reads the high 16 bits
        fast = stochastic_round_bf16(x[:, None].expand(-1, 1 << 16).contiguous(), bits[None, :].expand(x.numel(), -1))
        assert torch.equal(fast.double().mean(1), x.double()), "the carry happens for exactly the cut part's share of 2^16"
        assert torch.equal(stochastic_round_bf16(exact, bits[: exact.numel()]).float(), exact)


def test_nearest_rounding_stalls_where_stochastic_rounding_keeps_the_updates():
    """Why 16-bit masters round stochastically: 64 updates of 2^-10 to weights of 1 (below half a bf16 unit,
    2^-8) all vanish to nearest, and add up in expectation with stochastic rounding."""
    n = 4096
    weights = torch.ones(n, dtype=torch.bfloat16)
    nearest = torch.ones(n, dtype=torch.bfloat16)
    param = torch.zeros(n)
    ranges = keyed_ranges("w", param, 0, n, 0)
    for step in range(64):
        stochastic_store(weights.float() + 2.0**-10, weights, ranges, seed=1, step=step)
        nearest = (nearest.float() + 2.0**-10).bfloat16()
    assert torch.all(nearest == 1)
    # The mean of 4096 independent unbiased roundings: its standard error is ~ 2^-7 / sqrt(4096) x sqrt(64) = 2^-10.
    assert abs(weights.float().mean().item() - (1 + 64 * 2.0**-10)) < 4 * 2.0**-10


def _split(full: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    part = torch.nn.Parameter(full.chunk(world, dim)[rank].clone())
    setattr(part, SHARD_ATTR, ShardInfo(dim, rank, world, full.shape[dim]))
    return part


@pytest.mark.parametrize("dim", [0, 1])
def test_stochastic_rounding_does_not_depend_on_the_layout(dim):
    """A weight split over TP (rows or columns) and then over DP shards (arbitrary flat ranges) rounds every
    element exactly as the whole weight does in one process: the keys are global coordinates."""
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(6, 10, generator=gen) * 0.02
    whole = torch.empty(full.numel(), dtype=torch.bfloat16)
    stochastic_store(full.reshape(-1), whole, keyed_ranges("layers.0.w", torch.nn.Parameter(full), 0, full.numel(), 0), 7, 3)
    pieces = []
    for rank in range(2):
        local = _split(full, dim, rank, 2)
        flat = local.detach().reshape(-1)
        out = torch.empty(flat.numel(), dtype=torch.bfloat16)
        for start, stop in ((0, 7), (7, flat.numel())):  # two DP owners of uneven ranges
            stochastic_store(flat[start:stop], out[start:stop], keyed_ranges("layers.0.w", local, start, stop, 0), 7, 3)
        pieces.append(out.view(local.shape))
    assert torch.equal(torch.cat(pieces, dim).view(-1), whole)
    other = torch.empty_like(whole)
    stochastic_store(full.reshape(-1), other, keyed_ranges("layers.1.w", torch.nn.Parameter(full), 0, full.numel(), 0), 7, 3)
    assert not torch.equal(other, whole), "another tensor (or step, or seed) draws other numbers"
    padded = torch.empty(full.numel() + 4, dtype=torch.bfloat16)  # elements no global place covers: to nearest
    values = torch.cat([full.reshape(-1), torch.full((4,), 1 + 2.0**-8 + 2.0**-10)])  # nearest: up; truncated: down
    stochastic_store(values, padded, keyed_ranges("layers.0.w", torch.nn.Parameter(full), 0, full.numel(), 0), 7, 3)
    assert torch.equal(padded[-4:], values[-4:].bfloat16()) and torch.equal(padded[:-4], whole)


def test_fp16_moments_scale_by_a_power_of_two_exactly():
    """A moment bounded by B is stored times the largest power of two s with B s <= 65504: the largest value
    does not overflow, scaling is exact, and values down to B x 2^-24 survive where unscaled fp16 flushes them."""
    bound = torch.tensor(3e-9)  # an exp_avg_sq of gradients ~5e-5
    s = moment_scale(bound)
    assert float(bound * s) <= 65504 < float(2 * bound * s) and float(torch.log2(s)).is_integer()
    values = bound * torch.tensor([1.0, -0.37, 2.0**-10, 2.0**-24])
    store = torch.empty(4, dtype=torch.float16)
    to_storage(values, store, s)
    back = torch.empty(4)
    from_storage(store, back, s)
    # One rounding to nearest in fp16 (11 bits; the smallest value is a subnormal, exact at its power of two).
    torch.testing.assert_close(back, values, rtol=2.0**-11, atol=0.0)
    assert values.half()[2:].eq(0).all(), "unscaled, fp16 would flush them"


# ---------------------------------------------------------------- layouts equal one process

FP32_STATES = BASE_FLAGS + PA + ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "fp16"]
BF16_STATES = BASE_FLAGS + ["--bf16"] + PA + ["--main-params-dtype", "bf16", "--main-grads-dtype", "bf16"]
BF16_STATES += ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "fp16"]
FP8_WEIGHTS = BASE_FLAGS + ["--bf16", "--fp8-format", "e4m3", "--fp8-param-gather"] + DIST
# Each saving run is a layout compared with one process and the checkpoint its resume starts from.
SAVING = {
    # bf16 master (stochastic rounding), bf16 gradients, bf16 and fp16 moments at DP 2: DP splits samples, whose
    # bf16 forward and backward are the same ops as in one process; the gradients' sum over ranks is the only
    # reorder. --tensorboard-dir: the memory report, against the estimate.
    "bf16_master_dp2": (BF16_STATES, DIST + ["--tensorboard-dir", "tb"]),
    # FP8 primary weights under ZeRO-3: the gathered weights are one process's cast (the worker below checks the bytes).
    "fp8_weights_zero3_dp2": (FP8_WEIGHTS, ["--zero-stage", "3"]),
}
LAYOUTS = {
    # fp32 parameters: only the optimizer's storage rounds, elementwise and with global scales (reduced over TP
    # too), so a layout differs from one process by the fp32 reorder of its sums (FP32_RTOL), and a moment rounds
    # the other way only where that reorder crosses a rounding boundary.
    "fp32_params_tp2_sp": (FP32_STATES, ["--tensor-model-parallel-size", "2", "--sequence-parallel"] + DIST),
    "fp32_params_zero3_offload_dp2": (FP32_STATES, DIST + ["--zero-stage", "3", "--optimizer-cpu-offload"]),
}


@pytest.fixture(scope="module", params=list(SAVING))
def saved(request, tmp_path_factory):
    """(flags, the one-process reference, the DP-2 run saving at iteration 3, its checkpoint, its work dir)."""
    flags, extra = SAVING[request.param]
    work = tmp_path_factory.mktemp(request.param)
    ref = reference(flags, work / "ref")
    run = run_layout(flags + extra + ["--save", str(work / "ckpt"), "--save-interval", "3"], 2, work / "run")
    return flags, extra, ref, run, work


def _assert_equal(run, ref) -> None:
    assert_close(run.losses, ref.losses, FP32_RTOL, "lm loss")
    assert_close(run.grad_norms, ref.grad_norms, FP32_RTOL, "grad norm")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_one_process_with_the_same_settings(tmp_path, layout):
    flags, extra = LAYOUTS[layout]
    _assert_equal(run_layout(flags + extra, 2, tmp_path / "run"), reference(flags, tmp_path / "ref"))


def test_saving_layout_equals_one_process_and_resumes_bitwise(saved, tmp_path):
    """The DP-2 run equals one process; resumed from its iteration-3 checkpoint on the same layout, iterations 4
    and 5 are bit for bit its own (the rounding keys come from the optimizer step, the fp16 bounds and the FP8
    scales from the checkpoint)."""
    flags, extra, ref, run, work = saved
    _assert_equal(run, ref)
    resumed = run_layout(flags + extra + ["--load", str(work / "ckpt"), "--ckpt-step", "3"], 2, tmp_path / "resumed")
    # Bitwise (docs/testing.md): the same ops in the same order.
    assert_close(resumed.losses, run.losses[3:], 0.0, "resumed lm loss")
    assert_close(resumed.grad_norms, run.grad_norms[3:], 0.0, "resumed grad norm")
    if "--tensorboard-dir" in extra:
        _assert_report_matches_estimate(flags + extra, 2, work / "run" / "tb" / "memory_report.json")
        _switch_dtypes_on_load(work / "ckpt", run, tmp_path)


def _assert_report_matches_estimate(flags: list[str], nproc: int, report: Path) -> None:
    """The storage the optimizer allocates is what the estimator counts: no master copy (the bf16 parameters
    are the master), moments at 2 bytes each, gradients in bf16; exactly, bar the bucket padding (< DP elements
    per bucket) and the step counters."""
    est = estimate_config(config_from_args(flags, world_size=nproc))
    for entry in json.loads(report.read_text()):
        assert entry["master_params_bytes"] == 0
        assert entry["grads_bytes"] == entry["params_bytes"]  # both bf16, the gradients unsharded (ZeRO-1)
        padding = 64 * (4 + 4)  # a few padding elements per bucket, and one fp32 step per parameter
        assert abs(entry["optimizer_state_bytes"] - est.optimizer_state_bytes) <= padding, (entry, est)
        assert entry["optimizer_state_bytes"] * nproc == pytest.approx(2 * entry["params_bytes"], abs=nproc * padding)


def _switch_dtypes_on_load(ckpt: Path, full, tmp_path: Path) -> None:
    """The DP-2 checkpoint (bf16 master, bf16 and fp16 moments) in one process with an fp32 master and fp32
    moments: one line names the switches, and iteration 4's loss - computed from the loaded weights, before any
    step in the new dtypes - is the saved run's to the fp32 reorder bound."""
    fp32 = BASE_FLAGS + ["--bf16", "--load", str(ckpt), "--ckpt-step", "3", "--exit-interval", "4"]  # the same schedule
    run = run_layout(fp32, 1, tmp_path / "switched")
    lines = [line for line in run.stdout.splitlines() if "converted on load" in line]
    assert len(lines) == 1 and "master bf16 -> fp32" in lines[0] and "exp_avg_sq fp16 -> fp32" in lines[0], lines
    assert_close(run.losses, full.losses[3:4], FP32_RTOL, "lm loss after the switch")


def test_fp8_weights_sit_in_buckets_of_their_own():
    """As Megatron's one buffer per dtype: FP8 weights and 16-bit parameters never share a bucket, neither cuts the
    other's buckets short, and the buckets start their reductions in the order their last gradient arrives."""
    from tricorn.parallel.data_parallel import plan_param_buckets

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 40, 5, 40, 5, 40, 10)]  # embedding, w, norm, w, ...
    for i in (1, 3, 5):
        params[i].fp8_primary = True
    buckets = plan_param_buckets(params, bucket_size=50, alone=lambda p: False)
    index = {id(p): i for i, p in enumerate(params)}
    # The 16-bit bucket holds the embedding, whose gradient arrives last: it starts last.
    assert [[index[id(p)] for p in b] for b in buckets] == [[5, 3], [1], [6, 4, 2, 0]]


def test_fp8_gathered_weights_are_one_process_casts():
    """ZeRO-1, 2 and 3 at DP 2: each FP8 weight after two steps is, byte for byte, one process's cast of the
    whole master, with its scale (tests/workers/fp8_params.py)."""
    assert "ok" in run_script(Path(__file__).parent / "workers" / "fp8_params.py", 2)


# ---------------------------------------------------------------- numerics


def test_bf16_moments_track_the_fp32_optimizer(tmp_path):
    """20 iterations with bf16 moments against the fp32 optimizer on the same tokens. The argued bound
    (bench/precision_optimizer.py's): each stored moment rounds by at most 2^-9 relative, each update m/sqrt(v)
    by 1.5 x that, so to first order the loss moves by that fraction of how far it fell; twice it for the second
    order. A moment stored wrongly (unscaled, truncated, another parameter's) breaks it by far."""
    flags = with_flag(BASE_FLAGS, "--train-iters", "20")
    fp32 = reference(flags, tmp_path / "fp32")
    low = run_layout(flags + PA + ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"], 1, tmp_path / "bf16")
    fell = fp32.losses[0] - fp32.losses[-1]
    bound = 2 * 1.5 * 2.0**-9 * fell
    assert fell > 0.05, "the run must learn for the bound to mean anything (mock tokens: 6.03 -> 5.94)"
    for i, (a, b) in enumerate(zip(low.losses, fp32.losses), start=1):
        assert abs(a - b) <= bound, f"iteration {i}: bf16 moments {a} vs fp32 {b}: off by {abs(a - b):.2e} > {bound:.2e}"


# ---------------------------------------------------------------- bad inputs, the estimate

BAD = [
    (["--exp-avg-dtype", "bf16"], "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
    (PA + ["--main-grads-dtype", "bf16"], "--main-grads-dtype bf16 needs --bf16"),
    (["--bf16"] + PA + ["--main-params-dtype", "fp16"], "--main-params-dtype fp16 needs --fp16 (and its loss scaling)"),
    (PA + ["--main-params-dtype", "bf16"], "--main-params-dtype bf16 needs --bf16"),
    (["--bf16", "--fp8-param-gather"] + DIST, "--fp8-param-gather needs --fp8-format"),
    (["--bf16", "--fp8-format", "e4m3", "--fp8-param-gather"], "--fp8-param-gather needs --use-distributed-optimizer"),
    (
        ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "rowwise", "--fp8-param-gather"] + DIST,
        "needs --fp8-recipe tensorwise",
    ),
    (
        ["--bf16", "--fp8-format", "e4m3", "--fp8-param-gather"] + DIST + PA + ["--main-params-dtype", "bf16"],
        "needs --main-params-dtype fp32",
    ),
]


@pytest.mark.parametrize("extra,needle", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_one_line(tmp_path, extra, needle):
    assert_refused(BASE_FLAGS + extra, tmp_path, needle=needle)


def test_fp16_moments_are_refused_under_expert_parallelism():
    """Their bounds are per local parameter slot, MAX-reduced over the stage: under EP a slot is another expert on
    each EP rank, so they are refused there (before launch), and bf16 moments are not."""
    moe = BASE_FLAGS + PA + DIST + ["--num-experts", "4", "--expert-model-parallel-size", "2"]
    fp16 = validate_precision(config_from_args(moe + ["--exp-avg-sq-dtype", "fp16"], world_size=2))
    assert len(fp16) == 1 and "--exp-avg-sq-dtype fp16 with --expert-model-parallel-size 2" in fp16[0], fp16
    assert validate_precision(config_from_args(moe + ["--exp-avg-sq-dtype", "bf16"], world_size=2)) == []
    assert validate_precision(config_from_args(BASE_FLAGS + PA + ["--exp-avg-sq-dtype", "fp16"], world_size=2)) == []


def test_estimate_counts_the_stored_dtypes():
    """Bytes per parameter on a rank, llama3-70b at TP 8 x PP 4 with the distributed optimizer: moments and
    master follow their dtypes; FP8 primary weights store the four linears' weights at 1 byte."""
    argv = "--model-preset llama3-70b --bf16 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 --sequence-parallel --use-distributed-optimizer --vocab-size 128256".split()
    base = estimate_config(config_from_args(argv, world_size=32))
    low = estimate_config(
        config_from_args(
            argv + PA + ["--main-params-dtype", "bf16", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"], world_size=32
        )
    )
    assert low.master_params_bytes == 0 and low.optimizer_state_bytes == base.optimizer_state_bytes / 2
    fp8 = estimate_config(config_from_args(argv + ["--fp8-format", "e4m3", "--fp8-param-gather"], world_size=32))
    h, layers = 8192, base.layers_on_stage
    linears = layers * (h * (h + 2 * 1024) + h * h + 3 * h * 28672) / 8  # QKV, out projection, w1 (gate|up), w2
    assert base.params_bytes - fp8.params_bytes == linears  # one byte each instead of two
