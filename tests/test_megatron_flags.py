"""Megatron-LM's command line in tricorn (issue 38, item 4): every flag of its parser is implemented, a no-op or refused.

tricorn/megatron_args.json is Megatron-LM's own parser at core_v0.19.0 (scripts/make_megatron_args_fixture.py
dumps it); tricorn/megatron_flags.py classifies each option and docs/megatron-flags.md is generated from both.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from harness import ROOT, run_layout

from tricorn import megatron_flag_table as table
from tricorn import megatron_flags
from tricorn.config import ConfigError
from tricorn.config_args import build_parser, config_from_args
from tricorn.megatron_flags import IMPLEMENTED, NO_OP, REFUSED, megatron_options, not_reproduced, status

# The flags Megatron-LM's run in issue 38 had refused, and Megatron's usual model, optimizer and data flags.
ISSUE_NOOPS = (
    "--use-cpu-initialization --no-gradient-accumulation-fusion --no-rope-fusion --no-bias-swiglu-fusion "
    "--no-persist-layer-norm --no-masked-softmax-fusion --no-bias-dropout-fusion --distributed-backend gloo "
    "--ckpt-format torch_dist --rerun-mode disabled"
).split()
MEGATRON_LINE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--ffn-hidden-size 128 --seq-length 32 --max-position-embeddings 32 --position-embedding-type rope "
    "--normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
    "--attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02 --micro-batch-size 2 --global-batch-size 4 "
    "--train-iters 2 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 1 --weight-decay 0.1 "
    "--adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --seed 1234 --tokenizer-type NullTokenizer --vocab-size 128 "
    "--mock-data --split 949,50,1 --log-interval 1 --eval-iters 1 --eval-interval 1000 --transformer-impl local"
).split() + ISSUE_NOOPS
DOCS = ROOT / "docs" / "megatron-flags.md"


def test_every_option_of_megatrons_parser_is_classified_once():
    kinds = Counter(status(o) for o in megatron_options())  # KeyError names an option neither table has
    assert kinds[IMPLEMENTED] > 100 and kinds[NO_OP] and kinds[REFUSED], kinds
    listed = [d for dests in (*table.NO_OPS.values(), *table.REFUSED.values()) for d in dests]
    twice = [d for d, n in Counter(listed).items() if n > 1]
    assert not twice, f"in both tables, or twice: {twice}"
    dests = {o.dest for o in megatron_options()}
    assert not [d for d in listed if d not in dests], "a dest Megatron's parser does not have"
    stale = [o.flag for o in megatron_options() if status(o) == IMPLEMENTED and o.dest in listed]
    assert not stale, f"implemented by tricorn's parser now: delete their lines in tricorn/megatron_flag_table.py: {stale}"
    assert set(table.FINE) | set(table.WHY) | set(table.FINE_TEXT) <= dests
    assert set(table.FINE_TEXT) == {d for d, fine in table.FINE.items() if callable(fine)}


def test_a_flag_tricorns_parser_defines_is_implemented_with_no_table_edit(monkeypatch):
    option = next(o for o in megatron_options() if o.flag == "--qk-layernorm")
    assert status(option) == REFUSED
    monkeypatch.setattr(megatron_flags, "tricorn_flags", lambda: frozenset({"--qk-layernorm"}))
    assert status(option) == IMPLEMENTED


def test_every_flag_string_of_megatrons_parser_parses():
    ours = {f for a in build_parser()._actions for f in a.option_strings}
    missing = [f for o in megatron_options() for f in o.flags if f not in ours]
    assert not missing, missing


def test_the_flags_table_in_the_docs_is_generated_from_the_parser():
    assert DOCS.read_text() == megatron_flags.flags_table_markdown(), (
        "docs/megatron-flags.md is stale: python -m tricorn.megatron_flags --write-docs"
    )


def test_issue_38s_megatron_command_line_trains_after_one_line_of_no_ops(tmp_path):
    run = run_layout(MEGATRON_LINE, 1, tmp_path)
    assert [r["iteration"] for r in run.records if "loss" in r] == [1, 2]
    lines = [line for line in run.stdout.splitlines() if "Megatron flags" in line]
    assert len(lines) == 1 and lines[0].startswith("tricorn: Megatron flags: no effect in tricorn"), run.stdout
    noops, defaults = lines[0].split(": ", 3)[-1].split("; ")
    assert [s.split("=")[0] for s in noops.split(", ")] == [f for f in ISSUE_NOOPS if f.startswith("--")], noops
    # Every math flag whose default differs was given, but RoPE's tables: Megatron computes them in float32.
    assert defaults == "Megatron's defaults where tricorn's differ: --rotary-angles-dtype float32", defaults


def test_a_math_flag_tricorn_lacks_is_one_error_line_naming_it(tmp_path):
    run = run_layout([*MEGATRON_LINE, "--eod-mask-loss", "--qk-layernorm"], 1, tmp_path, check=False)
    errors = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(errors) == 1, run.stderr
    assert errors[0].startswith("tricorn: error: Megatron flags tricorn does not implement: --eod-mask-loss (changes the loss")
    assert "--qk-layernorm (changes the model" in errors[0]


def _parse(*flags: str):
    return config_from_args(["--device", "cpu", "--mock-data", "--vocab-size", "64", *flags], world_size=1)


@pytest.mark.parametrize(
    "flags, refused",
    [
        (["--kv-channels", "16"], None),  # hidden / heads: tricorn's head dimension
        (["--kv-channels", "32"], "--kv-channels=32"),
        (["--distributed-backend", "gloo"], None),  # --device cpu
        (["--distributed-backend", "nccl"], "--distributed-backend=nccl (the process-group backend"),
        (["--ckpt-format", "torch_dist"], None),
        (["--ckpt-format", "torch"], "--ckpt-format=torch"),
        (["--rerun-mode", "disabled"], None),
        (["--rerun-mode", "report_stats"], "--rerun-mode=report_stats"),
        (["--rotary-percent", "1.0"], None),  # Megatron's default: what tricorn does
        (["--rotary-percent", "0.5"], "--rotary-percent=0.5"),
        (["--optimizer", "sgd"], "--optimizer=sgd"),
        (["--batch-size", "4"], "--batch-size=4 (use --micro-batch-size)"),
    ],
)
def test_refusals_are_value_wise(flags, refused):
    if refused is None:
        assert flags[0] in (_parse(*flags).megatron_notice or "")
    else:
        with pytest.raises(ConfigError, match="Megatron flags tricorn does not implement") as e:
            _parse(*flags)
        assert refused in str(e.value)


def test_a_megatron_command_line_gets_megatrons_defaults_where_tricorns_differ(tmp_path):
    cfg = _parse("--use-cpu-initialization", "--swiglu", "--hidden-size", "96", "--normalization", "RMSNorm")
    m = cfg.model
    # Not given: Megatron's (learned positions, dropout 0.1, SwiGLU's 2/3 x 4h down to a multiple of 64); given: kept.
    assert (m.position_embedding_type, m.hidden_dropout, m.attention_dropout, m.ffn_hidden_size) == (
        "learned_absolute",
        0.1,
        0.1,
        256,
    )
    assert m.normalization == "RMSNorm" and "--position-embedding-type learned_absolute" in cfg.megatron_notice
    assert _parse("--swiglu").model.position_embedding_type == "rope"  # tricorn's own command line: tricorn's defaults
    yaml = tmp_path / "run.yaml"
    yaml.write_text("model:\n  num_layers: 2\n")
    assert _parse("--config", str(yaml), "--use-cpu-initialization").model.normalization == "RMSNorm"  # a --config file
    assert _parse("--model-preset", "tiny", "--use-cpu-initialization").model.normalization == "RMSNorm"  # a preset's


def test_megatron_yaml_lists_the_math_a_checkpoints_args_ask_for():
    args = {"hidden_size": 64, "num_attention_heads": 4, "add_bias_linear": True, "add_qkv_bias": True}
    args.update(kv_channels=16, ckpt_format="torch", rerun_mode="validate_results", exit_signal="Signals.SIGTERM")
    assert not_reproduced(args) == []  # the format and the rerun machine say how Megatron ran, not what it trained
    args.update(eod_mask_loss=True, calculate_per_token_loss=False, optimizer="sgd", tokenizer_type="BertWordPieceLowerCase")
    listed = not_reproduced(args)  # --calculate-per-token-loss is tricorn's flag too, either way
    assert listed == [
        "--optimizer=sgd",
        "--eod-mask-loss=True",
        "--tokenizer-type=BertWordPieceLowerCase",
    ], listed


def test_the_dump_is_megatron_lm_core_v0_19_0s_parser():
    assert megatron_flags.megatron_version() == "core_v0.19.0" and len(megatron_options()) == 807
    by_flag = {f: o for o in megatron_options() for f in o.flags}
    assert by_flag["--lr-decay-style"].choices == ("constant", "linear", "cosine", "inverse-square-root", "WSD")
    assert by_flag["--distributed-backend"].default == "nccl" and by_flag["--hidden-dropout"].default == 0.1
    assert Path(megatron_flags.ARGS_FILE).parent.name == "tricorn"  # read at run time: part of the package
