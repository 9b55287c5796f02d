"""Job planner: real setups, --max-model, impossible requests, the step-time model, checked-in sbatch scripts."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tricorn import plan_cli
from tricorn.config import PRESETS, ModelConfig
from tricorn.planning import planner, sbatch
from tricorn.planning.hardware import GiB, get_gpu
from tricorn.planning.layout import Layout
from tricorn.planning.step_time import Cluster, step_time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100 = get_gpu("h100-80gb")


def plan_json(argv: list[str], capsys) -> list[dict]:
    assert plan_cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_llama2_70b_on_64_h100(capsys) -> None:
    argv = "--model-preset llama2-70b --gpus 64 --gpu-type h100-80gb --seq-length 4096 --global-batch-size 1024"
    plans = plan_json(argv.split(), capsys)
    assert len(plans) == 5
    assert all(p["memory_bytes"] <= 0.9 * H100.memory_bytes for p in plans)
    top = plans[0]
    # What practitioners run: wide TP inside the node plus pipeline stages, the distributed optimizer, no recompute.
    assert top["tp"] >= 4 and top["pp"] >= 2
    assert top["tp"] * top["pp"] * top["cp"] * top["dp"] == 64
    assert 0.3 < top["mfu"] < 0.65
    # Ties with the fastest come first (the preferred one on top), then the rest by predicted throughput.
    ties = [p for p in plans if p["tie"]]
    assert plans[: len(ties)] == ties and top["tie"] and top["why"]
    rest = [p["tokens_per_s"] for p in plans[len(ties) :]]
    assert rest == sorted(rest, reverse=True)


def test_llama2_7b_on_8_h100(capsys) -> None:
    argv = "--model-preset llama2-7b --gpus 8 --gpu-type h100-80gb --seq-length 4096 --global-batch-size 1024"
    plans = plan_json(argv.split(), capsys)
    assert plans and all(p["memory_bytes"] <= 0.9 * H100.memory_bytes for p in plans)
    top = plans[0]
    assert top["tp"] <= 2 and top["cp"] == 1 and top["recompute"] is None
    assert top["distributed_optimizer"]


def test_text_table(capsys) -> None:
    argv = "--model-preset llama2-13b --gpus 16 --gpu-type a100-80gb --seq-length 4096 --global-batch-size 512"
    assert plan_cli.main(argv.split()) == 0
    out = capsys.readouterr().out
    assert "TFLOP/s/GPU" in out and "MFU" in out and "mem/GPU" in out and "layouts considered" in out


def test_70b_on_one_gpu_says_what_is_missing(capsys) -> None:
    argv = "--model-preset llama2-70b --gpus 1 --gpu-type h100-80gb --seq-length 4096 --global-batch-size 8"
    assert plan_cli.main(argv.split()) == 1
    err = capsys.readouterr().err
    assert "does not fit on 1 x h100-80gb" in err
    assert "GiB per GPU" in err and "model state alone" in err and "needs at least" in err
    assert "Traceback" not in err


def test_no_divisible_layout_is_explained(capsys) -> None:
    # 37 GPUs: prime, more than the 32 layers (PP 37 is impossible even unevenly) and no DP divides the batch of 3.
    argv = "--model-preset llama2-7b --gpus 37 --gpu-type h100-80gb --seq-length 4096 --global-batch-size 3"
    assert plan_cli.main(argv.split()) == 1
    assert "no layout divides evenly" in capsys.readouterr().err


def test_max_model_is_monotone_in_gpus() -> None:
    base = ModelConfig(**PRESETS["llama2-7b"])
    sizes = []
    for gpus in (1, 2, 3, 4, 6, 8, 12, 16, 32):
        best = planner.max_model(base, Cluster(gpus, 8, H100, 989.0), 256)
        assert best is not None
        assert best["gpus_used"] <= gpus and best["memory_gb"] <= 0.9 * H100.memory_gb
        sizes.append(best["params"])
    assert sizes == sorted(sizes)
    assert sizes[-1] > 4 * sizes[0]


def test_max_model_cli(capsys) -> None:
    argv = "--model-preset llama2-70b --gpus 64 --gpu-type h100-80gb --seq-length 4096 --global-batch-size 1024 --max-model"
    assert plan_cli.main(argv.split()) == 0
    out = capsys.readouterr().out
    assert "largest llama2-70b-family model" in out and "B parameters" in out


def test_step_time_model_directions() -> None:
    m = ModelConfig(**PRESETS["llama2-13b"])
    cluster = Cluster(16, 8, H100, 989.0)
    base = Layout(tp=2, pp=2, dp=4, num_microbatches=64, sequence_parallel=True, zero_stage=1)
    t_base, parts = step_time(m, base, cluster, 256)
    assert parts["pipeline_bubble_s"] > 0 and parts["tp_comm_s"] > 0
    t_vpp, parts_vpp = step_time(m, Layout(**{**base.__dict__, "vpp": 4}), cluster, 256)
    # The same float64 formula divided by vpp: default rel 1e-6 only absorbs rounding.
    assert parts_vpp["pipeline_bubble_s"] == pytest.approx(parts["pipeline_bubble_s"] / 4)
    assert step_time(m, Layout(**{**base.__dict__, "recompute": "full"}), cluster, 256)[0] > 1.2 * t_base
    zero3 = Layout(tp=2, pp=1, dp=8, num_microbatches=32, sequence_parallel=True, zero_stage=3)
    zero1 = Layout(**{**zero3.__dict__, "zero_stage": 1})
    assert step_time(m, zero3, cluster, 256)[0] > step_time(m, zero1, cluster, 256)[0]
    # Small matmuls run further from peak: TP 8 on a 13B model costs more compute than TP 2.
    tp8 = Layout(tp=8, pp=1, dp=2, num_microbatches=128, sequence_parallel=True, zero_stage=1)
    tp2 = Layout(tp=2, pp=1, dp=8, num_microbatches=32, sequence_parallel=True, zero_stage=1)
    assert step_time(m, tp8, cluster, 256)[1]["compute_s"] > step_time(m, tp2, cluster, 256)[1]["compute_s"]


def test_more_gpus_plan_faster() -> None:
    m = ModelConfig(**PRESETS["llama2-7b"])
    speeds = [planner.plan(m, Cluster(n, 8, H100, 989.0), 1024, top_k=1).plans[0].tokens_per_s for n in (8, 16, 32)]
    assert speeds == sorted(speeds) and speeds[-1] > 3 * speeds[0]


# ---------------------------------------------------------------- sbatch scripts


@pytest.mark.parametrize("name", list(sbatch.CHECKED_IN))
def test_checked_in_sbatch_scripts_are_what_the_planner_writes(name: str, tmp_path) -> None:
    out = tmp_path / f"{name}.sbatch"
    assert plan_cli.main([*sbatch.checked_in_argv(name), "--emit-sbatch", str(out), "--quiet"]) == 0
    checked_in = os.path.join(REPO, "scripts", "slurm", f"{name}.sbatch")
    with open(checked_in) as fh:
        expected = fh.read()
    assert out.read_text() == expected, f"regenerate with: python -m tricorn.plan_cli --regenerate ({name})"
    assert os.access(checked_in, os.X_OK)


@pytest.mark.parametrize("name", ["llama2-7b", "llama2-70b"])
def test_sbatch_conventions(name: str) -> None:
    with open(os.path.join(REPO, "scripts", "slurm", f"{name}.sbatch")) as fh:
        text = fh.read()
    nodes = sbatch.CHECKED_IN[name][0]
    for line in (
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --exclusive",
        "#SBATCH --time=",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@180",
        "#SBATCH --open-mode=append",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        '--save "$CKPT_DIR"',
        '--load "$CKPT_DIR"',
        "--exit-signal-handler",
        "--exit-signal SIGUSR1",
        '--tensorboard-dir "$TB_DIR"',
        '--data-cache-path "$DATA_CACHE_DIR"',  # on shared storage: one rank builds the index cache
        "DATA_CACHE_DIR=${DATA_CACHE_DIR:-$RUN_DIR/data_cache}",
        "NCCL_IB_HCA",
        'scontrol requeue "$SLURM_JOB_ID"',
        # --torch-compile's kernels on node-local storage (docs/compile.md), kept across requeues of the job
        "export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/tricorn-inductor-${USER:-tricorn}/$SLURM_JOB_NAME}",
    ):
        assert line in text, line
    assert "TB_DIR=$RUN_DIR/tensorboard/$SLURM_JOB_ID" in text
    assert subprocess.run(["bash", "-n", "-c", text]).returncode == 0


def test_emitted_flags_parse_as_pretrain_gpt_flags() -> None:
    from tricorn.config_args import config_from_args

    lay = Layout(tp=4, pp=8, vpp=2, cp=2, dp=1, micro_batch=2, sequence_parallel=True, recompute="full", zero_stage=1)
    args = ["--model-preset", "llama3-70b", *sbatch.layout_args(lay, 512), *sbatch.llama_hyperparameters(70e9, 512 * 8192)]
    cfg = config_from_args(args, world_size=64)
    p = cfg.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size) == (4, 8, 2)
    assert cfg.virtual_stages == 2 and p.sequence_parallel and p.use_distributed_optimizer
    assert cfg.model.recompute_granularity == "full" and cfg.training.bf16 and cfg.training.lr == 1.5e-4
    assert cfg.num_microbatches == 512 // 2


def test_cpu_job_renders_without_gpu_lines() -> None:
    job = sbatch.SbatchJob(
        job_name="cpu-test", nodes=1, tasks_per_node=2, gpus_per_node=0, exclusive=False, device="cpu", train_args=["--x"]
    )
    text = sbatch.render(job)
    assert "--gpus-per-node" not in text and "--exclusive" not in text and "NCCL" not in text
    assert "--device cpu" in text and "#SBATCH --ntasks-per-node=2" in text
    assert GiB  # keeps the import honest


def test_planner_considers_the_zero_bubble_schedules_and_writes_the_flag() -> None:
    """Issue 30: for PP >= 2 the planner weighs zb-h1 (one chunk) and zbv / dualpipev (2 chunks of an even split,
    untied embeddings), never with FP8's own GEMMs; where one is fastest beyond the interval it comes first, and
    the sbatch flags name it."""
    from tricorn.config_args import config_from_args
    from tricorn.parallel.pipeline.stages import validate_pipeline

    m = ModelConfig(**PRESETS["llama3-70b"])
    assert m.untie_embeddings_and_output_weights
    base = Layout(tp=8, pp=8, dp=1, sequence_parallel=True, zero_stage=0)
    assert planner.schedules(m, base, 8, 1, (None, None)) == ("1f1b", "zb-h1")
    assert planner.schedules(m, base, 8, 2, (None, None)) == ("1f1b", "zbv", "dualpipev")
    assert planner.schedules(m, base, 8, 2, (9, 9)) == ("1f1b",)  # uneven split: no V
    assert planner.schedules(m, base, 1, 1, (None, None)) == ("1f1b",)
    fp8 = Layout(tp=8, pp=8, fp8_recipe="tensorwise")
    assert planner.schedules(m, fp8, 8, 1, (None, None)) == ("1f1b",)
    tied = ModelConfig(**{**PRESETS["llama3-70b"], "untie_embeddings_and_output_weights": False})
    assert planner.schedules(tied, base, 8, 2, (None, None)) == ("1f1b",)

    # 16 microbatches over 8 stages: 1F1B idles 7 of 23 microbatch times, the zero-bubble schedules a third of that
    # or less - beyond the calibration interval - and they hold more memory (the W's stores).
    cluster = Cluster(64, 8, H100, 989.0)
    plans = []
    for vpp, kind in ((1, "1f1b"), (1, "zb-h1"), (2, "1f1b"), (2, "zbv"), (2, "dualpipev")):
        lay = Layout(tp=8, pp=8, dp=1, vpp=vpp, num_microbatches=16, sequence_parallel=True, schedule=kind)
        plans.append(planner.evaluate(m, lay, cluster, 16, planner.worst_memory(m, lay)))
    times = {(p.layout.vpp, p.layout.schedule): p.step_time_s for p in plans}
    assert times[(1, "zb-h1")] < 0.85 * times[(1, "1f1b")] and times[(2, "zbv")] < 0.95 * times[(2, "1f1b")]
    assert plans[1].memory_bytes > plans[0].memory_bytes
    ranked = planner.rank(plans)
    top = ranked[0]
    assert top.layout.schedule in ("zb-h1", "zbv", "dualpipev") and not plans[0].tie  # plain 1F1B: beyond the interval

    for p in plans[1:]:  # every zero-bubble layout's flags run as that schedule; 1F1B's are the default's
        if p.layout.schedule == "1f1b":
            assert "--pipeline-schedule" not in sbatch.layout_args(p.layout, 16)
            continue
        args = ["--model-preset", "llama3-70b", *sbatch.layout_args(p.layout, 16), *sbatch.llama_hyperparameters(70e9, 16 * 8192)]
        cfg = config_from_args(args, world_size=64)
        assert cfg.parallel.pipeline_schedule == p.layout.schedule and cfg.virtual_stages == p.layout.vpp
        assert validate_pipeline(cfg) == []


def test_documents_and_windows_shrink_the_attention_time_not_the_model_flops(capsys, tmp_path) -> None:
    """--reset-attention-mask with --document-length and --window-size scale the attention core's time by the pairs
    they leave (flops.attention_work); the plan says so, and its sbatch script carries the flags."""
    m = ModelConfig(**{**PRESETS["llama3-8b"], "seq_length": 8192, "max_position_embeddings": 8192})
    cluster = Cluster(8, 8, H100, 989.0)
    base = Layout(tp=2, pp=1, dp=4, num_microbatches=64, sequence_parallel=True, zero_stage=1)
    short = Layout(**{**base.__dict__, "attention_work": 0.125})
    assert step_time(m, short, cluster, 256)[0] < 0.9 * step_time(m, base, cluster, 256)[0]
    argv = "--model-preset llama3-8b --gpus 8 --gpu-type h100-80gb --seq-length 8192 --max-position-embeddings 8192".split()
    argv += ["--global-batch-size", "256", "--reset-attention-mask", "--eod-mask-loss", "--window-size", "4095,0"]
    script = tmp_path / "job.sbatch"
    assert plan_cli.main([*argv, "--document-length", "1024", "--top-k", "1", "--emit-sbatch", str(script)]) == 0
    assert "(window 4095, documents of 1024 tokens)" in capsys.readouterr().out
    words = script.read_text().split()
    assert {"--reset-attention-mask", "--eod-mask-loss"} <= set(words) and "--reset-position-ids" not in words
    assert words[words.index("--window-size") + 1] == "4095,0"
