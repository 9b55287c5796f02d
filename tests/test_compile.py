"""--torch-compile (issue 27): every layer compiled, equal to eager at every layout, compiled once, bytes counted.

Bounds. Inductor computes the same function as eager with its own fusion and summation order (a fused norm
reduces its row in another order; the GEMMs and attention stay aten's). So:

- float64, one process, in this process (``test_float64_compiled_layers_equal_eager``): the loss and every
  gradient within 1e-10 relative (norm-wise). A reordered sum of N terms moves by at most ~log2(N) u sum|terms|
  with u = 1.1e-16; over a 2-layer model's forward and backward the condition number of what we compare stays
  well below 1e4, so reordering alone gives < 1e-11 - while a wrong fusion, a dropped term or a saved tensor
  read after it was overwritten moves the result by > 1e-4.
- fp32, every layout through the trainer (tests/harness.py): compiled runs equal the eager single-process run
  within harness.FP32_RTOL, the bound every layout already meets - its argument (reordered fp32 sums, a few
  ulps of the loss, carried but not grown by Adam over 5 steps) covers inductor's reordering unchanged, which
  is one more reordering of the same sums.

Cost: the layers of one shape share a graph, and one module-scoped TORCHINDUCTOR_CACHE_DIR lets the runs whose
layers have the same shapes (single, PP2, DP2, ZeRO-3, the resume) load the compiled code instead of
compiling it again; one compile thread (no worker pool to start).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pytest
import torch
from harness import BASE_FLAGS, FP32_RTOL, RunResult, assert_close, reference, run_layout, with_flag

from tricorn.config_args import config_from_args
from tricorn.planning.activations import layout_layer_bytes
from tricorn.planning.layout import Layout

COMPILE = ["--torch-compile"]
# The Llama block (SwiGLU, GQA, RMSNorm, RoPE) on the harness's shapes.
FLAGS = BASE_FLAGS + ["--swiglu", "--group-query-attention", "--num-query-groups", "2"]
FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()
SELECTIVE = "--recompute-granularity selective --recompute-modules core_attn mlp".split()
MOE = with_flag(BASE_FLAGS, "--micro-batch-size", "1") + "--num-experts 4 --disable-bias-linear --swiglu".split()

# bf16 and fp16 ride on layouts that compile graphs of their own anyway (TP2's shapes, selective recompute's
# checkpointed regions), so they add no compile. Their bound is the 16-bit unit roundoff u (bf16 2^-8, fp16
# 2^-11) of the loss and the grad norm: compiled and eager round the same 16-bit activations at different
# points (inductor keeps fp32 inside a fused kernel where eager rounds between kernels), each rounding within
# u/2 of the value, and the fp32 loss and norm average many of them, so their relative gap stays below u; a wrong
# fusion, a dropped term or a tensor read after it was overwritten moves them by far more.
PRECISION_RTOL = {"--bf16": 2.0**-8, "--fp16": 2.0**-11}

LAYOUTS = {  # name: (ranks, flags added to FLAGS)
    # TP2 in bf16, and TP2+SP in fp32: sequence parallelism held to FP32_RTOL (a bf16 bound of 2^-8 would let a
    # 1e-3 collective bug through).
    "tp2-bf16": (2, ["--tensor-model-parallel-size", "2", "--bf16"]),
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2-full-recompute": (2, ["--pipeline-model-parallel-size", "2"] + FULL),
    "dp2-distopt-selective-recompute-fp16": (
        2,
        ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--fp16"] + SELECTIVE,
    ),
    "dp2-zero3": (2, ["--use-distributed-optimizer", "--zero-stage", "3"]),
    "cp2": (2, ["--context-parallel-size", "2"]),
}


@pytest.fixture(scope="module")
def compile_env(tmp_path_factory) -> dict[str, str]:
    """One inductor cache for the whole module (runs with equal layer shapes reuse the compiled code)."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor-cache")),
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
    }


def _compiled_once(run) -> None:
    """The trainer logs the compile once, after iteration 1, and warns if a later training iteration compiled."""
    lines = [line for line in run.stdout.splitlines() if line.startswith("compiled ") and " regions in " in line]
    assert len(lines) == 1, run.stdout[-2000:]
    assert "graphs" in lines[0] and "more graph(s) in iteration" not in run.stderr, run.stderr[-2000:]


def expected_bytes_per_layer(flags: list[str], nproc: int) -> float:
    """The compile-mode estimate of one layer (planning/activations.py), as the probe averages it over a chunk:
    the chunk's first layer also keeps the int64 position ids (8 s bytes, s after CP) RoPE is gathered by."""
    cfg = config_from_args(flags, world_size=nproc)
    layout = Layout.from_config(cfg)
    assert layout.compiled
    layers = cfg.model.num_layers // layout.pp
    return layout_layer_bytes(cfg.model, layout) + 8 * (cfg.model.seq_length // layout.cp) / layers


def saved_bytes_per_layer(report: Path) -> list[float]:
    """Iteration 1's probe, per rank (memory_report.json)."""
    return [e["activation_bytes_per_layer"] for e in json.loads((report / "memory_report.json").read_text())]


def _assert_equal_to_eager(
    flags: list[str], nproc: int, workdir: Path, env: dict, ref_flags: list[str], bytes_rtol: Optional[float] = 0.0
) -> RunResult:
    """Compiled == the eager single-process run at the same precision (fp32: FP32_RTOL; 16-bit: PRECISION_RTOL),
    compiled once; iteration 1's probe on every rank == the compile-mode estimate within `bytes_rtol` (None: not
    compared here)."""
    precision = [f for f in flags if f in PRECISION_RTOL]
    rtol = PRECISION_RTOL[precision[0]] if precision else FP32_RTOL
    ref = reference(ref_flags + precision, workdir / "ref")
    report = workdir / "tb"
    run = run_layout(flags + COMPILE + ["--tensorboard-dir", str(report)], nproc, workdir / "run", env=env)
    assert_close(run.losses, ref.losses, rtol, "lm loss")
    assert_close(run.grad_norms, ref.grad_norms, rtol, "grad norm")
    _compiled_once(run)
    if bytes_rtol is not None:
        expected = expected_bytes_per_layer(flags + COMPILE, nproc)
        measured = saved_bytes_per_layer(report)
        assert all(abs(m - expected) <= bytes_rtol * expected for m in measured), (
            f"saved bytes per layer by rank {measured}, estimate {expected}"
        )
    return run


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, compile_env) -> tuple[RunResult, Path]:
    """The compiled one-process run (checked against eager), saving at iteration 3; its checkpoint directory."""
    work = tmp_path_factory.mktemp("single")
    flags = FLAGS + ["--save", str(work / "ckpt"), "--save-interval", "3"]
    return _assert_equal_to_eager(flags, 1, work, compile_env, FLAGS), work / "ckpt"


def test_single_process_equals_eager_and_saves_the_estimate(single_run):
    """One process: compiled == eager and the probe's bytes per layer == the compile-mode estimate (in the
    fixture), which is eager's count less the cos / sin rows (2 e s d)."""
    cfg = config_from_args(FLAGS + COMPILE, world_size=1)
    eager = layout_layer_bytes(cfg.model, Layout.from_config(config_from_args(FLAGS, world_size=1)))
    assert eager - layout_layer_bytes(cfg.model, Layout.from_config(cfg)) == 2 * 4 * cfg.model.seq_length * cfg.model.head_dim


def test_compiled_resume_is_bitwise(single_run, tmp_path, compile_env):
    run, ckpt = single_run
    resumed = run_layout(FLAGS + COMPILE + ["--load", str(ckpt), "--ckpt-step", "3"], 1, tmp_path, env=compile_env)
    assert resumed.losses == run.losses[3:], "a compiled resume must repeat iterations 4 and 5 bit for bit"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_layout_equals_eager(name, tmp_path, compile_env):
    """Every layout's probe equals the compile-mode estimate to the byte, the selective recompute's saved
    generator state (5,056 bytes on CPU) included."""
    nproc, extra = LAYOUTS[name]
    _assert_equal_to_eager(FLAGS + extra, nproc, tmp_path, compile_env, FLAGS)


def test_documents_and_window_compile_once(tmp_path_factory, tmp_path, compile_env):
    """--reset-position-ids, --reset-attention-mask, --eod-mask-loss and --window-size on a packed corpus: compiled ==
    eager, one graph per layer (the masked attention is one opaque op, tricorn/model/masking.py), no recompilation
    although every microbatch has other documents, and the probe == the compile-mode estimate."""
    from document_reference import packed_corpus
    from test_document_attention import DOCUMENTS, WINDOW, data_flags

    flags = data_flags(packed_corpus(tmp_path_factory.mktemp("packed") / "documents"), FLAGS) + DOCUMENTS + WINDOW
    run = _assert_equal_to_eager(flags, 1, tmp_path, compile_env, flags, bytes_rtol=None)
    assert " 0 graph breaks" in run.stdout, run.stdout[-2000:]
    # The chunk's first compiled layer keeps the positions RoPE is gathered by: per sample here, [s, b] int64.
    cfg = config_from_args(flags + COMPILE, world_size=1)
    b, s = cfg.training.micro_batch_size, cfg.model.seq_length
    expected = layout_layer_bytes(cfg.model, Layout.from_config(cfg)) + 8 * s * b / cfg.model.num_layers
    assert saved_bytes_per_layer(tmp_path / "tb") == [expected]


def test_moe_ep2_compiles_the_dense_parts(tmp_path, compile_env):
    """MoE: what a rank's experts keep depends on the routing, so the compiled layers' bytes are compared with
    the eager run's at the same layout: less the RoPE rows (2 e s d), plus the chunk's position ids (8 s)."""
    flags = MOE + ["--expert-model-parallel-size", "2"]
    run = _assert_equal_to_eager(flags, 2, tmp_path, compile_env, MOE, bytes_rtol=None)
    assert run.returncode == 0
    eager_report = tmp_path / "eager-tb"
    run_layout(flags + ["--tensorboard-dir", str(eager_report)], 2, tmp_path / "eager")
    cfg = config_from_args(flags, world_size=2)
    s, layers = cfg.model.seq_length, cfg.model.num_layers
    shift = -2 * 4 * s * cfg.model.head_dim + 8 * s / layers
    expected = [b + shift for b in saved_bytes_per_layer(eager_report)]
    assert saved_bytes_per_layer(tmp_path / "tb") == expected


def test_refusals_are_one_line(tmp_path):
    for extra, words in [
        (["--recompute-granularity", "selective", "--recompute-modules", "norm"], "--recompute-modules norm"),
        (["--hidden-dropout", "0.1"], "--hidden-dropout 0"),
    ]:
        run = run_layout(BASE_FLAGS + COMPILE + extra, 1, tmp_path, check=False)
        errors = [line for line in run.stderr.splitlines() if line.startswith("tricorn: error:")]
        assert run.returncode == 2 and len(errors) == 1 and words in errors[0], run.stderr[-2000:]


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's own import
def test_float64_compiled_layers_equal_eager(compile_env, monkeypatch):
    """The compiled layers compute eager's function: float64 loss and gradients within 1e-10 (module docstring)."""
    from tricorn.config import ModelConfig
    from tricorn.model.transformer import GPTModel
    from tricorn.parallel.compile import apply_compile

    for key, value in compile_env.items():
        monkeypatch.setenv(key, value)
    # With --qk-layernorm, --add-qkv-bias and --kv-channels (12, not 32 / 4): their ops traced too (issue 40).
    cfg = ModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
        swiglu=True, seq_length=16, vocab_size=64, disable_bias_linear=True, add_qkv_bias=True, qk_layernorm=True,
        kv_channels=12,
    )  # fmt: skip
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for compiled in (False, True):
        model = GPTModel(cfg, padded_vocab_size=64)
        model.init_weights(1)
        model.double()
        apply_compile([model], compiled)
        loss = model(tokens, tokens).mean()
        loss.backward()
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
    for eager, compiled in zip(*results):
        assert torch.linalg.norm(compiled - eager) <= 1e-10 * torch.linalg.norm(eager)


# ---------------------------------------------------------------- fused norms (eager, CUDA)


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: which branch lean.norm takes, checked without a GPU."""

    @property
    def is_cuda(self) -> bool:
        return True


@pytest.mark.parametrize("center", [False, True], ids=["rmsnorm", "layernorm"])
def test_cuda_eager_norms_run_torchs_fused_kernels_with_the_same_math(center, monkeypatch):
    """On CUDA lean.norm calls F.rms_norm / F.layer_norm (one fused kernel each way); they compute _Norm's function
    (float64: within 1e-12, a reordered row sum) with the arguments in the right places."""
    import torch.nn.functional as F

    from tricorn.model import lean

    calls = []
    fused = {"rms_norm": F.rms_norm, "layer_norm": F.layer_norm}
    for name, fn in fused.items():
        monkeypatch.setattr(F, name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 2, 16, dtype=torch.float64, generator=g)
    w, b = torch.randn(16, dtype=torch.float64, generator=g), torch.randn(16, dtype=torch.float64, generator=g)
    bias = b if center else None
    ours = lean.norm(x, w, bias, 1e-5, center)
    assert calls == []  # the CPU runs the hand-written norm
    theirs = lean.norm(x.as_subclass(_OnCuda), w, bias, 1e-5, center)
    assert set(calls) == {"layer_norm" if center else "rms_norm"}  # (the subclass's torch_function calls it again)
    assert torch.linalg.norm(theirs.as_subclass(torch.Tensor) - ours) <= 1e-12 * torch.linalg.norm(ours)
