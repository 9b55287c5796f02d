"""Memory estimator: published figures (Megatron, ZeRO, Korthikanti), tricorn's own layers, the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from tricorn.config import ModelConfig
from tricorn.planning import estimate as estimate_cli
from tricorn.planning import memory
from tricorn.planning.layout import Layout
from tricorn.planning.memory import KORTHIKANTI
from tricorn.training.activation_probe import ActivationProbe


def run_json(argv: list[str], capsys) -> dict:
    assert estimate_cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def state_bytes_per_param(rec: dict) -> float:
    return rec["model_state_bytes"] / rec["params_on_rank"]


# ---------------------------------------------------------------- published model-state figures


def test_megatron_18_bytes_per_param_without_distributed_optimizer(capsys) -> None:
    rec = run_json(["--model-preset", "llama2-7b", "--bf16", "--world-size", "8"], capsys)
    # 1%: Megatron's published 18 bytes/param is rounded; the estimate also counts Adam's per-tensor step counters.
    assert state_bytes_per_param(rec) == pytest.approx(18, rel=1e-2)
    # Exact byte counts (integers); approx only absorbs the JSON float.
    assert rec["grads_bytes"] == pytest.approx(4 * rec["params_on_rank"])  # fp32 main grads
    assert rec["master_params_bytes"] == pytest.approx(4 * rec["params_on_rank"])


@pytest.mark.parametrize("dp", [2, 8, 64])
def test_megatron_6_plus_12_over_d_with_distributed_optimizer(dp: int, capsys) -> None:
    rec = run_json(["--model-preset", "llama2-7b", "--bf16", "--world-size", str(dp), "--use-distributed-optimizer"], capsys)
    # 1%: Megatron's published 6 + 12/d; DP-shard padding and the norms move the real ratio slightly.
    assert state_bytes_per_param(rec) == pytest.approx(6 + 12 / dp, rel=1e-2)


# ZeRO paper (Rajbhandari et al. 2020, fig. 1): 7.5B params, Nd = 64, K = 12, fp16 params and grads.
ZERO_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.88}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_paper_figures(stage: int, capsys) -> None:
    direct = memory.model_state_bytes(7.5e9, param_bytes=2, grad_bytes=2, master_bytes=4, dp=64, zero_stage=stage)
    # 1%: the ZeRO paper prints its figures to 3 significant digits.
    assert direct.total / 1e9 == pytest.approx(ZERO_GB[stage], rel=1e-2)
    # The same through the CLI's JSON: fp16 with 16-bit gradients, bytes/param scaled to 7.5B parameters.
    argv = ["--model-preset", "llama2-7b", "--fp16", "--grad-reduce-in-bf16", "--world-size", "64"]
    if stage:
        argv += ["--use-distributed-optimizer", "--zero-stage", str(stage)]
    rec = run_json(argv, capsys)
    # 1%: the paper's 3-digit rounding, plus DP-shard padding of the real 7B model.
    assert state_bytes_per_param(rec) * 7.5e9 / 1e9 == pytest.approx(ZERO_GB[stage], rel=1e-2)


def test_worked_7b_budget_16_bytes_per_param(capsys) -> None:
    # fp16 weights and grads, fp32 master, two fp32 moments: 2 + 2 + 4 + 8 = 16 bytes, 112 GB for 7B.
    assert memory.bytes_per_param("fp16", grads_16bit=True) == (2, 2, 4, 8)
    state = memory.model_state_bytes(7e9, param_bytes=2, grad_bytes=2, master_bytes=4)
    # 1%: the worked example's rounded 112 GB.
    assert state.total / 1e9 == pytest.approx(112, rel=1e-2)
    rec = run_json(["--model-preset", "llama2-7b", "--fp16", "--grad-reduce-in-bf16"], capsys)
    # 0.1%: 16 bytes per parameter, plus Adam's per-tensor step counters (far below 0.1%).
    assert state_bytes_per_param(rec) == pytest.approx(16, rel=1e-3)
    assert rec["model_state_bytes"] / 1e9 == pytest.approx(112 * rec["params_on_rank"] / 7e9, rel=1e-3)


def test_fp32_params_are_the_master_copy(capsys) -> None:
    rec = run_json(["--model-preset", "tiny", "--vocab-size", "256", "--device", "cpu"], capsys)
    n = rec["params_on_rank"]
    assert (rec["params_bytes"], rec["grads_bytes"], rec["master_params_bytes"], rec["optimizer_state_bytes"]) == (
        4 * n,
        4 * n,
        0,
        8 * n,
    )


# ---------------------------------------------------------------- Korthikanti et al. activations


def gpt3_block(**kw) -> ModelConfig:
    shape = dict(
        num_layers=96,
        hidden_size=12288,
        num_attention_heads=96,
        seq_length=2048,
        vocab_size=51200,
        normalization="LayerNorm",
        position_embedding_type="learned_absolute",
        hidden_dropout=0.1,
        attention_dropout=0.1,
    )
    return ModelConfig(**{**shape, **kw})


@pytest.mark.parametrize(
    "tp,sp,recompute",
    [(1, False, None), (8, False, None), (8, True, None), (8, False, "selective"), (8, True, "selective"), (8, True, "full")],
)
def test_korthikanti_per_layer_activations(tp: int, sp: bool, recompute) -> None:
    m = gpt3_block()
    ours = memory.layer_activation_bytes(
        m, seq=2048, micro_batch=1, tp=tp, sequence_parallel=sp, recompute=recompute, precision="fp16", profile=KORTHIKANTI
    )
    # The same byte formula evaluated in float64 in two term orders: ~1e-15 apart.
    assert ours == pytest.approx(memory.korthikanti_layer_bytes(2048, 1, 12288, 96, tp, sp, recompute), rel=1e-12)


def test_korthikanti_headline_numbers() -> None:
    s, b, h, a = 2048, 1, 12288, 96
    assert memory.korthikanti_layer_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    # GPT-3 175B, TP=8 with SP and selective recompute: 34sbh/t = 102 MiB per layer in fp16.
    # 34sbh/t bytes is exactly 102 MiB here; approx only absorbs float64 rounding.
    assert memory.korthikanti_layer_bytes(s, b, h, a, 8, True, "selective") / 2**20 == pytest.approx(102.0)


def test_first_stage_holds_all_layers_and_interleaving_factor() -> None:
    m = gpt3_block()
    per_layer = memory.layer_activation_bytes(m, seq=2048, micro_batch=1, tp=8, sequence_parallel=True, profile=KORTHIKANTI)
    base = Layout(tp=8, pp=8, dp=1, num_microbatches=64, sequence_parallel=True, precision="fp16")
    first = memory.stage_activation_bytes(m, base, 0, 12, KORTHIKANTI)
    # Float64 products of exact byte counts: default rel 1e-6 only absorbs rounding (below 1e-15).
    assert first == pytest.approx(per_layer * 96)  # 1F1B: p microbatches of L/p layers
    last = memory.stage_activation_bytes(m, base, 7, 12, KORTHIKANTI)
    assert last == pytest.approx(per_layer * 12)
    inter = Layout(**{**base.__dict__, "vpp": 4})
    assert memory.stage_activation_bytes(m, inter, 0, 12, KORTHIKANTI) == pytest.approx(per_layer * 96 * (1 + 7 / 32))
    few = Layout(**{**base.__dict__, "num_microbatches": 3})
    assert memory.stage_activation_bytes(m, few, 0, 12, KORTHIKANTI) == pytest.approx(per_layer * 12 * 3)
    gpipe = Layout(**{**base.__dict__, "schedule": "gpipe"})
    assert memory.stage_activation_bytes(m, gpipe, 0, 12, KORTHIKANTI) == pytest.approx(per_layer * 12 * 64)


def test_full_recompute_keeps_layer_inputs_plus_one_layer() -> None:
    m = gpt3_block()
    lay = Layout(tp=8, pp=1, sequence_parallel=True, recompute="full", precision="fp16")
    full_layer = memory.layer_activation_bytes(m, seq=2048, micro_batch=1, tp=8, sequence_parallel=True, profile=KORTHIKANTI)
    got = memory.stage_activation_bytes(m, lay, 0, 96, KORTHIKANTI)
    # Float64 sums of exact byte counts: default rel 1e-6 only absorbs rounding.
    assert got == pytest.approx(96 * 2 * 2048 * 12288 / 8 + full_layer)


# ---------------------------------------------------------------- tricorn's own layers


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "shape",
    [
        dict(swiglu=True, num_query_groups=2, group_query_attention=True, ffn_hidden_size=160),
        dict(swiglu=False, disable_bias_linear=False, normalization="LayerNorm"),
        dict(swiglu=True, hidden_dropout=0.1),
    ],
    ids=["gqa-swiglu", "gelu-layernorm-bias", "dropout"],
)
def test_formula_matches_tricorn_block_saved_tensors(precision: str, shape: dict) -> None:
    from tricorn.model.layers import Rotary
    from tricorn.model.spec import local_spec
    from tricorn.model.transformer import TransformerBlock

    torch.manual_seed(0)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    m = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=128, vocab_size=256, **shape)
    block = TransformerBlock(m, local_spec()).to(dtype).train()
    rotary = Rotary(m.head_dim, m.max_positions, m.rotary_base)
    x = torch.randn(128, 2, 64, dtype=dtype, requires_grad=True)  # hidden states are sequence-first: [s, b, h]
    with ActivationProbe([block]) as probe:  # the whole block is one chunk: its saved bytes are "other"
        block(x, rotary, torch.arange(128))
    measured = probe.summary().activation_bytes_other
    predicted = memory.layer_activation_bytes(m, seq=128, micro_batch=2, precision=precision, device="cpu")
    # 1%: the formula against the saved-tensor bytes of the real block (byte counts, no float reorder involved).
    assert predicted == pytest.approx(measured, rel=1e-2)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("split", [(True, True), (True, False), (False, True), (False, False)])
def test_stage_parameter_counts_match_tricorn_model(tied: bool, split: tuple[bool, bool]) -> None:
    from tricorn.model.transformer import GPTModel

    pre, post = split
    m = ModelConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        group_query_attention=True,
        vocab_size=200,
        swiglu=True,
        untie_embeddings_and_output_weights=not tied,
    )
    model = GPTModel(m, layer_ids=[0, 1], pre_process=pre, post_process=post)
    pp = 1 if (pre and post) else 4
    stage = 0 if pre else pp - 1 if post else 1
    assert memory.stage_params_per_rank(m, Layout(pp=pp), stage, 2) == sum(p.numel() for p in model.parameters())


def test_worst_stage_is_reported() -> None:
    m = ModelConfig(num_layers=8, hidden_size=256, num_attention_heads=4, seq_length=512, vocab_size=128000, swiglu=True)
    est = memory.estimate(m, Layout(pp=4, num_microbatches=8))
    assert len(est.per_stage_total_bytes) == 4
    assert est.total_bytes == max(est.per_stage_total_bytes)
    assert est.stage == est.per_stage_total_bytes.index(est.total_bytes)


# ---------------------------------------------------------------- CLI


def test_text_report_and_fit_verdict(capsys) -> None:
    argv = ["--model-preset", "llama2-70b", "--bf16", "--gpu-type", "h100-80gb"]
    assert estimate_cli.main(argv) == 0
    out = capsys.readouterr().out
    for label in ("parameters", "gradients", "master parameters", "optimizer state", "activations", "total"):
        assert label in out
    assert "does NOT fit" in out


def test_json_keys_are_stable(capsys) -> None:
    rec = run_json(["--model-preset", "tiny", "--vocab-size", "256", "--device", "cpu", "--gpu-memory-gb", "1"], capsys)
    for key in ("params_bytes", "grads_bytes", "master_params_bytes", "optimizer_state_bytes", "activation_bytes", "total_bytes"):
        assert isinstance(rec[key], (int, float))
    parts = [k for k, _ in estimate_cli.CATEGORIES]
    # A float64 sum of the same categories: default rel 1e-6 only absorbs its rounding.
    assert rec["total_bytes"] == pytest.approx(sum(rec[k] for k in parts))
    assert rec["fits"] is True


def test_unknown_vocab_is_one_clear_error(capsys) -> None:
    assert estimate_cli.main(["--model-preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "--vocab-size" in err and "Traceback" not in err


def test_plot_needs_matplotlib_or_draws(tmp_path, capsys) -> None:
    out = tmp_path / "mem.png"
    argv = ["--model-preset", "tiny", "--vocab-size", "256", "--plot", str(out)]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit, match="needs matplotlib"):
            estimate_cli.main(argv)
        return
    assert estimate_cli.main(argv) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_world_size_defaults_to_one_replica_and_keeps_the_global_batch(capsys) -> None:
    rec = run_json(
        ["--model-preset", "tiny", "--vocab-size", "256", "--tensor-model-parallel-size", "2", "--global-batch-size", "8"], capsys
    )
    assert rec["world_size"] == 2 and rec["layout"]["dp"] == 1 and rec["layout"]["num_microbatches"] == 8


def test_format_report_for_dry_run() -> None:
    cfg = estimate_cli.config_for_estimate(["--model-preset", "tiny", "--vocab-size", "256", "--device", "cpu"])
    text = estimate_cli.format_report(cfg)
    assert "memory estimate for tiny" in text and "total" in text
