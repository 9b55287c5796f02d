"""Everything that needs a GPU, checked in one run of a few minutes (issue 15, item 6).

    .venv/bin/python scripts/gpu_check.py [--json out.json] [--only a,b,...]   # on a GPU machine
    .venv/bin/python scripts/gpu_check.py --cpu-smoke                         # every check, tiny, on CPU

Checks (one PASS / FAIL / SKIP line each, then a JSON summary on the last line):
  a  speed: a ~1B Llama (16 layers, h 2048, seq 4096, bf16; torch SDPA = flash attention on CUDA)
     on one GPU: tokens/s, model TFLOP/s, MFU against the GPU's bf16 peak (tricorn.planning.hardware).
  b  Transformer Engine: the same model with --transformer-impl transformer_engine, bf16 and then
     --fp8-format hybrid, 50 iterations each: the mean loss of the last 10 iterations within
     BF16_BOUND (TE bf16) / FP8_BOUND (FP8) of local bf16; speed-up reported.
  c  memory: torch.cuda.max_memory_allocated() after the run vs the estimator's total (within 5%).
     With --cpu-smoke: the measured model state (memory_report.py) vs the estimator's model state.
  d  layouts (>= 2 GPUs; 2 gloo CPU ranks with --cpu-smoke): TP2, PP2 and DP2 with the distributed
     optimizer and overlapped reductions, each a pretrain_gpt.py run, each equal to 1 GPU within
     BF16_BOUND; the overlap shows as a grads-reduce-wait timer below the forward-backward one.
  e  host reads (tricorn.host_reads): 0 in non-logging iterations, at most 3 in logging ones, on CUDA.
  f  --async-save staging: pinned buffers filled on a side stream; the host returns before the copies
     land, and the copies keep the values of the save although the next step rewrites the tensors.

Set-up on a bare machine: `make venv TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"`,
then `.venv/bin/pip install -e '.[te]'`. Without a CUDA GPU and without --cpu-smoke the script
refuses with one line (exit 2). Budget: about 8 minutes on one H100/H200.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# Why these bounds: bf16 keeps 8 mantissa bits (relative roundoff 2^-9 ~ 2e-3 per op); a different GEMM
# order moves each logit by a few of those, and over 50 steps of AdamW the runs drift apart like two seeds
# of the same data order, which at loss ~7-9 stays within ~0.02. FP8 (E4M3 forward, 3 mantissa bits,
# per-tensor delayed scaling) adds quantisation noise of ~2^-4 per GEMM input: TE's own convergence
# studies keep FP8 within ~0.1 of bf16 early in training; 0.1 is that figure.
BF16_BOUND = 0.02
FP8_BOUND = 0.1
MEMORY_TOLERANCE = 0.05

GPU_MODEL = (
    "--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --seq-length 4096 --max-position-embeddings 4096 "
    "--swiglu --disable-bias-linear --untie-embeddings-and-output-weights --vocab-size 32000 --bf16 "
    "--micro-batch-size 1 --global-batch-size 8"
)
SMOKE_MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--swiglu --disable-bias-linear --untie-embeddings-and-output-weights --vocab-size 500 "
    "--micro-batch-size 2 --global-batch-size 4"
)


class Check:
    def __init__(self, name: str, what: str):
        self.name, self.what = name, what
        self.status, self.detail, self.data = "PASS", "", {}

    def fail(self, detail: str) -> None:
        self.status, self.detail = "FAIL", detail

    def skip(self, detail: str) -> None:
        self.status, self.detail = "SKIP", detail

    def line(self) -> str:
        figures = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.data.items())
        return f"{self.status} {self.name} {self.what}: {figures} {self.detail}".rstrip()


class Runner:
    """Trains in this process (one device) and measures; the multi-rank check launches pretrain_gpt.py."""

    def __init__(self, smoke: bool, iters: int):
        self.smoke = smoke
        self.iters = iters
        self.device = "cpu" if smoke else "cuda"
        self.model = SMOKE_MODEL if smoke else GPU_MODEL

    def flags(self, extra: str = "", iters: Optional[int] = None) -> list[str]:
        iters = iters or self.iters
        return f"--device {self.device} --mock-data {self.model} --train-iters {iters} --log-interval 5 --lr 1e-4 {extra}".split()

    def train(self, extra: str = "", count_reads: bool = False, iters: Optional[int] = None) -> dict:
        """Run the trainer; losses, seconds per iteration (median after warm-up), and host reads if asked."""
        from tricorn.host_reads import HostReadCounter
        from tricorn.parallel.state import destroy_parallel, init_parallel
        from tricorn.training.logging import MetricsLogger
        from tricorn.training.main import build_trainer, resolve_config

        cfg = resolve_config(self.flags(extra, iters))
        state = init_parallel(cfg)
        try:
            trainer = build_trainer(cfg, state, MetricsLogger(cfg, rank=1), with_validation=False)
            if state.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times, reads, results = [], {}, []
            for _ in range(cfg.training.train_iters):
                counter = HostReadCounter(trainer.optimizer.host_scalars(), state.device)
                start = time.perf_counter()
                with counter if count_reads else _nothing():
                    results.append(trainer.run_iteration())
                    trainer.unlogged.append(results[-1])
                    if trainer.logs_at(trainer.iteration):
                        trainer.materialize()  # the log line's one read of the interval's values
                        trainer.unlogged.clear()
                if state.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                reads[trainer.iteration] = (counter.count, trainer.logs_at(trainer.iteration))
            trainer.optimizer.wait_all()
            peak = torch.cuda.max_memory_allocated() if state.device.type == "cuda" else None
            from tricorn.training.memory_report import measure

            model_state = sum(measure(trainer.optimizer.memory_tensors(), state.device).values())
            return {
                "cfg": cfg,
                "losses": [float(r.loss) for r in results],
                "seconds": statistics.median(times[2:] or times),
                "reads": reads,
                "peak_bytes": peak,
                "model_state_bytes": model_state,
            }
        finally:
            destroy_parallel()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def tail_mean(losses: list[float]) -> float:
    return statistics.fmean(losses[-10:])


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


def check_te(r: Runner, c: Check, base: dict) -> None:
    try:
        from tricorn.parallel.te import import_te

        import_te()
    except Exception as e:  # no TE, or TE without a GPU: reported, not hidden
        c.skip(f"(Transformer Engine unavailable: {str(e).splitlines()[0][:120]})") if r.smoke else c.fail(str(e)[:200])
        return
    for label, extra, bound in (("te", "", BF16_BOUND), ("fp8", "--fp8-format hybrid", FP8_BOUND)):
        run = r.train(f"--transformer-impl transformer_engine {extra}")
        diff = abs(tail_mean(run["losses"]) - tail_mean(base["losses"]))
        c.data[f"{label}_loss_diff"] = diff
        c.data[f"{label}_speedup"] = base["seconds"] / run["seconds"]
        if not diff <= bound:
            c.fail(f"{label} loss differs from local bf16 by {diff:.4g} > {bound}")


def check_memory(r: Runner, c: Check, base: dict) -> None:
    from tricorn.planning.memory import estimate_config

    est = estimate_config(base["cfg"])
    measured, predicted = (base["model_state_bytes"], est.model_state_bytes) if r.smoke else (base["peak_bytes"], est.total_bytes)
    c.data.update(measured_mib=measured / 2**20, estimate_mib=predicted / 2**20)
    error = abs(measured - predicted) / predicted
    c.data["error_pct"] = 100 * error
    if error > MEMORY_TOLERANCE:
        c.fail(f"estimate off by {100 * error:.1f}% (> {100 * MEMORY_TOLERANCE:.0f}%)")


def check_layouts(r: Runner, c: Check, base: dict) -> None:
    if not r.smoke and torch.cuda.device_count() < 2:
        c.skip(f"(needs 2 GPUs, this machine has {torch.cuda.device_count()})")
        return
    layouts = {
        "tp2": "--tensor-model-parallel-size 2 --sequence-parallel",
        "pp2": "--pipeline-model-parallel-size 2",
        "dp2": "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --timing-log-level 1",
    }
    for name, extra in layouts.items():
        records = _launch(r, 2, extra)
        pairs = [(rec["loss"], base["losses"][rec["iteration"] - 1]) for rec in records if "loss" in rec]
        diff = max((abs(a - b) for a, b in pairs), default=float("inf"))
        c.data[f"{name}_loss_diff"] = diff
        if not diff <= BF16_BOUND:
            c.fail(f"{name} differs from 1 device by {diff:.4g}")
        if name == "dp2" and records:
            timers = records[-1].get("timers", {})
            c.data["dp2_grads_reduce_wait_ms"] = 1000 * timers.get("grads-reduce-wait", float("nan"))
            c.data["dp2_forward_backward_ms"] = 1000 * timers.get("forward-backward", float("nan"))


def _launch(r: Runner, nproc: int, extra: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone"]
        cmd += [str(ROOT / "pretrain_gpt.py"), *r.flags(extra), "--metrics-file", metrics]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(extra.split()[:2])}: exit {done.returncode}: {done.stderr.strip()[-300:]}")
        return [json.loads(line) for line in Path(metrics).read_text().splitlines()]


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


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


CHECKS: dict[str, tuple[str, Callable[[Runner, Check, dict], None]]] = {
    "a": ("speed", check_speed),
    "b": ("transformer-engine", check_te),
    "c": ("memory", check_memory),
    "d": ("layouts", check_layouts),
    "e": ("host-reads", check_host_reads),
    "f": ("async-save-staging", check_async_staging),
}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="run every check at tiny size on the CPU")
    ap.add_argument("--only", default=",".join(CHECKS), help="comma-separated subset of the checks a-e")
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
    torch.manual_seed(0)
    base = runner.train()  # local bf16 (fp32 on CPU): the reference every check compares with
    summary = {"device": torch.cuda.get_device_name() if not args.cpu_smoke else "cpu", "checks": {}}
    for key in args.only.split(","):
        name, fn = CHECKS[key]
        c = Check(key, name)
        try:
            fn(runner, c, base)
        except Exception as e:  # one failing check must not hide the others
            c.fail(f"{type(e).__name__}: {str(e)[:300]}")
        print(c.line(), flush=True)
        summary["checks"][name] = {"status": c.status, **c.data, **({"detail": c.detail} if c.detail else {})}
    text = json.dumps(summary, default=float)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if all(v["status"] != "FAIL" for v in summary["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
