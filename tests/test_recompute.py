"""Activation recomputation: refused combinations, bitwise equality with no recompute.

The launched runs compare a recompute run with the same layout without recompute at rtol=0 (fp32 on CPU),
for full (uniform, 1 layer) and selective recompute, single process, TP=2 with SP (and dropout, so the
tensor-parallel RNG stream is exercised), and PP=2; their memory_report.json shows what each saves.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from harness import BASE_FLAGS, RunResult, assert_close, run_layout, with_flag

from tricorn.config import ConfigError, ModelConfig
from tricorn.config_args import config_from_args
from tricorn.model.spec import LayerSpec
from tricorn.model.transformer import GPTModel
from tricorn.parallel.recompute import RecomputePlan, apply_recompute
from tricorn.planning.activations import layer_activation_bytes
from tricorn.training.activation_probe import ActivationProbe
from tricorn.validation import validate

FLAGS = with_flag(BASE_FLAGS, "--num-layers", "4")
FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()
SELECTIVE = "--recompute-granularity selective".split()
MODEL = config_from_args(FLAGS).model
MICRO_BATCH = config_from_args(FLAGS).training.micro_batch_size


def _errors(extra: str, world_size: int = 1) -> list[str]:
    try:  # a value out of its declared range is refused while the flags are read
        return validate(config_from_args(FLAGS + extra.split(), world_size=world_size))
    except ConfigError as e:
        return [str(e)]


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "extra, world, needle",
    [
        ("--recompute-granularity selective --recompute-num-layers 1", 1, "selective recompute takes no --recompute-num-layers"),
        ("--recompute-granularity selective --recompute-method uniform", 1, "--recompute-method applies to full"),
        ("--recompute-granularity full --recompute-num-layers 1", 1, "full needs --recompute-method"),
        ("--recompute-granularity full --recompute-method block", 1, "full needs --recompute-num-layers"),
        ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 0", 1, "at least 1"),
        ("--recompute-method uniform --recompute-num-layers 2", 1, "need --recompute-granularity full"),
        (
            "--recompute-granularity full --recompute-method block --recompute-num-layers 3 --pipeline-model-parallel-size 2",
            2,
            "2 layers",
        ),
    ],
)
def test_invalid_combinations_are_refused(extra: str, world: int, needle: str) -> None:
    errs = _errors(extra, world)
    assert any(needle in e for e in errs), errs


@pytest.mark.parametrize(
    "extra",
    [
        "",
        "--recompute-granularity selective --recompute-modules core_attn mlp norm",
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 4",
        "--recompute-granularity full --recompute-method block --recompute-num-layers 2",
    ],
)
def test_valid_combinations_pass(extra: str) -> None:
    assert _errors(extra) == []


def test_refused_before_launch(tmp_path) -> None:
    run = run_layout(FLAGS + ["--recompute-granularity", "full"], 1, tmp_path, check=False)
    assert run.returncode == 2 and not run.records
    assert "tricorn: error: --recompute-granularity full needs --recompute-method" in run.stderr
    assert "Traceback" not in run.stderr


def test_groups_of_the_plan() -> None:
    ids = [str(i) for i in range(4, 9)]
    uniform = RecomputePlan("full", "uniform", 2)
    assert uniform.full_groups(ids) == [["4", "5"], ["6", "7"], ["8"]]
    assert RecomputePlan("full", "block", 2).full_groups(ids) == [["4"], ["5"]]
    assert RecomputePlan("selective").full_groups(ids) == []


# ---------------------------------------------------------------- in process: dropout and block method


def _dropout_model(recompute: dict, rng_draws_before: int = 0, seed: int = 0) -> tuple[float, torch.Tensor]:
    """Loss and flat gradient of a 3-layer model with hidden and attention dropout 0.2."""
    cfg = ModelConfig(
        num_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        vocab_size=50,
        hidden_dropout=0.2,
        attention_dropout=0.2,
    )
    for key, value in recompute.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    model = GPTModel(cfg, LayerSpec(dropout_seed=seed), padded_vocab_size=64)
    model.init_weights(1)
    apply_recompute([model], cfg)
    tokens = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(3))
    torch.rand(rng_draws_before)  # consumes the default stream: dropout must not care
    loss = model(tokens, tokens, sample_ids=(40, 41)).mean()
    loss.backward()
    return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])


FULL_UNIFORM = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


@pytest.mark.parametrize(
    "recompute",
    [
        FULL_UNIFORM,
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
        dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
        dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp", "norm"]),
    ],
)
def test_dropout_is_redrawn_bitwise(recompute: dict) -> None:
    """The recomputed forward draws the same masks (they are keyed by sample, layer and position)."""
    loss, grads = _dropout_model({})
    loss_r, grads_r = _dropout_model(recompute)
    # Bitwise: recompute re-runs the same ops in the same order with the same replayed dropout masks.
    assert loss_r == loss and torch.equal(grads_r, grads)


def test_dropout_masks_depend_on_keys_not_on_rng_state() -> None:
    """The control: the default RNG stream's position changes nothing; the run seed changes the masks."""
    _, grads = _dropout_model(FULL_UNIFORM)
    _, grads_consumed = _dropout_model(FULL_UNIFORM, rng_draws_before=1000)
    _, grads_other_seed = _dropout_model(FULL_UNIFORM, seed=1)
    assert torch.equal(grads_consumed, grads)
    assert not torch.equal(grads_other_seed, grads)


def test_block_method_checkpoints_the_first_layers_only() -> None:
    cfg = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=50)
    cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers = "full", "block", 1
    model = GPTModel(cfg, padded_vocab_size=64)
    model.init_weights(1)
    apply_recompute([model], cfg)
    tokens = torch.randint(0, 50, (2, 16))
    with ActivationProbe([model]) as probe:
        model(tokens, tokens).mean().backward()
    measured = {k: v[0] for k, v in probe.layer_bytes().items()}
    full = layer_activation_bytes(cfg, seq=16, micro_batch=2, precision="fp32", device="cpu")
    # Byte counts: the fp32 layer input plus the small position-id tensor saved beside it (< 5%).
    assert abs(measured["0"] - 4 * 16 * 2 * 32) <= 0.05 * 4 * 16 * 2 * 32  # its input (+ the position ids)
    assert measured["1"] == measured["2"] == full


def test_applying_twice_is_an_error() -> None:
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=50)
    cfg.recompute_granularity = "selective"
    model = GPTModel(cfg, padded_vocab_size=64)
    apply_recompute([model], cfg)
    with pytest.raises(RuntimeError, match="already applied"):
        apply_recompute([model], cfg)


# ---------------------------------------------------------------- launched runs: bitwise in fp32, memory_report.json


def _assert_bitwise(run, ref) -> None:
    # rtol 0: recompute re-runs the same ops in the same order on the same inputs (fp32, CPU): bit for bit.
    assert_close(run.losses, ref.losses, rtol=0, what="lm loss")
    assert_close(run.grad_norms, ref.grad_norms, rtol=0, what="grad norm")
    assert len(run.losses) == 5


def _run_with_report(flags: list[str], nproc: int, workdir: Path) -> tuple[RunResult, dict[int, dict]]:
    """The run and its memory_report.json entries by rank (the trainer writes them after iteration 1)."""
    run = run_layout(flags + ["--tensorboard-dir", str(workdir / "tb")], nproc, workdir)
    entries = json.loads((workdir / "tb" / "memory_report.json").read_text())
    return run, {e["rank"]: e for e in entries}


@pytest.fixture(scope="module")
def no_recompute(tmp_path_factory) -> tuple[RunResult, dict[int, dict]]:
    return _run_with_report(FLAGS, 1, tmp_path_factory.mktemp("none"))


def _per_layer(entries: dict[int, dict]) -> float:
    return entries[0]["activation_bytes_per_layer"]


def test_full_recompute_is_bitwise_and_keeps_the_layer_input(tmp_path, no_recompute) -> None:
    ref, ref_report = no_recompute
    run, report = _run_with_report(FLAGS + FULL, 1, tmp_path)
    _assert_bitwise(run, ref)
    m = MODEL
    layer_input = 4 * m.seq_length * MICRO_BATCH * m.hidden_size  # fp32 [s, b, h]
    # Byte counts: the layer input plus the small position-id tensor (< 5%).
    assert abs(_per_layer(report) - layer_input) <= 0.05 * layer_input, (_per_layer(report), layer_input)
    assert report[0]["activation_bytes_other"] == ref_report[0]["activation_bytes_other"]  # embedding/head/loss unchanged


def test_selective_recompute_is_bitwise_and_saves_the_formula_amount(tmp_path, no_recompute) -> None:
    ref, ref_report = no_recompute
    modules = ["core_attn", "mlp"]
    run, report = _run_with_report(FLAGS + SELECTIVE + ["--recompute-modules", *modules], 1, tmp_path)
    _assert_bitwise(run, ref)
    kw = dict(seq=MODEL.seq_length, micro_batch=MICRO_BATCH, precision="fp32", device="cpu")
    predicted = layer_activation_bytes(MODEL, **kw) - layer_activation_bytes(
        MODEL, **kw, recompute="selective", recompute_modules=modules
    )
    saved = _per_layer(ref_report) - _per_layer(report)
    # Byte counts: the activation formula's 10% acceptance bound against the probe.
    assert saved > 0 and abs(saved - predicted) <= 0.10 * predicted, (saved, predicted)


def test_tp2_sp_with_dropout_selective_is_bitwise(tmp_path) -> None:
    tp = FLAGS + "--tensor-model-parallel-size 2 --sequence-parallel --hidden-dropout 0.1 --attention-dropout 0.1".split()
    ref = run_layout(tp, 2, tmp_path / "none")
    _assert_bitwise(run_layout(tp + SELECTIVE, 2, tmp_path / "selective"), ref)


def test_pp2_selective_is_bitwise(tmp_path) -> None:
    pp = FLAGS + ["--pipeline-model-parallel-size", "2"]
    errs = validate(config_from_args(pp, world_size=2))
    if any("pipeline" in e for e in errs):
        pytest.skip(f"PP=2 is refused by the config: {errs[0]}")
    ref, report = _run_with_report(pp, 2, tmp_path / "none")
    _assert_bitwise(run_layout(pp + SELECTIVE + ["--recompute-modules", "core_attn", "mlp", "norm"], 2, tmp_path / "sel"), ref)
    # 1F1B with 2 microbatches: stage r holds min(pp - r, M) microbatches' activations before its first backward.
    stage = {e["pp_rank"]: e for e in report.values()}
    assert stage[0]["peak_microbatches_in_flight"] == 2 and stage[1]["peak_microbatches_in_flight"] == 1
    assert stage[1]["activation_bytes_other"] > stage[0]["activation_bytes_other"]  # the head and loss are on the last stage
