"""Issue 43, items 4 and 5: the memory features as estimator terms, in the step-time model and the planner, the
70B goal on 16 GPUs with its sbatch flags, and docs/memory.md's walk held to `tricorn estimate`.

The 70B figures of `tricorn simulate` (each feature's saving within 1% of the estimate) are in docs/memory.md: at
that size a simulation takes minutes, so here the tiny preset's run, with every memory feature on, is held to the
issue's 5% bound.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import pytest

from tricorn import plan_cli
from tricorn.config import PRESETS, ModelConfig
from tricorn.planning import frontier, memory_features, planner
from tricorn.planning.estimate import config_for_estimate
from tricorn.planning.hardware import GiB, get_gpu
from tricorn.planning.host_time import host_link
from tricorn.planning.layout import Layout
from tricorn.planning.memory import estimate
from tricorn.planning.step_time import Cluster, step_time
from tricorn.simulate import config_for_simulation, simulate

ROOT = Path(__file__).resolve().parent.parent
H100 = get_gpu("h100-80gb")
LLAMA3_70B = ModelConfig(**PRESETS["llama3-70b"])


def test_docs_walk_is_what_the_estimator_says():
    """docs/memory.md's table, step by step from the defaults to the leanest (regenerate: bench/memory_frontier.py)."""
    assert frontier.markdown(frontier.walk()) in (ROOT / "docs" / "memory.md").read_text()


def _layout(**kw) -> Layout:
    base = dict(tp=8, pp=2, dp=1, num_microbatches=512, sequence_parallel=True, device="cuda")
    return Layout(**{**base, **kw})


def test_optimizer_offload_and_bf16_moments_are_terms_of_the_estimate():
    m = dataclasses.replace(LLAMA3_70B, seq_length=8192)
    base = estimate(m, _layout())
    offload = estimate(m, _layout(optimizer_offload=True))
    moments = estimate(m, _layout(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"))
    owned = base.params_on_rank  # DP 1: the rank owns all of its parameters' optimizer state
    assert base.optimizer_state_bytes == 8 * owned and base.master_params_bytes == 4 * owned
    assert offload.master_params_bytes == offload.optimizer_state_bytes == 0
    assert offload.total_bytes == base.total_bytes - 12 * owned
    # Host: fp32 master, both moments, the fp32 gradient the host steps from, and the pinned bf16 copy back.
    assert offload.host_bytes == owned * (4 + 8 + 4 + 2) and base.host_bytes == 0
    assert moments.optimizer_state_bytes == 4 * owned and moments.total_bytes == base.total_bytes - 4 * owned


def test_the_features_cost_time_where_the_model_says():
    m = dataclasses.replace(LLAMA3_70B, seq_length=8192)
    cluster = Cluster(16, 8, H100, 989.0)
    t, parts = step_time(m, _layout(), cluster, 512)
    t_opt, parts_opt = step_time(m, _layout(optimizer_offload=True), cluster, 512)
    # The host's AdamW: the gradients down, then the host's step (slower than the device's through HBM).
    owned = planner.worst_estimate(m, _layout()).params_on_rank
    assert parts_opt["optimizer_s"] > owned * 4 / host_link(H100) > parts["optimizer_s"]
    assert t_opt - t == pytest.approx(parts_opt["optimizer_s"] - parts["optimizer_s"])  # nothing else changes
    t_mom = step_time(m, _layout(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"), cluster, 512)[0]
    assert t_mom < t  # a lighter AdamW, nothing more
    # Activation offload shows where the host link is slower than the compute beside it, and only there: at TP 8 a
    # layer's 285 MB take 5.6 ms over the H100's PCIe (51 GB/s), beside a 3 ms forward and a 6 ms backward.
    offload = _layout(offload_layers=20)
    t_off, parts_off = step_time(m, offload, cluster, 512)
    transfer = 512 * 20 * planner.worst_estimate(m, offload).activation_bytes_per_layer / host_link(H100)
    assert 0 < parts_off["offload_exposed_s"] < transfer  # the forward's copies show in part, the backward's hide
    assert t_off - t == pytest.approx(parts_off["offload_exposed_s"] * (1 + 1 / 512))  # (and in the bubble)
    fast = dataclasses.replace(cluster, gpu=dataclasses.replace(H100, host_link_bytes_per_s=1e12))
    assert step_time(m, offload, fast, 512)[1]["offload_exposed_s"] == 0.0


def test_least_offload_that_fits():
    m = dataclasses.replace(LLAMA3_70B, seq_length=8192)
    usable, host = H100.memory_bytes * 0.9, H100.host_memory_bytes * memory_features.HOST_MEMORY_FRACTION
    lay = _layout(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")  # 79.8 GiB: activation offload brings it under

    def est(layout):
        return planner.worst_estimate(m, layout)

    found, _ = memory_features.variants(m, _layout(), usable, host, est)
    by_features = {memory_features.features_of(v): v for v, _ in found}
    n = next(v.offload_layers for f, v in by_features.items() if f[0] == "bf16-moments" and len(f) == 2)
    assert est(dataclasses.replace(lay, offload_layers=n)).total_bytes <= usable
    assert est(dataclasses.replace(lay, offload_layers=n - 1)).total_bytes > usable
    assert ("opt-offload",) in by_features and ("bf16-moments",) not in by_features  # 79.8 GiB alone does not fit


def test_70b_fits_on_16_gpus_and_the_sbatch_carries_the_features(tmp_path, capsys):
    """The issue's goal: no 16-GPU layout fit before; now they do, and the script's flags rebuild the layout."""
    argv = "--model-preset llama3-70b --gpus 16 --gpus-per-node 8 --gpu-type h100-80gb --seq-length 8192 --global-batch-size 512"
    script = tmp_path / "70b.sbatch"
    assert plan_cli.main([*argv.split(), "--emit-sbatch", str(script), "--json", "--top-k", "1"]) == 0
    plans = __import__("json").loads(capsys.readouterr().out)
    top = plans[0]
    assert top["memory_features"] and top["memory_bytes"] <= 0.9 * H100.memory_bytes
    assert top["host_memory_bytes"] <= H100.host_memory_bytes * memory_features.HOST_MEMORY_FRACTION
    text = script.read_text()
    args = shlex.split(text[text.index("ARGS=(") + 6 : text.index('--save "$CKPT_DIR"')])
    cfg = config_for_estimate(args, 16)
    rebuilt = frontier.row("plan", [])  # (the frontier's layout is this one without features)
    assert "--optimizer-cpu-offload" in args and cfg.parallel.optimizer_cpu_offload == top["optimizer_cpu_offload"]
    assert cfg.model.cpu_offloading_num_layers == top["cpu_offloading_num_layers"]
    assert cfg.training.exp_avg_dtype == top["exp_avg_dtype"]
    est = planner.worst_estimate(cfg.model, Layout.from_config(cfg))
    assert est.total_bytes == pytest.approx(top["memory_bytes"]) and est.total_bytes < rebuilt.total
    # Without the features nothing fits, and the planner says so.
    assert plan_cli.main([*argv.split(), "--memory-features", "off"]) == 1
    assert "does not fit on 16 x h100-80gb" in capsys.readouterr().err


def test_simulated_saving_of_the_features_is_the_estimated_one():
    """Activation offload, optimizer offload and bf16 moments at once, against none, on the first of 2 pipeline
    stages of a 4-layer model of Llama 2 7B's width (seq 4096): the saving `tricorn simulate` measures equals the
    estimate's within the issue's 5%. (At 70B each feature alone, and the peaks themselves, agree within 1%:
    docs/memory.md. Here the peaks do not: a layer's backward temporaries, which the estimate leaves out, are a
    tenth of what two layers keep.)"""
    shape = "--num-layers 4 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 --swiglu --seq-length 4096"
    shape += " --disable-bias-linear --untie-embeddings-and-output-weights --vocab-size 32000 --bf16"
    shape += " --pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 4"
    features = " --cpu-offloading-num-layers 1 --optimizer-cpu-offload --use-precision-aware-optimizer"
    features += " --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"
    (base,) = simulate(config_for_simulation(shape.split(), 2), [0], iters=1)
    (lean,) = simulate(config_for_simulation((shape + features).split(), 2), [0], iters=1)
    measured = base["measured"]["peak_bytes"] - lean["measured"]["peak_bytes"]
    estimated = base["estimated"]["peak_bytes"] - lean["estimated"]["peak_bytes"]
    assert 0.95 <= estimated / measured <= 1.05, (estimated / GiB, measured / GiB)
    # Master weights and moments are in host memory, which the peak tracker leaves out (tricorn/pinned.py).
    assert lean["measured"]["master_params_bytes"] == lean["measured"]["optimizer_state_bytes"] == 0
    assert measured > 6 * GiB
