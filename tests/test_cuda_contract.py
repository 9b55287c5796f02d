"""The GPU path, checked on the CPU (issue 26, item 1): in an iteration that does not log, nothing waits for the host.

Two launches (tests/workers/cuda_contract.py: one rank, then two ranks running every layout in turn) train
real layouts with the CPU standing in for CUDA and record, per iteration and rank, what
tricorn.host_reads.HostReadCounter saw. In every iteration that does not log, on every rank:

- 0 device-to-host reads, but the documented ones: MoE reads its copy counts once per MoE layer and
  microbatch (moe.read_counts: the all_to_all splits and the per-expert loop need them on the host), and
  --optimizer-cpu-offload reads the grad norm once per step (grads.clip_grads: the host clips its gradients;
  its other wait, the stream synchronize before the host's step, is a CUDA call a CPU run cannot see);
- 0 blocking or pageable host-to-device copies (the microbatch copies are non-blocking from pinned memory);
- 0 tensors created on, or mixed in from, the wrong device;
- in bf16 and fp16 runs every attention call is flash- or efficient-eligible on an H100 (tricorn.attention_kernels).

The negative tests below put each defect issue 26 found back in a few lines and show that the counter
catches it; the rules of torch's kernel choice and of the grouped GEMM have tests of their own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness import run_script

from tricorn import pinned
from tricorn.attention_kernels import EFFICIENT, FLASH, MATH, AttentionCall, cuda_sdpa_kernel, math_fallback_warning
from tricorn.data.base import Batch, GlobalBatchLoader, MockSamples
from tricorn.host_reads import HostReadCounter
from tricorn.model.moe import grouped_mm_fast

WORKER = Path(__file__).parent / "workers" / "cuda_contract.py"
GQA = ["--group-query-attention", "--num-query-groups", "2"]
MOE = (
    "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 96 --disable-bias-linear --swiglu "
    "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 0.01"
).split()
DISTOPT = ["--use-distributed-optimizer"]
SINGLE = {
    "single": ["--bf16", *GQA],
    # Documents and a window on whole sequences: one varlen flash call per layer (model/varlen.py).
    "single-documents-window": ["--bf16", *GQA, "--reset-position-ids", "--reset-attention-mask", "--window-size", "8"],
}
LAYOUTS = {
    "tp2-sp": ["--bf16", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--bf16", "--pipeline-model-parallel-size", "2"],
    "cp2-gqa": ["--bf16", "--context-parallel-size", "2", *GQA],
    "dp2-zero1-overlap": ["--bf16", *DISTOPT, "--overlap-grad-reduce", "--overlap-param-gather"],
    "dp2-zero3": ["--bf16", *DISTOPT, "--zero-stage", "3"],
    "ep2-expert-bias": ["--bf16", *MOE, "--expert-model-parallel-size", "2"],
    "fp16-dynamic": ["--fp16", "--initial-loss-scale", "1024"],
    "loss-scale": ["--bf16", "--loss-scale", "128"],
    "offload": ["--bf16", *DISTOPT, "--optimizer-cpu-offload"],
    # fp16 moments' per-parameter scales and FP8 primary weights' amaxes: scattered and gathered on the device.
    "precision-fp16-moments": ["--bf16", *DISTOPT, "--use-precision-aware-optimizer", "--exp-avg-dtype", "fp16"],
    "fp8-param-gather": ["--bf16", *DISTOPT, "--fp8-format", "e4m3", "--fp8-param-gather"],
    "spiky-loss": ["--bf16", *DISTOPT, "--check-for-spiky-loss"],  # the spike veto's device work in the step
    # Documents and a window: positions copied with the microbatch, the bounds read on the host (model/masking.py).
    "cp2-documents-window": [
        "--bf16",
        "--context-parallel-size",
        "2",
        *GQA,
        "--reset-position-ids",
        "--reset-attention-mask",
        "--window-size",
        "8",
    ],  # fmt: skip
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out: dict = {}
    for nproc, runs in ((1, SINGLE), (2, LAYOUTS)):
        tmp = tmp_path_factory.mktemp(f"contract{nproc}")
        spec = {"runs": [{"name": n, "flags": f} for n, f in runs.items()], "out": str(tmp / "out.json")}
        (tmp / "spec.json").write_text(json.dumps(spec))
        run_script(WORKER, nproc, [str(tmp / "spec.json")], timeout=600)
        out.update(json.loads((tmp / "out.json").read_text()))
    return out


@pytest.mark.parametrize("name", [*SINGLE, *LAYOUTS])
def test_no_host_wait_in_iterations_that_do_not_log(results, name):
    run = results[name]
    for rank, r in enumerate(run["ranks"]):
        # MoE reads its copy counts (moe.read_counts: the all_to_all splits and the loop of expert GEMMs need them),
        # once per MoE layer and microbatch; an offloaded step reads the grad norm to clip the host's gradients.
        expected_reads = r["routers"] * r["microbatches"] + (name == "offload")
        expected_at = "grads.py" if name == "offload" else "moe.py"
        for it, i in enumerate(r["iterations"], start=1):
            if i["logs"]:
                continue
            where = f"{name} rank {rank} iteration {it}"
            assert len(i["reads"]) == expected_reads and all(expected_at in w for w in i["reads"]), f"{where}: {i['reads']}"
            assert i["blocking"] == [], f"{where}: {i['blocking']}"
            assert i["wrong_device"] == [], f"{where}: {i['wrong_device']}"
            assert i["unfused"] == [], f"{where}: {i['unfused']}"
            assert i["kernels"] and set(i["kernels"]) <= {FLASH, EFFICIENT}, f"{where}: {i['kernels']}"
            # The microbatch copies were seen (the contract watches them), all of them non-blocking from pinned memory.
            assert i["copies"] and all(c.startswith("non-blocking host-to-device copy from pinned") for c in i["copies"])


@pytest.mark.parametrize("name", ["cp2-gqa", "cp2-documents-window", "single-documents-window"])
def test_cp_with_gqa_runs_flash(results, name):
    """parallel/context/ ring attention: every block is an unmasked or square causal call at k's head count, flash's;
    with documents and a window too (the anti-causal squares run causal on reversed rows); on one device the masked
    attention of whole sequences is one varlen flash call."""
    kernels = {k for r in results[name]["ranks"] for i in r["iterations"] for k in i["kernels"]}
    assert kernels == {FLASH}, kernels


# ---------------------------------------------------------------- each kind of violation, put back, is caught


def _host_batch(pin: bool) -> Batch:
    """A batch as the loader makes it inside a watched iteration (its tensors then count as host memory)."""
    loader = GlobalBatchLoader(MockSamples(50, 8, seed=1), 0, 1)
    loader.pin_memory = pin
    with HostReadCounter() as c:
        batch = loader.next(4)
    assert c.wrong_device == []  # the loader's tensors are host memory by design (pinned.host_side)
    return batch


def test_a_device_read_is_caught():
    with HostReadCounter() as c:
        loss = torch.ones(3, device="cpu").sum()
        float(loss)  # what a loss printed every iteration does
    assert c.count == 1 and "test_cuda_contract.py" in c.where[0]


@pytest.mark.parametrize("pin, blocking", [(False, 3), (True, 0)])
def test_pageable_microbatch_copies_are_caught(pin, blocking):
    """data/base.py before the fix: three blocking copies per microbatch from pageable memory."""
    with pinned.stand_in():
        batch = _host_batch(pin)
        with HostReadCounter() as c:
            batch.slice(0, 2).to(torch.device("cpu"), copy=True)
    assert len(c.copies) == 3 and len(c.blocking_copies()) == blocking, [str(x) for x in c.copies]


def test_a_host_token_count_copied_over_is_caught():
    """loop.py before the fix: loss_mask.sum().to(device) sums in host memory, then copies blocking."""
    with pinned.stand_in():
        batch = _host_batch(True)
        with HostReadCounter() as c:
            batch.loss_mask.sum().to(torch.device("cpu"), torch.float32)
    assert len(c.blocking_copies()) == 1, c.copies


@pytest.mark.parametrize("value", [False, 128.0])
def test_a_python_scalar_made_a_device_tensor_is_caught(value):
    """loop.py / optimizer.py / expert.py before the fix: torch.as_tensor(False or a float, device=...)."""
    with HostReadCounter() as c:
        torch.as_tensor(value, dtype=torch.float32, device=torch.device("cpu"))
        torch.full((), value, dtype=torch.float32, device=torch.device("cpu"))  # the fix: a fill on the device
    assert len(c.blocking_copies()) == 1, c.copies


def test_a_tensor_created_without_a_device_is_caught():
    x = torch.ones(4)
    with HostReadCounter() as c:
        mask = torch.ones(4)  # on CUDA: host memory, then an error (or a sync) where it meets x
        x * mask
    assert len(c.wrong_device) == 2 and "torch.ones without device=" in c.wrong_device[0], c.wrong_device


def test_math_attention_is_caught():
    """context.py before the fix: a masked call with enable_gqa in bf16 runs the math kernel on CUDA."""
    q = torch.randn(1, 4, 8, 16, dtype=torch.bfloat16)
    kv = torch.randn(1, 2, 16, 16, dtype=torch.bfloat16)
    mask = torch.ones(8, 16, dtype=torch.bool)
    with HostReadCounter() as c:
        F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=True)
        F.scaled_dot_product_attention(q, kv.repeat_interleave(2, 1), kv.repeat_interleave(2, 1), attn_mask=mask)
    assert [cuda_sdpa_kernel(a) for a in c.attention] == [MATH, EFFICIENT]
    assert len(c.unfused_attention()) == 1 and "GQA" in c.unfused_attention()[0]


# ---------------------------------------------------------------- the rules


def _call(dtype=torch.bfloat16, heads=(8, 2), s=(128, 128), d=64, **kw) -> AttentionCall:
    b = 2
    shapes = ((b, heads[0], s[0], d), (b, heads[1], s[1], d), (b, heads[1], s[1], d))
    return AttentionCall(*shapes, (dtype,) * 3, (1, 1, 1), (0, 0, 0), **kw)


@pytest.mark.parametrize(
    "call, cap, kernel",
    [
        (_call(is_causal=True, enable_gqa=True), (9, 0), FLASH),  # model/spec.py sdpa_causal, bf16 + GQA
        (_call(torch.float32, is_causal=True, enable_gqa=True), (9, 0), MATH),  # fp32 + GQA: the warned case
        (_call(torch.float32, heads=(8, 8), is_causal=True), (9, 0), EFFICIENT),  # fp32, no GQA
        (_call(mask=(128, 256), s=(128, 256), enable_gqa=True), (9, 0), MATH),  # old CP call
        (_call(heads=(8, 8), mask=(128, 256), s=(128, 256)), (9, 0), EFFICIENT),  # CP with k, v repeated
        (_call(is_causal=True, s=(128, 256), heads=(8, 8)), (9, 0), EFFICIENT),  # flash: causal needs s_q == s_k
        (_call(d=512, heads=(8, 8)), (9, 0), EFFICIENT),  # flash: head dim <= 256
        (_call(heads=(8, 8)), (7, 5), MATH),  # bf16 needs sm80
        (_call(torch.float16, heads=(8, 8)), (7, 5), EFFICIENT),
        (_call(d=200, heads=(8, 8), requires_grad=True), (8, 6), EFFICIENT),  # flash training, head dim 200 on sm86
        (_call(d=60, heads=(8, 8)), (9, 0), FLASH),
        (_call(d=60, heads=(8, 8), mask=(128, 128)), (9, 0), MATH),  # efficient: head dim a multiple of 8
    ],
)
def test_torch_cuda_kernel_choice(call, cap, kernel):
    assert cuda_sdpa_kernel(call, cap) == kernel


def test_cudnn_first_where_torch_prefers_it():
    assert cuda_sdpa_kernel(_call(mask=(128, 128), enable_gqa=True), (9, 0), prefer_cudnn=True) == "cudnn"


def test_fp32_with_gqa_warns_with_its_memory():
    from tricorn.training.main import resolve_config

    flags = (
        "--device cpu --mock-data --num-layers 2 --hidden-size 4096 --num-attention-heads 32 --group-query-attention "
        "--num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1 "
        "--global-batch-size 4 --vocab-size 500"
    ).split()
    line = math_fallback_warning(resolve_config(flags))
    assert line is not None and "8.00 GiB per layer" in line and "math kernel" in line, line  # 32 * 8192^2 * 4 bytes
    assert math_fallback_warning(resolve_config([*flags, "--bf16"])) is None


@pytest.mark.parametrize(
    "device, dtype, cap, fast",
    [
        ("cuda", torch.bfloat16, (9, 0), True),
        ("cuda", torch.bfloat16, (10, 0), True),
        ("cuda", torch.bfloat16, (8, 0), False),  # A100: torch loops over the experts after offs.cpu()
        ("cuda", torch.bfloat16, (12, 0), False),  # SM120 is not among torch's grouped-GEMM devices
        ("cuda", torch.float16, (9, 0), False),
        ("cuda", torch.float32, (9, 0), False),
        ("cpu", torch.bfloat16, (9, 0), False),
    ],
)
def test_grouped_gemm_only_on_its_fast_path(device, dtype, cap, fast):
    assert grouped_mm_fast(device, dtype, cap, [128, 192]) is fast
    assert not grouped_mm_fast(device, dtype, cap, [128, 100])  # rows not 16-byte multiples


def test_cuda_runs_pin_their_batches():
    """What the stand-in takes for granted: on CUDA build_loaders makes the loader pin (no CUDA touched here)."""
    from types import SimpleNamespace

    from tricorn.training.main import build_loaders, resolve_config

    cfg = resolve_config(
        "--device cpu --mock-data --num-layers 1 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 1 --global-batch-size 1 --vocab-size 64".split()
    )
    for device, pinned_batches in (("cuda", True), ("cpu", False)):
        train, _ = build_loaders(cfg, SimpleNamespace(device=torch.device(device), dp_rank=0, dp_size=1))
        assert train.pin_memory is pinned_batches
