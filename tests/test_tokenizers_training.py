"""Real tokenizers end to end: preprocess, then train; and the tokenizer that import-hf keeps with a checkpoint.

- A llama3-8b-shaped tiny run (the preset's vocabulary, GQA and RoPE base at 1 layer x 64) preprocesses with
  Llama 3's real tokenizer.model and trains for a few iterations.
- import-hf of a directory with tokenizer.json keeps it in SAVE/tokenizer/; pretrain_gpt.py with the printed
  command (plus data and batch flags) trains on text preprocessed with that tokenizer; export-hf writes the
  files back; a tokenizer of another vocabulary with that checkpoint is refused before launch.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import real_tokenizers as real
from harness import run_layout
from test_hf import save_hf

from tricorn.checkpoint.interop.hf import export_hf, import_hf
from tricorn.data.preprocess import main as preprocess_main

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests/fixtures/tokenizer_corpus.jsonl"
TRAIN = "--device cpu --seq-length 32 --micro-batch-size 2 --global-batch-size 2 --train-iters 3 --lr 1e-3 --log-interval 1 --split 1,0,0 --eval-iters 0".split()


def _fetch(fn):
    try:
        return fn()
    except real.Unavailable as e:
        pytest.skip(f"real tokenizer files unavailable: {e}")


def _preprocess(out: Path, tokenizer_flags: list[str]) -> str:
    assert (
        preprocess_main(
            ["--input", str(CORPUS), "--output-prefix", str(out), "--append-eod", "--log-interval", "0", *tokenizer_flags]
        )
        == 0
    )
    return f"{out}_text_document"


def test_llama3_shaped_tiny_run_trains_on_llama3_tokenizer_model(tmp_path):
    model = str(_fetch(real.llama3_tokenizer_model))
    tok = ["--tokenizer-type", "Llama3Tokenizer", "--tokenizer-model", model]
    data = _preprocess(tmp_path / "llama3", tok)
    # llama3-8b's shape, but tiny (a preset's width cannot be overridden: its own flags instead)
    tiny = "--num-layers 1 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --num-query-groups 2".split()
    tiny += "--group-query-attention --swiglu --disable-bias-linear --untie-embeddings-and-output-weights".split()
    tiny += "--position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --vocab-size 128256".split()
    run = run_layout([*tiny, *tok, *TRAIN, "--data-path", data], 1, tmp_path / "run")
    losses = [r["loss"] for r in run.records if "loss" in r]
    # 128,256 tokens: a fresh model's loss starts near ln(128256) = 11.76
    assert len(losses) == 3 and all(10 < loss < 13 for loss in losses), losses


def _tiny_hf_with_tokenizer(path: Path, tokenizer_dir: Path, vocab: int) -> None:
    save_hf(path, sharded=False, vocab_size=vocab, num_hidden_layers=1, max_position_embeddings=64, tie_word_embeddings=True)
    for f in tokenizer_dir.iterdir():
        shutil.copyfile(f, path / f.name)


def test_import_hf_keeps_the_tokenizer_and_the_printed_command_trains(tmp_path):
    tokenizer_dir = _fetch(real.hf_gpt2_bos_dir)
    _tiny_hf_with_tokenizer(tmp_path / "hf", tokenizer_dir, 50257)
    printed: list[str] = []
    import_hf(tmp_path / "hf", tmp_path / "ckpt", console=printed.append)
    assert (tmp_path / "ckpt/tokenizer/tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()
    command = next(line for line in printed if line.startswith("train from it with: "))
    flags = re.sub(r" \(and --seq-length.*", "", command.removeprefix("train from it with: ")).split()
    at = flags.index("--tokenizer-model")
    assert flags[at - 2 : at + 2] == [
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(tmp_path / "ckpt/tokenizer"),
    ]
    config = (tmp_path / "ckpt/iter_0000000/config.yaml").read_text()
    assert "tokenizer_type: HuggingFaceTokenizer" in config and str((tmp_path / "ckpt/tokenizer").resolve()) in config
    # The user preprocesses with the kept tokenizer, then runs the printed command with data and batch flags only.
    data = _preprocess(tmp_path / "corpus", flags[at - 2 : at + 2])
    run = run_layout([*flags, *TRAIN, "--data-path", data], 1, tmp_path / "run")
    assert "training starts at iteration 0" in run.stdout
    assert [r["iteration"] for r in run.records if "loss" in r] == [1, 2, 3]
    # export-hf writes the tokenizer back without --tokenizer.
    export_hf(tmp_path / "ckpt", tmp_path / "out", console=lambda _: None)
    assert json.loads((tmp_path / "out/tokenizer_config.json").read_text())["add_bos_token"] is True
    assert (tmp_path / "out/tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()
    # Data and checkpoint from another tokenizer (GPT-2 plus two added tokens) are refused before launch.
    vocab, merges = real.gpt2_vocab_merges()
    other = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab), "--merge-file", str(merges)]
    other += ["--tokenizer-special-tokens", *[f"<|extra_{i}|>" for i in range(200)]]
    model = [f for i, f in enumerate(flags[: at - 2]) if "--vocab-size" not in flags[max(i - 1, 0) : i + 1]]
    bad = run_layout([*model, *flags[at + 2 :], *other, *TRAIN, "--data-path", data], 1, tmp_path / "bad", check=False)
    assert bad.returncode == 2 and "has a vocabulary of 50257 but tokenizer" in bad.stderr
