"""Documents and windows in training: the trainer's loss equals a float64 reference, and every layout equals one process.

The data is a packed corpus (tests/document_reference.py: several documents per 64-token sample, each ending with
the end-of-document token). The single-process trainer's first loss with --reset-position-ids,
--reset-attention-mask and --eod-mask-loss (and with --window-size) equals a plain-torch float64 decoder on the
same weights and samples whose attention mask is built explicitly; the layouts (tests/harness.py), with documents,
a window and hidden dropout, then equal the single-process run over 5 iterations. --torch-compile: tests/test_compile.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from document_reference import allowed_mask, packed_corpus, reference_loss
from harness import BASE_FLAGS, FP32_RTOL, assert_equivalent, reference

from tricorn.config_args import config_from_args
from tricorn.data.documents import starts_from_bounds
from tricorn.data.loader import build_loaders
from tricorn.model.transformer import GPTModel
from tricorn.planning.activations import layout_layer_bytes
from tricorn.planning.flops import iteration_flops_for_config, useful_attention_flops
from tricorn.planning.layout import Layout

DOCUMENTS = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
WINDOW = ["--window-size", "6,0"]  # keys i-6..i: several window tiles per 64-token sample
GQA = ["--group-query-attention", "--num-query-groups", "2"]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    return packed_corpus(tmp_path_factory.mktemp("packed") / "documents")


def data_flags(corpus: str, base: list[str] = BASE_FLAGS) -> list[str]:
    """`base` on the packed corpus instead of mock data (GQA unless `base` has its own)."""
    gqa = [] if "--group-query-attention" in base else GQA
    data = ["--data-path", corpus, "--tokenizer-type", "NullTokenizer", "--split", "1,0,0", "--eval-iters", "0"]
    return [f for f in base if f != "--mock-data"] + gqa + data


@pytest.mark.parametrize("extra", [DOCUMENTS, WINDOW], ids=["documents", "window"])  # both at once: the layouts below
def test_first_loss_equals_float64_reference(tmp_path, corpus, extra):
    flags = data_flags(corpus) + extra
    run = reference(flags, tmp_path / "ref")
    cfg = config_from_args(flags, world_size=1)
    batch = build_loaders(cfg, 0, 1)[0].next(cfg.training.global_batch_size)
    b, s = batch.tokens.shape
    if "--reset-attention-mask" in extra:  # the corpus must really pack documents into the samples
        assert int((batch.documents[:, 1] < s).sum()) >= b - 1
    model = GPTModel(cfg.model)
    model.init_weights(cfg.training.seed)  # the trainer's initial weights (tricorn/model/init.py)
    positions = batch.position_ids if batch.position_ids is not None else torch.arange(s).expand(b, s)
    starts = None if batch.documents is None else starts_from_bounds(batch.documents)
    allowed = allowed_mask(s, starts, cfg.model.attention_window, b)
    want = reference_loss(model.state_dict(), cfg.model, batch.tokens, batch.labels, batch.loss_mask, positions, allowed)
    # The trainer runs fp32; the reference float64 with an explicit mask: FP32_RTOL bounds fp32's reordering
    # (tests/harness.py), and a mask or position off by one token moves the loss by ~1e-3.
    assert abs(run.losses[0] - want) <= FP32_RTOL * abs(want), (run.losses[0], want)
    # Beside Megatron's throughput, the useful one counts the attention pairs these very samples allow (flops.py).
    f = iteration_flops_for_config(cfg)
    pairs = int(allowed.sum())
    useful = (f.model - f.attention + useful_attention_flops(cfg.model, pairs)) / f.model
    rec = run.records[0]
    # Two float64 quotients of the same iteration time: they differ by rounding only (~1e-16).
    assert rec["useful_tflops_per_device"] / rec["tflops_per_device"] == pytest.approx(useful, rel=1e-12)


TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
CP2 = ["--context-parallel-size", "2"]
FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()
SELECTIVE = "--recompute-granularity selective --recompute-modules core_attn".split()
# name: (ranks, flags beyond the single-process run). Documents and a window in every one.
LAYOUTS = {
    "tp2-sp": (2, TP2_SP),
    "pp2-zero-bubble": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"]),
    "cp2-p2p-full-recompute": (2, CP2 + ["--cp-comm-type", "p2p"] + FULL),
    "cp2-a2a-selective-recompute": (2, CP2 + ["--cp-comm-type", "a2a"] + SELECTIVE),
    "cp2-allgather": (2, CP2 + ["--cp-comm-type", "allgather"]),
    "cp2-tp2-sp": (4, CP2 + TP2_SP),
}  # --torch-compile: tests/test_compile.py (its inductor cache holds the head region already)


PROBED = ("tp2-sp", "cp2-allgather")


# Hidden dropout too: its masks are keyed by the rows' places in the sequence, not by the reset positions, so every
# layout drops what one process drops (tricorn/model/dropout.py).
DROPOUT = ["--hidden-dropout", "0.1"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_single_process(tmp_path, corpus, name):
    nproc, extra = LAYOUTS[name]
    flags = data_flags(corpus) + DOCUMENTS + WINDOW + DROPOUT
    report = ["--tensorboard-dir", str(tmp_path / "tb")] if name in PROBED else []
    assert_equivalent(flags, nproc, tmp_path, extra + report)
    if report:  # iteration 1's saved-tensor probe == the activation estimate, RoPE rows per sample included
        cfg = config_from_args(flags + extra, world_size=nproc)
        layout = Layout.from_config(cfg)
        assert layout.per_sample_positions
        expected = layout_layer_bytes(cfg.model, layout)
        measured = [e["activation_bytes_per_layer"] for e in json.loads((tmp_path / "tb" / "memory_report.json").read_text())]
        assert measured == [expected] * nproc, (measured, expected)
