"""The equivalence harness: run any layout as N gloo processes on CPU and read back its metrics.

Every parallel feature is tested the same way: the per-iteration loss (and grad
norm) of a layout must equal the single-process run on the same tokens.
Each run gets its own rendezvous port and directory, so tests never collide.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import zygote_client as zygote

ROOT = Path(__file__).resolve().parent.parent
ENTRY = ROOT / "pretrain_gpt.py"

# The Foundation issue's FLAGS (TensorBoard dir added per run when asked for).
BASE_FLAGS = (
    "--device cpu --mock-data --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 --train-iters 5 --lr 1e-3 "
    "--vocab-size 500 --log-interval 1"
).split()

# Why relative 1e-5 holds on any CPU yet catches bugs (fp32 unit roundoff u = 6e-8).
# A layout changes only the order of fp32 sums: TP/CP shard the dot products and reduce the
# partial sums, DP/PP split the batch and reduce the gradients, and each CPU blocks its matmuls
# its own way. Reordering a sum of N terms (torch and gloo sum in trees) moves it by at most
# ~log2(N) * u * sum|terms|. The lm loss (~6.2) is the mean of 256 positive token losses, each a
# logsumexp over 500 logits of <= 256-term dot products: |error| <~ 10 * u * 6 ~ 4e-6 in the worst
# case (~1e-6 relative, a few ulps of fp32 at 6, ulp = 4.8e-7); the grad norm (a root of a sum of
# ~1e5 positive squares of gradients that are themselves ~1e3-term sums) likewise ~1e-6. Adam
# normalises each step by the gradient's scale, so five steps carry these relative errors along
# without growing them much. 1e-5 relative is 6e-5 absolute on the loss (~125 fp32 ulps): ~10x the
# worst-case reorder error, while a real bug (a dropped microbatch, a gradient reduced twice, a
# wrong shard) changes the loss or grad norm by 1e-3 relative or more.
FP32_RTOL = 1e-5


@dataclass
class RunResult:
    returncode: int
    records: list[dict] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records if "loss" in r]

    @property
    def grad_norms(self) -> list[float]:
        return [r["grad_norm"] for r in self.records if "grad_norm" in r]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_flag(flags: list[str], name: str, value: str) -> list[str]:
    """flags with `name` set to `value` (replacing an existing value)."""
    out = list(flags)
    if name in out:
        out[out.index(name) + 1] = value
    else:
        out += [name, value]
    return out


def _port_clash(stderr: str) -> bool:
    """Another process took our rendezvous port between picking and binding it: retry on a new one."""
    return "address already in use" in stderr.lower() or "EADDRINUSE" in stderr


def rank_env(rank: int, nproc: int, port: int, env: Optional[dict] = None) -> dict:
    """torchrun's environment for one rank (one thread per rank: more ranks than cores)."""
    return {
        **os.environ,
        **(env or {}),
        "RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }


def spawn_ranks(
    cmd: list[str],
    nproc: int,
    timeout: float,
    cwd: Optional[Path] = None,
    env: Optional[dict] = None,
    fresh: bool = False,
) -> list[tuple[int, str, str]]:
    """Start `cmd` as nproc ranks with torchrun's environment on a fresh port; (exit code, stdout, stderr) per rank.

    Python scripts run as forks of the fork server (tests/zygote.py: torch is imported once, not per rank)
    unless `fresh` - real processes, for what happens at interpreter start-up and exit."""
    port = free_port()
    envs = [rank_env(rank, nproc, port, env) for rank in range(nproc)]
    if not fresh and zygote.usable(cmd, envs[0]):
        return zygote.run(cmd, envs, cwd or Path.cwd(), timeout)
    procs = [subprocess.Popen(cmd, cwd=cwd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for e in envs]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def run_layout(
    flags: list[str],
    nproc: int,
    workdir: Path,
    timeout: float = 240,
    check: bool = True,
    env: Optional[dict] = None,
    attempts: int = 3,
) -> RunResult:
    """Launch `pretrain_gpt.py flags` as `nproc` ranks (RANK/WORLD_SIZE env, like torchrun) and collect metrics."""
    workdir.mkdir(parents=True, exist_ok=True)
    metrics = workdir / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    cmd = [sys.executable, str(ENTRY), *flags, "--metrics-file", str(metrics)]
    ranks = spawn_ranks(cmd, nproc, timeout, cwd=workdir, env=env)
    code = max(abs(rc) for rc, _, _ in ranks)
    result = RunResult(code, stdout=ranks[0][1], stderr="\n".join(err for _, _, err in ranks))
    if metrics.exists():
        result.records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if code != 0 and _port_clash(result.stderr) and attempts > 1:
        return run_layout(flags, nproc, workdir, timeout, check, env, attempts - 1)
    if check and code != 0:
        raise AssertionError(f"run failed (exit {code}) with {nproc} ranks: {' '.join(flags)}\n{result.stderr[-3000:]}")
    return result


_reference_cache: dict[tuple, RunResult] = {}


def reference(flags: list[str], workdir: Path) -> RunResult:
    """The single-process run of `flags`, computed once per test session."""
    key = tuple(flags)
    if key not in _reference_cache:
        _reference_cache[key] = run_layout(flags, 1, workdir)
    return _reference_cache[key]


def assert_close(actual: list[float], expected: list[float], rtol: float = FP32_RTOL, what: str = "loss") -> None:
    assert len(actual) == len(expected) and expected, f"{what}: got {len(actual)} values, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected), start=1):
        assert abs(a - e) <= rtol * abs(e), f"{what} at iteration {i}: {a!r} vs single-process {e!r} (rtol {rtol})"


def assert_equivalent(
    flags: list[str],
    nproc: int,
    tmp_path: Path,
    extra: list[str],
    rtol: float = FP32_RTOL,
    reference_extra: Optional[list[str]] = None,
) -> RunResult:
    """Run `flags + extra` on nproc ranks; its losses and grad norms must equal the 1-process run."""
    ref = reference(flags + (reference_extra or []), tmp_path / "ref")
    run = run_layout(flags + extra, nproc, tmp_path / "run")
    assert_close(run.losses, ref.losses, rtol, "lm loss")
    assert_close(run.grad_norms, ref.grad_norms, rtol, "grad norm")
    return run


def run_script(script: Path, nproc: int, args: Optional[list[str]] = None, timeout: float = 120) -> str:
    """Run a worker script as nproc gloo ranks (env rendezvous); fail with its stderr if any rank fails."""
    ranks = spawn_ranks([sys.executable, str(script), *(args or [])], nproc, timeout)
    failed = [(rank, rc, err) for rank, (rc, _out, err) in enumerate(ranks) if rc != 0]
    if failed:
        # The first traceback is usually the cause; the other ranks then report closed connections.
        rank, code, err = next((f for f in failed if "Traceback" in f[2] and "Connection closed" not in f[2]), failed[0])
        raise AssertionError(f"{script.name} failed on rank {rank} (exit {code}):\n{err[-3000:]}")
    return ranks[0][1]


def demo_corpus_module():
    """scripts/demo_corpus.py (a script, not a package module), imported for tests that build small corpora."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_corpus", ROOT / "scripts" / "demo_corpus.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["demo_corpus"] = module
    spec.loader.exec_module(module)
    return module
