"""Observability: TensorBoard tags, console line with ETA, start-up block, per-rank logs, timers, FLOPs of the real model."""

from __future__ import annotations

import logging
import math
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from harness import BASE_FLAGS, run_layout, with_flag

from tricorn.config_args import config_from_args
from tricorn.model.transformer import GPTModel
from tricorn.planning import flops
from tricorn.timers import NULL_TIMER, OPTIMIZER_STEP, PIPELINE_P2P_WAIT, Timer, Timers
from tricorn.training.logging import MetricsLogger, format_duration, rank_log_path, remove_rank_logging, setup_rank_logging

ITERS, EVAL_INTERVAL = 10, 5
TRAIN_TAGS = [
    "lm loss",
    "learning-rate",
    "batch-size",
    "grad-norm",
    "params-norm",
    "loss-scale",
    "skipped-iterations",
    "iteration-time",
    "throughput",
    "tokens-per-sec",
    "mfu",
    "mem-allocated-bytes",
    "mem-max-allocated-bytes",
]
VALID_TAGS = ["lm loss validation", "lm loss validation ppl"]
PHASE_TAGS = ["forward-backward", "pipeline-p2p-wait", "grads-reduce-wait", "optimizer-step", "data-loading"]


def flags(tmp: Path, name: str, *extra: str) -> list[str]:
    out = with_flag(BASE_FLAGS, "--train-iters", str(ITERS))
    out += ["--eval-interval", str(EVAL_INTERVAL), "--eval-iters", "2", "--log-params-norm"]
    out += ["--tensorboard-dir", str(tmp / name / "tb"), "--log-dir", str(tmp / name / "logs"), *extra]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("obs")
    extra = ["--pipeline-model-parallel-size", "2", "--timing-log-level", "2", "--peak-tflops", "1.0"]
    extra += ["--save", str(tmp / "pp2" / "ckpt"), "--save-interval", "5"]
    pp2 = run_layout(flags(tmp, "pp2", *extra), 2, tmp / "pp2")
    tp2 = run_layout(flags(tmp, "tp2", "--tensor-model-parallel-size", "2"), 2, tmp / "tp2")  # level 0, no peak
    return {"pp2": (pp2, tmp / "pp2"), "tp2": (tp2, tmp / "tp2")}


def scalars(tb_dir: Path) -> tuple[dict[str, list], list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags["scalars"]}, tags["tensors"]


def test_every_tag_once_per_logged_iteration(runs: dict) -> None:
    _, where = runs["pp2"]
    values, text_tags = scalars(where / "tb")
    tokens_per_iter = 4 * 64  # global batch x seq length
    for tag in TRAIN_TAGS:
        assert [s for s, _ in values.get(tag, [])] == list(range(1, ITERS + 1)), tag
        assert [s for s, _ in values.get(f"{tag} vs tokens", [])] == [tokens_per_iter * i for i in range(1, ITERS + 1)], tag
    for tag in VALID_TAGS:
        assert [s for s, _ in values.get(tag, [])] == [5, 10], tag
        assert [s for s, _ in values.get(f"{tag} vs tokens", [])] == [5 * tokens_per_iter, 10 * tokens_per_iter], tag
    for phase in PHASE_TAGS:  # timing level 2: per-phase times with min/max over ranks
        for suffix in ("-time", "-time-min", "-time-max"):
            assert len(values.get(phase + suffix, [])) == ITERS, phase + suffix
    # The checkpoint hook (exit checks, and the save after iteration 5) runs after the log: it shows one log later.
    stall = dict(values.get("checkpoint-stall-time-max", []))
    assert sorted(stall) == list(range(2, ITERS + 1)) and stall[6] == max(stall.values()) > 0
    assert "config/text_summary" in text_tags
    v = {tag: [x for _, x in values[tag]] for tag in values}
    assert all(x > 0 for x in v["throughput"] + v["tokens-per-sec"] + v["mem-allocated-bytes"] + v["iteration-time"])
    assert v["batch-size"] == [4.0] * ITERS and v["skipped-iterations"] == [0.0] * ITERS
    # mfu is in percent: model TFLOP/s per device over the 1 TFLOP/s peak given on the command line.
    # TensorBoard stores float32: two roundings of u = 6e-8 each; 1e-5 is 80x that.
    assert v["mfu"] == pytest.approx([100 * t / 1.0 for t in v["throughput"]], rel=1e-5)
    for i in range(ITERS):
        lo, hi = v["forward-backward-time-min"][i], v["forward-backward-time-max"][i]
        assert lo <= v["forward-backward-time"][i] <= hi and v["pipeline-p2p-wait-time"][i] <= hi


def test_throughput_is_model_flops_per_device(runs: dict) -> None:
    run, _ = runs["pp2"]
    cfg = config_from_args(flags(Path("/tmp"), "x", "--pipeline-model-parallel-size", "2"), world_size=2)
    model_flops = flops.iteration_flops_for_config(cfg).model
    for r in (r for r in run.records if "loss" in r):
        # The same float64 formula on the logged iteration time (full precision in JSON): 1e-6 only absorbs rounding.
        assert r["tflops_per_device"] == pytest.approx(model_flops / r["iteration_time"] / 2 / 1e12, rel=1e-6)


def test_cpu_without_peak_has_no_mfu_and_level0_no_phase_timers(runs: dict) -> None:
    run, where = runs["tp2"]
    values, _ = scalars(where / "tb")
    assert "mfu" not in values and not any(t.endswith("-time") for t in values if t != "iteration-time")
    lines = [line for line in run.stdout.splitlines() if line.startswith(" iteration ")]
    assert len(lines) == ITERS and not any("MFU" in line for line in lines) and "timers (ms" not in run.stdout
    assert "MFU not shown: pass --peak-tflops" in run.stdout


def test_params_norm_counts_each_parameter_once(runs: dict) -> None:
    # PP=2 keeps a tied head copy on the last stage, TP=2 a copy of every norm weight on each rank: counted twice,
    # either would change the norm (the norm weights start at 1, the embedding is the largest matrix).
    pp2 = [r["params_norm"] for r in runs["pp2"][0].records if "params_norm" in r]
    tp2 = [r["params_norm"] for r in runs["tp2"][0].records if "params_norm" in r]
    assert len(pp2) == len(tp2) == ITERS
    # Two layouts after the same training: fp32 reorder only, the harness's FP32_RTOL argument; a copy counted twice moves it by >1%.
    assert pp2 == pytest.approx(tp2, rel=1e-5)


def test_startup_block_and_parameter_count(runs: dict) -> None:
    run, _ = runs["pp2"]
    cfg = config_from_args(flags(Path("/tmp"), "x"), world_size=1)
    expected = sum(p.numel() for p in GPTModel(cfg.model).parameters())  # tied: the head reuses the embedding
    out = run.stdout
    assert "world 2 = TP 1 x PP 2 (VPP 1) x CP 1 x DP 1" in out
    assert "global 4 = micro 2 x 2 microbatches x DP 1" in out
    m = re.search(
        r"parameters ([\d,]+) total \| per rank ([\d,]+) \.\. ([\d,]+) \| per stage ([\d,]+) \(pp0\), ([\d,]+) \(pp1\)", out
    )
    assert m, out[:2000]
    total, lo, hi, s0, s1 = (int(g.replace(",", "")) for g in m.groups())
    assert total == expected and lo == min(s0, s1) and hi == max(s0, s1)
    assert s0 + s1 > total  # the last stage holds its own copy of the tied head
    assert "memory     estimate for the worst rank" in out
    assert out.index("tricorn: layout") < out.index(" iteration        1/")
    tp2 = re.search(
        r"parameters ([\d,]+) total \| per rank ([\d,]+) \.\. ([\d,]+) \| per stage ([\d,]+) \(pp0\)$",
        runs["tp2"][0].stdout,
        re.M,
    )
    total, lo, hi, stage = (int(g.replace(",", "")) for g in tp2.groups())
    assert total == stage == expected and lo == hi and expected < lo + hi  # norms are replicated over TP


def test_console_line_and_eta_counts_down(runs: dict) -> None:
    run, _ = runs["pp2"]
    lines = [line for line in run.stdout.splitlines() if line.startswith(" iteration ")]
    assert len(lines) == ITERS
    for key in ("consumed samples:", "elapsed time per iteration (ms):", "learning rate:", "global batch size:", "lm loss:"):
        assert all(key in line for line in lines), key
    for key in ("loss scale:", "grad norm:", "number of skipped iterations:", "number of nan iterations:", "tokens/s:"):
        assert all(key in line for line in lines), key
    assert all("TFLOP/s per device:" in line and "MFU:" in line for line in lines)
    assert [int(re.search(r"consumed samples:\s+(\d+)", line).group(1)) for line in lines] == [4 * i for i in range(1, 11)]
    shown = [re.search(r"ETA: ([\d.]+)s$", line) for line in lines]
    assert all(shown), lines[0]
    etas = [r["eta_s"] for r in run.records if "eta_s" in r]
    # The console prints the ETA to 2 decimals (format_duration): half a unit 0.005, plus float noise.
    assert [float(m.group(1)) for m in shown] == pytest.approx(etas, abs=0.006)
    # At the last iteration only the final evaluation is left; timing noise may wiggle single steps before.
    assert len(etas) == ITERS and 0 < etas[-1] < min(etas[:-1]) and etas[0] == max(etas)
    assert sum(etas[:5]) > sum(etas[5:])
    assert "validation loss at iteration 5" in run.stdout


def test_per_rank_log_files_and_config_dump(runs: dict) -> None:
    _, where = runs["pp2"]
    logs = where / "logs"
    rank0, rank1 = Path(rank_log_path(str(logs), 0)).read_text(), Path(rank_log_path(str(logs), 1)).read_text()
    assert "rank 0 = pp0_dp0_cp0_tp0" in rank0 and " iteration       10/" in rank0
    assert "rank 1 = pp1_dp0_cp0_tp0" in rank1 and " iteration " not in rank1
    dumped = yaml.safe_load((logs / "config.yaml").read_text())
    assert dumped["parallel"]["pipeline_model_parallel_size"] == 2 and dumped["logging"]["timing_log_level"] == 2


# ---------------------------------------------------------------- units


def test_eta_counts_down_at_constant_pace() -> None:
    cfg = config_from_args(
        ["--train-iters", "10", "--eval-interval", "4", "--eval-iters", "3", "--vocab-size", "64"], world_size=1
    )
    logger = MetricsLogger(cfg, rank=1)  # a non-zero rank writes nothing
    history: list = []
    trainer = SimpleNamespace(iteration=0, history=history, valid_loader=object())
    etas = []
    for it in range(1, 11):
        trainer.iteration = it
        history.append(SimpleNamespace(seconds=2.0 if it == 1 else 1.0))  # the first iteration warms up
        logger.observe_iterations(history[-1:])
        etas.append(logger.eta_seconds(trainer))  # logged before this iteration's evaluation runs
        if it % 4 == 0:
            logger.observe_evaluation(0.5)
    # Iteration 1: 9 more at its 2 s, plus the evaluations at 4 and 8, guessed as 3 forwards ~ 1 iteration each.
    # Sums of exact binary fractions (2.0, 1.0, 0.5): default approx only absorbs float64 rounding.
    assert etas[0] == pytest.approx(9 * 2.0 + 2 * 2.0)
    assert etas[1] == pytest.approx(8 * 1.0 + 2 * 1.0)  # the pace now leaves the warm-up iteration out
    assert etas[3] == pytest.approx(6 * 1.0 + 2 * 1.0)  # the evaluation at 4 is still ahead
    assert etas[4] == pytest.approx(5 * 1.0 + 0.5)  # measured evaluation time from now on
    assert all(a > b for a, b in zip(etas, etas[1:])) and etas[-1] == 0
    logger.close()


def test_format_duration() -> None:
    assert format_duration(0.256) == "0.26s" and format_duration(42.04) == "42.0s"
    assert format_duration(3725) == "1:02:05" and format_duration(2 * 86400 + 61) == "2d 0:01:01"


def test_timers_levels() -> None:
    t0 = Timers(level=0)
    assert t0(OPTIMIZER_STEP) is NULL_TIMER and t0.read() == {}
    with t0(OPTIMIZER_STEP):
        pass
    assert Timers.disabled()("anything", level=0) is NULL_TIMER
    t1 = Timers(level=1)
    timer = t1(PIPELINE_P2P_WAIT)
    assert isinstance(timer, Timer) and t1(PIPELINE_P2P_WAIT) is timer
    for _ in range(3):  # accumulates over the calls of an interval
        with timer:
            torch.ones(64).sum()
    first = t1.read()[PIPELINE_P2P_WAIT]
    assert first > 0 and t1.read()[PIPELINE_P2P_WAIT] == 0.0  # read resets
    timer.start()
    with pytest.raises(RuntimeError, match="started twice"):
        timer.start()
    timer.stop()
    with pytest.raises(RuntimeError, match="without being started"):
        timer.stop()
    assert not t1.reduce_across_ranks and Timers(level=2).reduce_across_ranks


def test_warnings_of_any_rank_reach_stderr_and_its_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    setup_rank_logging(3, str(tmp_path))
    try:
        logging.getLogger("tricorn.data.loader").warning("split 'valid' is empty")
        logging.getLogger("tricorn.data.loader").info("quiet detail")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("a torch-style warning", UserWarning, stacklevel=1)
    finally:
        remove_rank_logging()
    err = capsys.readouterr().err
    assert (
        "tricorn [rank 3] WARNING: split 'valid' is empty" in err and "[rank 3]" in err.split("torch-style")[0].splitlines()[-1]
    )
    assert "quiet detail" not in err
    text = Path(rank_log_path(str(tmp_path), 3)).read_text()
    assert "split 'valid' is empty" in text and "a torch-style warning" in text and "quiet detail" in text


# ---------------------------------------------------------------- FLOPs of tricorn's own model

TINY = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 100 --global-batch-size 3"


@pytest.mark.parametrize(
    "extra",
    [
        "--swiglu --group-query-attention --num-query-groups 2 --disable-bias-linear",
        "--untie-embeddings-and-output-weights",  # MHA, GeLU 4h, biases, untied head
        "--swiglu --recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
        "--swiglu --recompute-granularity selective --recompute-modules core_attn mlp",
    ],
    ids=["gqa-swiglu", "mha-gelu-untied", "full-recompute", "selective-recompute"],
)
def test_formula_equals_matmuls_of_tricorn_model(extra: str) -> None:
    from tricorn.parallel.recompute import apply_recompute

    cfg = config_from_args([*TINY.split(), *extra.split()], world_size=1)
    torch.manual_seed(0)
    model = GPTModel(cfg.model)
    model.init_weights(1)
    apply_recompute([model], cfg.model)
    tokens, labels = torch.randint(0, 100, (3, 32)), torch.randint(0, 100, (3, 32))
    counted = flops.count_matmul_flops(lambda: model(tokens, labels).sum().backward())
    f = flops.iteration_flops_for_config(cfg)
    # The CPU flash kernel's backward recomputes Q K^T, as on GPU; that and recompute are hardware FLOPs only.
    # Exact integer counts summed in float64 in two orders: 1e-12 is 1000x their rounding.
    assert counted == pytest.approx(f.hardware, rel=1e-12)
    assert counted - f.attention_backward_recompute - f.recompute == pytest.approx(f.model, rel=1e-12)
    # isclose to 0.0 is exact equality (no abs_tol): no recompute means exactly zero recompute FLOPs.
    assert math.isclose(f.recompute, 0.0) == (cfg.model.recompute_granularity is None)
