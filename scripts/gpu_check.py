"""Everything that needs a GPU, checked in one run of a few minutes (issues 15 and 26).

    .venv/bin/python scripts/gpu_check.py [--json out.json] [--only a,b,...]   # on a GPU machine
    .venv/bin/python scripts/gpu_check.py --cpu-smoke                         # every check, tiny, on CPU

Checks (one PASS / FAIL / SKIP line each, an INFO line for the CUDA context, then a JSON summary last):
  a  speed: a ~1B Llama (16 layers, h 2048, seq 4096, bf16; torch SDPA = flash attention on CUDA)
     on one GPU: tokens/s, model TFLOP/s, MFU against the GPU's bf16 peak (tricorn.planning.hardware).
  b  FP8: the same model with Transformer Engine in bf16 (--transformer-impl transformer_engine), TE FP8
     (--fp8-format hybrid --fp8-recipe delayed) and the native FP8 path (--transformer-impl local
     --fp8-format hybrid --fp8-recipe tensorwise): each one's speed-up over local bf16 and its loss gap (mean
     of the last 10 of the same iterations) within BF16_BOUND (TE bf16) / FP8_BOUND (FP8). An engine that
     cannot run here (TE not installed or without FP8 on this GPU; the native path refused) is skipped with
     its reason; SKIP (one line) when none ran.
  c  memory: torch.cuda.max_memory_allocated() (which holds no CUDA context) vs the estimator's total minus
     its fixed context constant (planning/memory.py CUDA_OVERHEAD_BYTES), within 5%. The context itself is
     measured apart (used device memory before CUDA initialises, from NVML, and after, from mem_get_info)
     and printed on its own INFO line next to the constant. --cpu-smoke: model state vs the estimate's.
  d  layouts: TP2, PP2 and DP2 with the distributed optimizer and overlapped reductions, each a
     pretrain_gpt.py run of 2 ranks equal to 1 device within BF16_BOUND; DP2 also without overlap, and
     grads-reduce-wait (CUDA events, --timing-log-level 1) with overlap must be below it without. With one
     GPU, DP2 runs anyway as two processes sharing it (NCCL); if NCCL refuses, SKIP with its exact error.
     --cpu-smoke: the DP2 pair as 2 gloo CPU ranks (overlap figures reported, not compared: 2 shared cores).
  e  host reads (tricorn.host_reads): 0 in non-logging iterations, at most 3 in logging ones.
  f  --async-save staging: pinned buffers filled on a side stream; the host returns before the copies
     land, and the copies keep the values of the save although the next step rewrites the tensors.
  g  fp16: --fp16 from a loss scale that overflows, so fused AdamW's found_inf skips steps on the device;
     at least one step skipped, later ones taken, every taken step's loss finite.
  h  optimizer CPU offload: --optimizer-cpu-offload, master weights and Adam state in pinned host memory,
     loss within BF16_BOUND of the base run.
  i  moe bf16: a small MoE (4 experts, top-2) in bf16, the grouped-GEMM path on CUDA: finite loss.
  j  attention kernel: the step (MHA and GQA, bf16) under sdpa_kernel([FLASH_ATTENTION,
     EFFICIENT_ATTENTION]), so a fall-back to the math kernel raises.
  k  sync debug: torch.cuda.set_sync_debug_mode("error") around every non-logging iteration (dense and
     MoE), so any synchronising CUDA call raises. --cpu-smoke: the host-read counter stands in.
  l  async-save resume: --async-save --save-interval 1, then a resume from the middle checkpoint
     (--ckpt-step) whose losses must equal the uninterrupted run's bitwise.
  m  activation offload: --cpu-offloading-num-layers 1 under k's sync guard (the side-stream copies make the host
     wait nowhere), loss within BF16_BOUND of the base run, and on a GPU a lower allocator peak than the base run's.

Set-up on a bare machine: `make venv TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"`,
then `.venv/bin/pip install -e '.[te]'`. Without a CUDA GPU and without --cpu-smoke the script
refuses with one line (exit 2). Budget: at most 8 minutes on one H100/H200 (docs/gpu-check.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # gpu_check_parts, beside this script

import torch  # noqa: E402
from gpu_check_parts import (  # noqa: E402
    Check,
    Guards,
    NcclRefused,
    _bf16,
    _finite,
    _free_port,
    _ReadsAsSyncs,
    _sync_errors,
    _without_bf16,
    context_line,
    fp8_support,
    tail_mean,
)

# Why these bounds: bf16 keeps 8 mantissa bits (relative roundoff 2^-9 ~ 2e-3 per op); a different GEMM
# order moves each logit by a few of those, and over 50 steps of AdamW the runs drift apart like two seeds
# of the same data order, which at loss ~7-9 stays within ~0.02. FP8 (E4M3 forward, 3 mantissa bits,
# per-tensor delayed or current scaling) adds quantisation noise of ~2^-4 per GEMM input: TE's own convergence
# studies keep FP8 within ~0.1 of bf16 early in training; 0.1 is that figure.
BF16_BOUND = 0.02
FP8_BOUND = 0.1
MEMORY_TOLERANCE = 0.05

GPU_MODEL = (
    "--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --seq-length 4096 --max-position-embeddings 4096 "
    "--swiglu --disable-bias-linear --untie-embeddings-and-output-weights --vocab-size 32000 --bf16 "
    "--micro-batch-size 1 --global-batch-size 8"
)
# The checks about a code path (layouts, fp16, offload, MoE, kernels, resume) on a ~100M model: seconds per run,
# so the whole script stays within its 8 minutes; the reductions are still long enough to overlap.
SMALL_GPU_MODEL = (
    "--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 "
    "--swiglu --disable-bias-linear --untie-embeddings-and-output-weights --vocab-size 32000 --bf16 "
    "--micro-batch-size 2 --global-batch-size 8"
)
SMOKE_MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--swiglu --disable-bias-linear --untie-embeddings-and-output-weights --vocab-size 500 "
    "--micro-batch-size 2 --global-batch-size 4"
)
GQA = "--group-query-attention --num-query-groups 2"
MOE = "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 128"


class Runner:
    """Trains in this process (one device) and measures; the multi-rank checks launch pretrain_gpt.py."""

    def __init__(self, smoke: bool, iters: int):
        self.smoke = smoke
        self.iters = iters
        self.device = "cpu" if smoke else "cuda"
        self.model = SMOKE_MODEL if smoke else GPU_MODEL
        self.small = SMOKE_MODEL if smoke else SMALL_GPU_MODEL  # checks about a code path, not about speed
        self.context: Optional[Any] = None  # measurements.CudaContext on a GPU
        self._small_base: Optional[dict] = None

    def small_base(self) -> dict:
        """The 1-device run of the small model, the reference of the checks that use it (run once)."""
        if self._small_base is None:
            self._small_base = self.train(model=self.small)
        return self._small_base

    def flags(self, extra: str = "", iters: Optional[int] = None, model: Optional[str] = None) -> list[str]:
        iters = iters or self.iters
        model = model or self.model
        return f"--device {self.device} --mock-data {model} --train-iters {iters} --log-interval 5 --lr 1e-4 {extra}".split()

    def train(
        self,
        extra: str = "",
        count_reads: bool = False,
        iters: Optional[int] = None,
        model: Optional[str] = None,
        guards: Guards = Guards(),
        probe: Optional[Callable[[Any], dict]] = None,
    ) -> dict:
        """Run the trainer; losses, seconds per iteration (median after warm-up), host reads if asked, and what
        `probe(trainer)` returns after the run."""
        from tricorn.host_reads import HostReadCounter
        from tricorn.parallel.state import destroy_parallel, init_parallel
        from tricorn.training.logging import MetricsLogger
        from tricorn.training.main import build_trainer, resolve_config
        from tricorn.training.memory_report import measure

        cfg = resolve_config(self.flags(extra, iters, model))
        state = init_parallel(cfg)
        try:
            trainer = build_trainer(cfg, state, MetricsLogger(cfg, rank=1), with_validation=False)
            if state.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times, reads, results = [], {}, []
            for _ in range(cfg.training.train_iters):
                counter = HostReadCounter(trainer.optimizer.host_scalars(), state.device)
                logs = trainer.logs_at(trainer.iteration + 1)
                start = time.perf_counter()
                with counter if count_reads else contextlib.nullcontext(), guards.step():
                    with guards.quiet(trainer) if not logs and trainer.iteration else contextlib.nullcontext():
                        results.append(trainer.run_iteration())
                    trainer.unlogged.append(results[-1])
                    if logs:
                        trainer.materialize()  # the log line's one read of the interval's values
                        trainer.unlogged.clear()
                if state.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                reads[trainer.iteration] = (counter.count, logs)
            trainer.optimizer.wait_all()
            peak = torch.cuda.max_memory_allocated() if state.device.type == "cuda" else None
            model_state = sum(measure(trainer.optimizer.memory_tensors(), state.device).values())
            return {
                "cfg": cfg,
                "losses": [float(r.loss) for r in results],
                "skipped": [bool(r.skipped) for r in results],
                "seconds": statistics.median(times[2:] or times),
                "reads": reads,
                "peak_bytes": peak,
                "model_state_bytes": model_state,
                **(probe(trainer) if probe else {}),
            }
        finally:
            destroy_parallel()


# ---------------------------------------------------------------- checks


def check_speed(r: Runner, c: Check, base: dict) -> None:
    from tricorn.planning.flops import iteration_flops_for_config, mfu, tflops_per_device
    from tricorn.planning.hardware import detect_gpu_type, peak_tflops

    cfg = base["cfg"]
    tokens = cfg.training.global_batch_size * cfg.model.seq_length
    flops = iteration_flops_for_config(cfg).model
    c.data["tokens_per_s"] = tokens / base["seconds"]
    c.data["tflops"] = tflops_per_device(flops, base["seconds"], 1)
    peak = None if r.smoke else peak_tflops(detect_gpu_type(), "bf16")
    if peak:
        c.data["mfu_pct"] = 100 * mfu(flops, base["seconds"], 1, peak)
    if not all(map(_finite, base["losses"])):
        c.fail("loss not finite")


# The FP8 engines of check b against local bf16: (label, flags, loss bound, engine). mxfp8 needs a Blackwell GPU.
FP8_RUNS = [
    ("te_bf16", "--transformer-impl transformer_engine", BF16_BOUND, "transformer_engine"),
    ("te_fp8", "--transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe delayed", FP8_BOUND, "transformer_engine"),
    ("native_fp8", "--transformer-impl local --fp8-format hybrid --fp8-recipe tensorwise", FP8_BOUND, "local"),
]


def engine_unavailable(r: Runner, extra: str, engine: str) -> Optional[str]:
    """Why an engine cannot run here (one line), or None: TE must import and run FP8 on this GPU; either engine's
    config must pass tricorn's own validation (an engine not built into this tricorn is refused there)."""
    from tricorn.config_args import config_from_args
    from tricorn.validation import validate

    if engine == "transformer_engine":
        try:
            from tricorn.parallel.te import import_te

            te = import_te()
        except Exception as e:  # no TE, or TE without a GPU
            return f"Transformer Engine unavailable: {str(e).splitlines()[0][:160]}"
        fp8_ok, why = fp8_support(te)
        if "--fp8-format" in extra and not fp8_ok:
            return f"TE has no FP8 engine on this GPU: {why[:160]}"
    errors = [
        e for e in validate(config_from_args(r.flags(extra, model=_bf16(r.model)), world_size=1)) if "training data" not in e
    ]
    return errors[0][:200] if errors else None


def check_fp8(r: Runner, c: Check, base: dict) -> None:
    """Both FP8 engines (and TE in bf16) on one device: speed-up over local bf16 and the loss gap, each run the
    same iterations; an engine that cannot run here is skipped with its one-line reason."""
    skipped = {label: engine_unavailable(r, extra, engine) for label, extra, _, engine in FP8_RUNS}
    skipped = {label: why for label, why in skipped.items() if why is not None}
    if len(skipped) < len(FP8_RUNS) and "--bf16" not in r.model.split():
        base = r.train(model=_bf16(r.model))  # --cpu-smoke's base is fp32: FP8 compares with bf16
    for label, extra, bound, _ in FP8_RUNS:
        if label in skipped:
            continue
        run = r.train(extra, model=_bf16(r.model))
        diff = abs(tail_mean(run["losses"]) - tail_mean(base["losses"]))
        c.data[f"{label}_loss_diff"] = diff
        c.data[f"{label}_speedup"] = base["seconds"] / run["seconds"]
        if not diff <= bound:
            c.fail(f"{label} loss differs from local bf16 by {diff:.4g} > {bound}")
    if skipped and c.status == "PASS":
        detail = "; ".join(f"{label} skipped ({why})" for label, why in skipped.items())
        if len(skipped) == len(FP8_RUNS):
            c.skip(f"(no engine ran: {detail})")
        else:
            c.detail = f"({detail})"


def check_memory(r: Runner, c: Check, base: dict) -> None:
    from tricorn.planning.memory import estimate_config

    est = estimate_config(base["cfg"])
    if r.smoke:
        measured, predicted = base["model_state_bytes"], est.model_state_bytes
    else:  # like with like: the allocator's peak holds no context, so neither does the estimate it is held to
        measured, predicted = base["peak_bytes"], est.total_bytes - est.overhead_bytes
    c.data.update(measured_mib=measured / 2**20, estimate_mib=predicted / 2**20)
    if r.context is not None and r.context.bytes is not None:
        c.data.update(context_mib=r.context.bytes / 2**20, context_estimate_mib=est.overhead_bytes / 2**20)
    error = abs(measured - predicted) / predicted
    c.data["error_pct"] = 100 * error
    if error > MEMORY_TOLERANCE:
        c.fail(f"estimate off by {100 * error:.1f}% (> {100 * MEMORY_TOLERANCE:.0f}%)")


def _launch(r: Runner, nproc: int, extra: str, iters: Optional[int] = None, same_device: bool = False) -> list[dict]:
    """pretrain_gpt.py as `nproc` ranks (torchrun's environment, set here so that every rank can be put on GPU 0
    when `same_device`); the metrics records of rank 0."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        cmd = [sys.executable, str(ROOT / "pretrain_gpt.py"), *r.flags(extra, iters, r.small), "--metrics-file", metrics]
        procs, logs = [], []
        for rank in range(nproc):
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": str(nproc)}
            env.update(LOCAL_RANK="0" if same_device else str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            logs.append(open(os.path.join(tmp, f"rank{rank}.log"), "w+"))
            procs.append(subprocess.Popen(cmd, env=env, stdout=logs[-1], stderr=subprocess.STDOUT, text=True))
        try:
            codes = [p.wait(timeout=600) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        output = []
        for log in logs:
            log.seek(0)
            output.append(log.read())
            log.close()
        if any(codes):
            text = "\n".join(output)
            refusal = next(
                (line.strip() for line in text.splitlines() if "Duplicate GPU" in line or "ncclInvalidUsage" in line), None
            )
            if same_device and refusal:
                raise NcclRefused(refusal)
            raise RuntimeError(f"{' '.join(extra.split()[:2])}: exit {max(codes)}: {text.strip()[-300:]}")
        return [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]


def _phase_ms(records: list[dict], phase: str) -> float:
    """Mean per-iteration time of `phase` over the log lines after the first (warm-up), in ms."""
    values = [rec["timers"][phase] for rec in records[1:] if phase in rec.get("timers", {})]
    return 1000 * statistics.fmean(values) if values else float("nan")


def check_layouts(r: Runner, c: Check, base: dict) -> None:
    shared = not r.smoke and torch.cuda.device_count() < 2
    dp = "--use-distributed-optimizer --timing-log-level 1"
    layouts = {
        "tp2": "--tensor-model-parallel-size 2 --sequence-parallel",
        "pp2": "--pipeline-model-parallel-size 2",
        "dp2": f"{dp} --overlap-grad-reduce --overlap-param-gather",
        "dp2_no_overlap": dp,
    }
    # One GPU: the DP pair runs anyway, two NCCL ranks on GPU 0 (TP/PP need a GPU each to mean much). The CPU smoke
    # run takes the same path (TP2/PP2 equivalence has its own tests; each launch here costs two interpreters).
    if shared or r.smoke:
        layouts = {k: v for k, v in layouts.items() if k.startswith("dp2")}
        c.data["ranks_on_one_gpu" if shared else "ranks"] = 2
    reference = r.small_base()["losses"]
    records: dict[str, list[dict]] = {}
    for name, extra in layouts.items():
        try:
            records[name] = _launch(r, 2, extra, same_device=shared)
        except NcclRefused as e:
            c.skip(f"(NCCL refused two ranks on one GPU: {e})")
            return
        pairs = [(rec["loss"], reference[rec["iteration"] - 1]) for rec in records[name] if "loss" in rec]
        diff = max((abs(a - b) for a, b in pairs), default=float("inf"))
        c.data[f"{name}_loss_diff"] = diff
        if not diff <= BF16_BOUND:
            c.fail(f"{name} differs from 1 device by {diff:.4g}")
    on, off = (_phase_ms(records[k], "grads-reduce-wait") for k in ("dp2", "dp2_no_overlap"))
    c.data.update(grads_reduce_wait_overlap_ms=on, grads_reduce_wait_no_overlap_ms=off)
    c.data["forward_backward_ms"] = _phase_ms(records["dp2"], "forward-backward")
    # Events on the compute stream see only the wait left after the overlapped reductions (timers.py); on the
    # CPU smoke run two gloo ranks share two busy cores, so the figures are reported but not compared there.
    if not r.smoke and not on < off:
        c.fail(f"grads-reduce-wait with overlap {on:.3g} ms is not below without {off:.3g} ms")


def check_host_reads(r: Runner, c: Check, base: dict) -> None:
    # A run of its own: the counting modes see every operator, which would slow the timed runs.
    reads = r.train(count_reads=True, iters=10)["reads"]
    quiet = [n for it, (n, logs) in reads.items() if it > 1 and not logs]
    logging = [n for it, (n, logs) in reads.items() if it > 1 and logs]
    c.data.update(non_logging_max=max(quiet, default=0), logging_max=max(logging, default=0))
    if any(quiet) or any(n > 3 for n in logging):
        c.fail(f"host reads per iteration {reads}")


def check_async_staging(r: Runner, c: Check, base: dict) -> None:
    """--async-save staging (tricorn/checkpoint/staging.py): the host returns before the copies finish, the copies hold
    the values as of the save even though the step after it rewrites the tensors in place."""
    from tricorn.checkpoint.staging import HostStaging

    n = 1 << (16 if r.smoke else 26)  # 8 x 256 MiB of fp32 on a GPU: long enough to see the copies run async
    local = {f"t{i}": (torch.randn(n, device=r.device), None) for i in range(8)}
    expected = {k: t.to("cpu", copy=True) for k, (t, _) in local.items()}
    staging = HostStaging()
    start = time.perf_counter()
    staged = staging.stage(local)
    c.data["stage_return_ms"] = 1000 * (time.perf_counter() - start)
    if staged.done is not None:
        torch.cuda.current_stream().wait_event(staged.done)  # what Trainer.step_fences does before the step
    for t, _ in local.values():
        t.add_(1.0)  # the next optimizer step writing in place
    staged.wait()
    c.data["copy_done_ms"] = 1000 * (time.perf_counter() - start)
    if not all(torch.equal(staged.tensors[k][0], v) for k, v in expected.items()):
        c.fail("a staged copy saw the step after the save")
    if not r.smoke and not all(buf.is_pinned() for buf, _ in staged.tensors.values()):
        c.fail("staging buffers are not pinned")


def check_fp16(r: Runner, c: Check, base: dict) -> None:
    # 2^24 overflows the first few steps' fp16 gradients; --hysteresis 1 halves the scale at each overflow, so the
    # run shows found_inf both true (skipped on the device) and false (stepped) within its 16 iterations.
    run = r.train("--fp16 --initial-loss-scale 16777216 --hysteresis 1", iters=16, model=_without_bf16(r.small))
    skipped = sum(run["skipped"])
    taken = [loss for loss, s in zip(run["losses"], run["skipped"]) if not s]
    c.data.update(skipped=skipped, stepped=len(taken), last_loss=run["losses"][-1])
    if not skipped or not taken or not all(map(_finite, taken)):
        c.fail(f"expected skipped and taken steps with finite losses: skipped {run['skipped']}, losses {run['losses']}")


def _offload_probe(trainer: Any) -> dict:
    shards = [s for s in trainer.optimizer.shards if s.offloaded]
    pinned = all(t.is_pinned() for s in shards for t in (s.master, s.exp_avg, s.exp_avg_sq))
    return {"offloaded_shards": len(shards), "pinned": pinned}


def check_offload(r: Runner, c: Check, base: dict) -> None:
    # 20 iterations: the CPU steps the ~100M master weights at host speed; compared iteration by iteration.
    run = r.train(
        "--use-distributed-optimizer --optimizer-cpu-offload", iters=min(20, r.iters), model=r.small, probe=_offload_probe
    )
    diff = max(abs(a - b) for a, b in zip(run["losses"], r.small_base()["losses"]))
    c.data.update(loss_diff=diff, offloaded_shards=run["offloaded_shards"], pinned=run["pinned"])
    if not run["offloaded_shards"]:
        c.fail("no optimizer shard was offloaded")
    elif not r.smoke and not run["pinned"]:
        c.fail("offloaded master weights or Adam state are not in pinned memory")
    elif not diff <= BF16_BOUND:
        c.fail(f"loss differs from the run without offload by {diff:.4g} > {BF16_BOUND}")


def check_moe(r: Runner, c: Check, base: dict) -> None:
    run = r.train(MOE, iters=min(20, r.iters), model=_bf16(r.small))
    c.data.update(last_loss=run["losses"][-1], seconds_per_iteration=run["seconds"])
    if not all(map(_finite, run["losses"])):
        c.fail(f"loss not finite: {run['losses']}")


def check_attention_kernel(r: Runner, c: Check, base: dict) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fast_kernels_only():
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])

    for name, extra in (("mha", ""), ("gqa", GQA)):
        run = r.train(extra, iters=6, model=_bf16(r.small), guards=Guards(step=fast_kernels_only))
        c.data[f"{name}_last_loss"] = run["losses"][-1]


def check_sync_debug(r: Runner, c: Check, base: dict) -> None:
    guard = Guards(quiet=_ReadsAsSyncs if r.smoke else _sync_errors)
    # MoE runs sync-free only on torch's grouped-GEMM fast path (bf16, compute capability >= 9.0, issue 26 item 3);
    # elsewhere its per-expert loop reads the row counts once per layer and microbatch, by design.
    grouped = not r.smoke and torch.cuda.get_device_capability() >= (9, 0)
    legs = [("dense", "")] + ([("moe", MOE)] if r.smoke or grouped else [])
    for name, extra in legs:
        run = r.train(extra, iters=10, model=_bf16(r.small), guards=guard)
        c.data[f"{name}_iterations"] = len(run["losses"])
    if r.smoke:
        c.data["moe_loop_reads"] = len(_ReadsAsSyncs.tolerated)
    elif not grouped:
        c.data["moe"] = "not run (no grouped-GEMM fast path below compute capability 9.0)"


def check_async_resume(r: Runner, c: Check, base: dict) -> None:
    k = 3
    with tempfile.TemporaryDirectory() as ckpt:
        full = _launch(r, 1, f"--save {ckpt} --async-save --save-interval 1 --log-interval 1", iters=2 * k)
        resumed = _launch(r, 1, f"--load {ckpt} --ckpt-step {k} --log-interval 1", iters=2 * k)
    expected = {rec["iteration"]: rec["loss"] for rec in full if "loss" in rec and rec["iteration"] > k}
    got = {rec["iteration"]: rec["loss"] for rec in resumed if "loss" in rec}
    c.data.update(resumed_at=k, compared=len(got))
    if got != expected or not got:
        c.fail(f"resumed losses {got} differ from the uninterrupted run's {expected}")


def check_activation_offload(r: Runner, c: Check, base: dict) -> None:
    from tricorn import pinned

    # --cpu-smoke: the CPU takes CUDA's branches (pinned host buffers, non-blocking copies) under pinned.stand_in().
    guards = Guards(step=pinned.stand_in, quiet=_ReadsAsSyncs) if r.smoke else Guards(quiet=_sync_errors)
    run = r.train("--cpu-offloading-num-layers 1", model=r.small, guards=guards)
    base_run = r.small_base()
    diff = max(abs(a - b) for a, b in zip(run["losses"], base_run["losses"]))
    c.data.update(loss_diff=diff)
    if run["peak_bytes"] is not None:
        c.data.update(peak_mib=run["peak_bytes"] / 2**20, base_peak_mib=base_run["peak_bytes"] / 2**20)
    if not diff <= BF16_BOUND:
        c.fail(f"loss differs from the run without offload by {diff:.4g} > {BF16_BOUND}")
    elif run["peak_bytes"] is not None and not run["peak_bytes"] < base_run["peak_bytes"]:
        c.fail("offloading a layer's activations did not lower the allocator's peak")


CHECKS: dict[str, tuple[str, Callable[[Runner, Check, dict], None]]] = {
    "a": ("speed", check_speed),
    "b": ("fp8", check_fp8),
    "c": ("memory", check_memory),
    "d": ("layouts", check_layouts),
    "e": ("host-reads", check_host_reads),
    "f": ("async-save-staging", check_async_staging),
    "g": ("fp16", check_fp16),
    "h": ("cpu-offload", check_offload),
    "i": ("moe-bf16", check_moe),
    "j": ("attention-kernel", check_attention_kernel),
    "k": ("sync-debug", check_sync_debug),
    "l": ("async-save-resume", check_async_resume),
    "m": ("activation-offload", check_activation_offload),
}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="run every check at tiny size on the CPU")
    ap.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of the checks {','.join(CHECKS)}")
    ap.add_argument("--iters", type=int, default=None, help="iterations per run (default 50; 10 with --cpu-smoke)")
    ap.add_argument("--json", help="also write the JSON summary to this file")
    args = ap.parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print(
            "gpu_check: error: no CUDA GPU visible (torch.cuda.is_available() is False); run it on a GPU machine, or pass --cpu-smoke",
            file=sys.stderr,
        )
        return 2
    runner = Runner(args.cpu_smoke, args.iters or (10 if args.cpu_smoke else 50))
    from tricorn.training.measurements import measure_cuda_context

    runner.context = None if args.cpu_smoke else measure_cuda_context()  # before anything else touches the GPU
    torch.manual_seed(0)
    base = runner.train()  # local bf16 (fp32 on CPU): the reference every check compares with
    if args.cpu_smoke:
        runner._small_base = base  # one model at smoke size: the small reference is the base run
    print(context_line(runner.context), flush=True)
    summary = {"device": torch.cuda.get_device_name() if not args.cpu_smoke else "cpu", "checks": {}}
    for key in args.only.split(","):
        name, fn = CHECKS[key]
        c = Check(key, name)
        started = time.perf_counter()
        try:
            fn(runner, c, base)
        except Exception as e:  # one failing check must not hide the others
            c.fail(f"{type(e).__name__}: {str(e)[:300]}")
        c.data["check_s"] = time.perf_counter() - started
        print(c.line(), flush=True)
        summary["checks"][name] = {"status": c.status, **c.data, **({"detail": c.detail} if c.detail else {})}
    text = json.dumps(summary, default=float)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if all(v["status"] != "FAIL" for v in summary["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
