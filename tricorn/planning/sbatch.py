"""sbatch scripts for a planned layout: `tricorn plan ... --emit-sbatch FILE`, and the checked-in scripts/slurm/.

The script (see scripts/slurm/README.md):
- asks SLURM for whole nodes, one task per GPU, requeue on preemption/timeout, and USR1 to the batch shell
  180 s before the time limit (``--signal=B:USR1@180``); output appends across requeues;
- runs ``srun pretrain_gpt.py`` in the background; each task reads RANK / WORLD_SIZE / LOCAL_RANK from
  SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID alone (a RANK, WORLD_SIZE or MASTER_PORT the submitting shell
  exported is dropped, with one line), MASTER_ADDR is the first host of the allocation;
- traps USR1 and forwards it to srun, whose tasks (``--exit-signal-handler --exit-signal SIGUSR1``) save a
  checkpoint and exit 0; the script then requeues the job, which resumes from the same --save/--load dir;
- requeues, at most MAX_REQUEUES times, when the hang watchdog ended the run (exit 75, its line in
  $TRICORN_EXIT_REPORT) or a task was killed by a signal (a dead rank, a lost node), logging each cause;
- sets the NCCL environment so that NCCL never SIGABRTs a rank before tricorn's watchdog reports; the flight
  recorder (--flight-recorder-dump-path) dumps into the run's log directory on a hang or NCCL timeout;
- writes TensorBoard events and per-rank logs under the run directory, one subdirectory per job;
- passes --data-cache-path on shared storage (the run directory): rank 0 builds the sample-index cache
  first (data/cache.py, a barrier), every other rank and every requeue reads it.

``python -m tricorn.plan_cli --regenerate`` rewrites scripts/slurm/*.sbatch from ``CHECKED_IN``.
No collectives, no device work.
"""

from __future__ import annotations

import math
import os
import shlex
from dataclasses import dataclass, field
from typing import Optional

# name -> (nodes, seq length, global batch): ~4M tokens per batch on 8 x H100 80GB nodes (Llama 2's recipe).
CHECKED_IN: dict[str, tuple[int, int, int]] = {
    "llama2-7b": (1, 4096, 1024),
    "llama3-8b": (1, 8192, 512),
    "llama2-13b": (2, 4096, 1024),
    "codellama-34b": (4, 16384, 256),
    "llama2-70b": (8, 4096, 1024),
    "llama3-70b": (8, 8192, 512),
}
SLURM_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "slurm")


def checked_in_argv(name: str) -> list[str]:
    """The `tricorn plan` command line that generates scripts/slurm/NAME.sbatch."""
    nodes, seq, gbs = CHECKED_IN[name]
    return [
        "--model-preset",
        name,
        "--gpus",
        str(8 * nodes),
        "--gpus-per-node",
        "8",
        "--gpu-type",
        "h100-80gb",
        "--seq-length",
        str(seq),
        "--global-batch-size",
        str(gbs),
    ]


@dataclass
class SbatchJob:
    job_name: str
    nodes: int
    tasks_per_node: int
    train_args: list[str]  # pretrain_gpt.py flags for model, layout and schedule (not paths, not data)
    gpus_per_node: int = 8  # 0: a CPU job
    time: str = "24:00:00"
    signal_seconds: int = 180
    exclusive: bool = True
    comments: list[str] = field(default_factory=list)
    device: str = "cuda"
    partition: Optional[str] = None


def _wrap_args(args: list[str]) -> str:
    """One flag (with its values) per line of the bash array."""
    lines, current = [], []
    for a in args:
        if a.startswith("--") and current:
            lines.append(" ".join(current))
            current = []
        current.append(shlex.quote(a))
    if current:
        lines.append(" ".join(current))
    return "\n".join(f"    {line}" for line in lines)


def render(job: SbatchJob) -> str:
    sb = [
        f"#SBATCH --job-name={job.job_name}",
        f"#SBATCH --nodes={job.nodes}",
        f"#SBATCH --ntasks-per-node={job.tasks_per_node}",
    ]
    if job.gpus_per_node:
        sb.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    if job.exclusive:
        sb.append("#SBATCH --exclusive")
    if job.partition:
        sb.append(f"#SBATCH --partition={job.partition}")
    sb += [
        f"#SBATCH --time={job.time}",
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:USR1@{job.signal_seconds}",
        "#SBATCH --open-mode=append",
        "#SBATCH --output=%x-%j.out",
    ]
    comments = "\n".join(f"# {c}" if c else "#" for c in job.comments)
    env = (
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}"
        if job.device == "cpu"
        else _NCCL_BLOCK + "\nexport OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}"
    )
    return _TEMPLATE.format(
        sbatch="\n".join(sb),
        comments=comments,
        env=env,
        train_args=_wrap_args(job.train_args),
        device_arg="" if job.device == "cuda" else f"\n    --device {job.device}",
    )


_NCCL_BLOCK = """\
# NCCL: set what your fabric needs (run once with NCCL_DEBUG=INFO to see what NCCL picked).
#   NCCL_SOCKET_IFNAME=ib0         interface for NCCL's bootstrap and socket fallback (not docker0/lo)
#   NCCL_IB_HCA=mlx5_0,mlx5_1,...  InfiniBand adapters, one per GPU on rail-optimised nodes
#   NCCL_IB_TIMEOUT=22             longer InfiniBand timeout on large or busy fabrics
#   NCCL_NVLS_ENABLE=0             turn NVLink SHARP off where the fabric manager does not support it
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# A stuck or dead rank (docs/reliability.md#hangs): tricorn's watchdog names it and every rank exits 75 after
# --hang-timeout-minutes (8 in ARGS, below the 10-minute --distributed-timeout-minutes, so it comes first;
# EXTRA_ARGS overrides it). torch's default (3) and 1 make NCCL's own watchdog tear the process down at the distributed timeout
# (SIGABRT, exit 134, no Python line); 2 only aborts the communicators: the collective raises (one line) or the
# watchdog reports, and this script requeues on 75.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-2}
# NCCL's heartbeat monitor kills a rank whose NCCL watchdog thread is itself stuck (a hung CUDA call); torch's 480 s
# would come before tricorn's watchdog, so it waits 15 minutes (keep it above --hang-timeout-minutes).
export TORCH_NCCL_ENABLE_MONITORING=${TORCH_NCCL_ENABLE_MONITORING:-1}
export TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=${TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC:-900}
# One hardware queue per device keeps TP/SP communication kernels in issue order with the compute (Megatron).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}"""

_TEMPLATE = """\
#!/bin/bash
{sbatch}
{comments}
#
# Submit from the tricorn checkout: DATA_PATH=/data/my-corpus_text_document TOKENIZER_MODEL=/data/tok.model sbatch THIS
# Or DATA_ARGS="--mock-data --vocab-size 32000" for a smoke test. See scripts/slurm/README.md.
set -euo pipefail

TRICORN_DIR=${{TRICORN_DIR:-$SLURM_SUBMIT_DIR}}
PYTHON=${{PYTHON:-python}}
RUN_DIR=${{RUN_DIR:-$TRICORN_DIR/runs/$SLURM_JOB_NAME}}
CKPT_DIR=$RUN_DIR/checkpoints            # --save and --load: a requeued job resumes from here
TB_DIR=$RUN_DIR/tensorboard/$SLURM_JOB_ID
LOG_DIR=$RUN_DIR/logs/$SLURM_JOB_ID
# Sample-index cache on shared storage: global rank 0 builds it while the other ranks wait at a barrier,
# then every rank (and every requeue) memory-maps the same files instead of each building its own.
DATA_CACHE_DIR=${{DATA_CACHE_DIR:-$RUN_DIR/data_cache}}
mkdir -p "$CKPT_DIR" "$TB_DIR" "$LOG_DIR" "$DATA_CACHE_DIR"
# A rank that dies, or a hang the watchdog reports (exit 75), requeues the job at most MAX_REQUEUES times; each
# requeue is one line here and in $RUN_DIR/requeues.log. USR1 (the time limit) requeues without counting.
MAX_REQUEUES=${{MAX_REQUEUES:-3}}
export TRICORN_EXIT_REPORT=$LOG_DIR/exit-report.txt  # the watchdog's "75 <line>", for the cause below
rm -f "$TRICORN_EXIT_REPORT"
# --torch-compile (docs/compile.md): inductor's compiled code on node-local storage - each task writes its own
# kernels, many small files that a shared filesystem serves slowly - kept per job name, so a requeue on the same
# node loads them instead of compiling again. Inductor creates the directory on every node.
export TORCHINDUCTOR_CACHE_DIR=${{TORCHINDUCTOR_CACHE_DIR:-${{TMPDIR:-/tmp}}/tricorn-inductor-${{USER:-tricorn}}/$SLURM_JOB_NAME}}

if [[ -z ${{DATA_ARGS:-}} ]]; then
    : "${{DATA_PATH:?set DATA_PATH to a preprocessed prefix (tricorn preprocess), or DATA_ARGS}}"
    : "${{TOKENIZER_MODEL:?set TOKENIZER_MODEL to the sentencepiece .model file}}"
    DATA_ARGS="--data-path $DATA_PATH --tokenizer-type SentencePieceTokenizer --tokenizer-model $TOKENIZER_MODEL"
fi
read -r -a DATA_ARRAY <<<"$DATA_ARGS"
read -r -a EXTRA_ARRAY <<<"${{EXTRA_ARGS:-}}"

# Rendezvous: rank 0 runs on the first node; every task derives its rank from SLURM_PROCID/NTASKS/LOCALID. sbatch
# hands on the submitting shell's environment: a launch variable from there (a torchrun session's RANK, WORLD_SIZE,
# MASTER_PORT) is dropped, with one line; TRICORN_MASTER_PORT chooses the port on purpose.
INHERITED=()
for VAR in RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK; do
    if [[ -n ${{!VAR+x}} ]]; then
        INHERITED+=("$VAR=${{!VAR}}")
        unset "$VAR"
    fi
done
OLD_ADDR=${{MASTER_ADDR:-}}
OLD_PORT=${{MASTER_PORT:-}}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${{TRICORN_MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}}
[[ -n $OLD_ADDR && $OLD_ADDR != "$MASTER_ADDR" ]] && INHERITED+=("MASTER_ADDR=$OLD_ADDR")
[[ -n $OLD_PORT && $OLD_PORT != "$MASTER_PORT" ]] && INHERITED+=("MASTER_PORT=$OLD_PORT")
if ((${{#INHERITED[@]}})); then
    echo "tricorn: warning: ignoring ${{INHERITED[*]}} from the submitting shell: each task takes its rank from SLURM and the rendezvous from the job (TRICORN_MASTER_PORT sets the port)"
fi
export MASTER_ADDR MASTER_PORT
{env}

ARGS=(
{train_args}{device_arg}
    --save "$CKPT_DIR"
    --load "$CKPT_DIR"
    --exit-signal-handler
    --exit-signal SIGUSR1
    --hang-timeout-minutes 8
    --flight-recorder-dump-path "$LOG_DIR/flight_recorder"
    --tensorboard-dir "$TB_DIR"
    --log-dir "$LOG_DIR"
    --data-cache-path "$DATA_CACHE_DIR"
)

echo "tricorn: job $SLURM_JOB_ID restart ${{SLURM_RESTART_COUNT:-0}} on $SLURM_JOB_NODELIST, master $MASTER_ADDR:$MASTER_PORT"
# USR1 reaches this shell (--signal=B:USR1@...) ahead of the time limit, or from `scancel --batch --signal=USR1`.
# Pass it to the tasks: they save a checkpoint and exit 0; then requeue so the run continues from it.
SIGNALLED=0
trap 'SIGNALLED=1; echo "tricorn: USR1 received, asking the trainer to save and exit"; kill -USR1 "$SRUN_PID" 2>/dev/null || true' USR1

srun --kill-on-bad-exit=1 --export=ALL "$PYTHON" "$TRICORN_DIR/pretrain_gpt.py" "${{ARGS[@]}}" "${{DATA_ARRAY[@]}}" "${{EXTRA_ARRAY[@]}}" &
SRUN_PID=$!
set +e
wait "$SRUN_PID"
STATUS=$?
while kill -0 "$SRUN_PID" 2>/dev/null; do  # a trapped signal ends `wait` early: wait for the tasks to finish
    wait "$SRUN_PID"
    STATUS=$?
done
set -e

echo "tricorn: trainer exited with status $STATUS"
if [[ $SIGNALLED == 1 && $STATUS == 0 ]]; then
    echo "tricorn: checkpoint saved; requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
# Requeue on a failure the next run can get past: a hang or dead rank the watchdog named (75), or a task killed
# by a signal (srun reports 128 + signal: an OOM kill, a lost node). Not on 1 or 2: rerunning cannot fix those.
CAUSE=""
if [[ -s $TRICORN_EXIT_REPORT && $(cut -d' ' -f1 "$TRICORN_EXIT_REPORT") == 75 ]]; then
    CAUSE=$(cut -d' ' -f2- "$TRICORN_EXIT_REPORT")
elif [[ $STATUS == 75 ]]; then
    CAUSE="the watchdog found a hang (exit 75; its line is in the ranks' logs in $LOG_DIR)"
elif ((STATUS > 128)); then
    CAUSE="a task was killed by a signal (srun status $STATUS; srun's 'task N: Killed' line above names the first): a dead rank or a lost node"
fi
if [[ -n $CAUSE ]]; then
    DONE=$(grep -c "^job $SLURM_JOB_ID " "$RUN_DIR/requeues.log" 2>/dev/null || true)
    if ((DONE < MAX_REQUEUES)); then
        LINE="job $SLURM_JOB_ID requeue $((DONE + 1))/$MAX_REQUEUES at $(date -u +%FT%TZ): $CAUSE"
        echo "$LINE" >>"$RUN_DIR/requeues.log"
        echo "tricorn: $LINE; resuming from the last checkpoint in $CKPT_DIR"
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    fi
    echo "tricorn: not requeueing job $SLURM_JOB_ID: MAX_REQUEUES=$MAX_REQUEUES requeues done ($RUN_DIR/requeues.log); last cause: $CAUSE"
fi
exit "$STATUS"
"""


def write_script(path: str, text: str) -> None:
    """Atomic write (temp file, then rename), executable."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)


def llama_hyperparameters(num_params: float, tokens_per_iteration: int, train_tokens: float = 1e12) -> list[str]:
    """Llama 2's recipe: AdamW(0.9, 0.95, eps 1e-5), wd 0.1, clip 1.0, 2000 warm-up, cosine to 10% of the peak."""
    lr = 1.5e-4 if num_params > 30e9 else 3e-4
    iters = int(math.ceil(train_tokens / tokens_per_iteration))
    return [
        "--bf16",
        "--train-iters",
        str(iters),
        "--lr",
        f"{lr:g}",
        "--min-lr",
        f"{lr / 10:g}",
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        "2000",
        "--weight-decay",
        "0.1",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.95",
        "--adam-eps",
        "1e-5",
        "--clip-grad",
        "1.0",
    ]


def model_args(name: str, model) -> list[str]:
    """pretrain_gpt.py flags for a model: its preset's name, or its shape (mixture-of-experts flags included)."""
    from tricorn.config import PRESETS

    window = ["--window-size", ",".join(str(x) for x in model.window_size)] if model.window_size else []
    if name in PRESETS:
        return ["--model-preset", name, *window]
    args = [*window, "--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size)]
    args += ["--ffn-hidden-size", str(model.ffn_size), "--num-attention-heads", str(model.num_attention_heads)]
    if model.group_query_attention:
        args += ["--group-query-attention", "--num-query-groups", str(model.kv_heads)]
    if model.kv_channels:
        args += ["--kv-channels", str(model.kv_channels)]
    for flag in ("swiglu", "disable_bias_linear", "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights"):
        if getattr(model, flag):
            args.append("--" + flag.replace("_", "-"))
    if model.num_experts:
        args += ["--num-experts", str(model.num_experts), "--moe-router-topk", str(model.moe_router_topk)]
        args += ["--moe-ffn-hidden-size", str(model.moe_ffn_size), "--moe-layer-freq", str(model.moe_layer_freq)]
        if model.moe_shared_expert_intermediate_size:
            args += ["--moe-shared-expert-intermediate-size", str(model.moe_shared_expert_intermediate_size)]
    return args + ["--normalization", model.normalization, "--vocab-size", str(model.vocab_size)]


def layout_args(layout, global_batch: int) -> list[str]:
    """pretrain_gpt.py flags for a planner Layout."""
    args = ["--tensor-model-parallel-size", str(layout.tp), "--pipeline-model-parallel-size", str(layout.pp)]
    if layout.vpp > 1:
        args += ["--num-virtual-stages-per-pipeline-rank", str(layout.vpp)]
    if layout.pp > 1 and layout.schedule != "1f1b":  # 1f1b: the default (interleaved with virtual stages)
        args += ["--pipeline-schedule", layout.schedule]
    if layout.first_stage_layers is not None:
        args += ["--decoder-first-pipeline-num-layers", str(layout.first_stage_layers)]
    if layout.last_stage_layers is not None:
        args += ["--decoder-last-pipeline-num-layers", str(layout.last_stage_layers)]
    if layout.cp > 1:
        args += ["--context-parallel-size", str(layout.cp), "--cp-comm-type", layout.cp_comm_type]
    if layout.ep > 1:
        args += ["--expert-model-parallel-size", str(layout.ep)]
    if layout.etp > 1:
        args += ["--expert-tensor-parallel-size", str(layout.etp)]
    if layout.sequence_parallel:
        args.append("--sequence-parallel")
    args += ["--micro-batch-size", str(layout.micro_batch), "--global-batch-size", str(global_batch)]
    if layout.recompute:
        args += ["--recompute-granularity", layout.recompute]
        if layout.recompute == "full":
            args += ["--recompute-method", "uniform", "--recompute-num-layers", "1"]
        elif tuple(layout.recompute_modules) != ("core_attn",):
            args += ["--recompute-modules", *layout.recompute_modules]
    if layout.zero_stage:
        args += ["--use-distributed-optimizer", "--overlap-param-gather"]
        if layout.zero_stage > 1:
            args += ["--zero-stage", str(layout.zero_stage)]
    if layout.dp * layout.cp > 1:
        args.append("--overlap-grad-reduce")
    return args + memory_feature_args(layout)


def memory_feature_args(layout) -> list[str]:
    """pretrain_gpt.py flags of a Layout's memory features (planning/memory_features.py)."""
    args = []
    dtypes = dict(main_params_dtype=layout.main_params_dtype, exp_avg_dtype=layout.exp_avg_dtype)
    dtypes["exp_avg_sq_dtype"] = layout.exp_avg_sq_dtype
    if layout.grads_16bit:
        dtypes["main_grads_dtype"] = "bf16"
    low = {k: v for k, v in dtypes.items() if v != "fp32"}
    if low:
        args.append("--use-precision-aware-optimizer")
        for key, value in low.items():
            args += ["--" + key.replace("_", "-"), value]
    if layout.fp8_param_gather:
        args.append("--fp8-param-gather")
    if layout.offload_layers:
        args += ["--cpu-offloading-num-layers", str(layout.offload_layers)]
    if layout.optimizer_offload:
        args.append("--optimizer-cpu-offload")
    return args
