"""tricorn's byte-level BPE tokenizers against Megatron's, on real tokenizer files fetched from the registries.

- `tricorn preprocess` writes the .bin/.idx that Megatron-LM's tools/preprocess_data.py wrote (core_v0.19.0,
  megatron-core 0.19.2, transformers 4.57.6) byte for byte, per tokenizer type, with and without
  --append-eod (tests/fixtures/megatron_tokenizers.json, made by scripts/make_tokenizer_fixtures.py; Megatron's
  --workers 1 and 2 agreed there, and tricorn's --workers 2 is checked here too).
- Llama3Tokenizer on Llama 3's tokenizer.model writes what Megatron's HuggingFaceTokenizer wrote for the
  converted Hugging Face directory, and a Tekken file itself reads as Megatron's list of its ranks.
- Megatron's golden ids (its unit tests) come out of the real files.
- The transformers replay of HuggingFaceTokenizer equals transformers itself on variants of the loading rules.
"""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from pathlib import Path

import numpy as np
import pytest
import real_tokenizers as real

from tricorn.data import preprocess as prep
from tricorn.data.errors import DataError
from tricorn.data.indexed import IndexedDataset
from tricorn.data.tiktoken_tokenizers import LLAMA3_PATTERN, LLAMA3_SPECIAL_TOKENS
from tricorn.data.tokenizer import TokenizerOptions, build_tokenizer_with

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = json.loads((ROOT / "tests/fixtures/megatron_tokenizers.json").read_text())
CORPORA = {"text": ROOT / "tests/fixtures/tokenizer_corpus.jsonl", "null": ROOT / "tests/fixtures/tokenizer_null_corpus.jsonl"}
FIXTURE_TEXTS = [json.loads(line)["text"] for line in CORPORA["text"].read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="session")
def files() -> dict[str, str]:
    """The real files (fetched once per machine), each the very input Megatron's fixture was made from."""
    try:
        paths = {name: fn() for name, fn in real.FIXTURE_INPUTS.items()}
        paths["llama3_model"], paths["tekken"] = real.llama3_tokenizer_model(), real.tekken_json()
    except real.Unavailable as e:
        pytest.skip(f"real tokenizer files unavailable: {e}")
    for name, digest in FIXTURE["inputs"].items():
        assert real.sha256(paths[name]) == digest, f"{paths[name]} is not the file Megatron's fixture was made from"
    for name, path in CORPORA.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == FIXTURE["corpora"][name]
    return {k: str(v) for k, v in paths.items()}


def _flags(flags: list[str], files: dict[str, str]) -> list[str]:
    return [files[f[1:-1]] if f.startswith("{") else f for f in flags]


def _ids(entry: dict) -> np.ndarray:
    return np.frombuffer(zlib.decompress(base64.b64decode(entry["ids_int32_zlib_base64"])), "<i4")


def _run(tmp_path: Path, name: str, corpus: str, flags: list[str], eod: bool, workers: int = 1) -> Path:
    out = tmp_path / name
    argv = ["--input", str(CORPORA[corpus]), "--output-prefix", str(out), "--workers", str(workers), "--log-interval", "0"]
    assert prep.main(argv + flags + (["--append-eod"] if eod else [])) == 0
    return Path(f"{out}_text_document")


def assert_megatron_bytes(prefix: Path, expected: dict, what: str) -> None:
    got = {k: hashlib.sha256(Path(f"{prefix}.{k}").read_bytes()).hexdigest() for k in ("bin", "idx")}
    if got == {"bin": expected["bin_sha256"], "idx": expected["idx_sha256"]}:
        return
    ds = IndexedDataset(str(prefix))  # say where: the first document whose ids differ
    ours = np.concatenate([np.asarray(ds[i], np.int64) for i in range(len(ds))])
    theirs = _ids(expected)
    lengths = [int(n) for n in ds.sequence_lengths]
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    raise AssertionError(
        f"{what}: not Megatron's bytes; dtype {ds.dtype} vs {expected['dtype']}, lengths equal: "
        f"{lengths == expected['lengths']}, first differing token {at}: ours {ours[at : at + 8].tolist()} "
        f"theirs {theirs[at : at + 8].tolist()}"
    )


@pytest.mark.parametrize("case", sorted(FIXTURE["cases"]))
def test_preprocess_writes_megatron_bytes(files, tmp_path, case):
    """Same jsonl, same flags (Megatron's names) -> the .bin/.idx Megatron-LM's preprocess_data.py wrote."""
    spec = FIXTURE["cases"][case]
    for eod in (False, True):
        prefix = _run(tmp_path, f"{case}-{eod}", spec["corpus"], _flags(spec["flags"], files), eod)
        assert_megatron_bytes(prefix, spec["eod" if eod else "plain"], f"{case} eod={eod}")


def test_two_workers_write_the_same_bytes(files, tmp_path, monkeypatch):
    """--workers 2 with chunks of 4 lines (the corpus in 9 chunks, spread over the workers): Megatron's bytes."""
    monkeypatch.setattr(prep, "CHUNK_LINES", 4)
    spec = FIXTURE["cases"]["hf-gpt2-bos"]
    prefix = _run(tmp_path, "w2", spec["corpus"], _flags(spec["flags"], files), True, workers=2)
    assert_megatron_bytes(prefix, spec["eod"], "hf-gpt2-bos at --workers 2")


@pytest.mark.parametrize("variant", ["plain", "eod", "nospecial"])
def test_llama3_tokenizer_model_writes_what_megatron_wrote_for_its_hf_directory(files, tmp_path, variant):
    """Llama 3's original tokenizer.model through Llama3Tokenizer = Megatron's HuggingFaceTokenizer on the HF directory."""
    flags = ["--tokenizer-type", "Llama3Tokenizer", "--tokenizer-model", files["llama3_model"]]
    case = "hf-llama3-nospecial" if variant == "nospecial" else "hf-llama3"
    extra = ["--tokenizer-hf-no-include-special-tokens"] if variant == "nospecial" else []
    prefix = _run(tmp_path, variant, "text", flags + extra, variant == "eod")
    assert_megatron_bytes(prefix, FIXTURE["cases"][case]["eod" if variant == "eod" else "plain"], f"Llama3Tokenizer {variant}")


def test_tekken_file_reads_as_megatrons_list(files, tmp_path):
    prefix = _run(tmp_path, "tekken", "text", ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", files["tekken"]], True)
    assert_megatron_bytes(prefix, FIXTURE["cases"]["tiktoken"]["eod"], "Tekken's own file")


def test_megatron_golden_ids_from_the_real_files(files):
    """The ids megatron-core's unit tests pin (tests/unit_tests/tokenizers/test_tokenizer.py), and the special ids."""
    gpt2 = build_tokenizer_with(
        TokenizerOptions("GPT2BPETokenizer", vocab_file=files["gpt2_vocab"], merge_file=files["gpt2_merges"])
    )
    assert gpt2.encode("hi how are you?") == [5303, 703, 389, 345, 30]
    assert gpt2.decode([40, 1101, 3734, 5176, 13]) == "I'm fine thanks."
    assert (gpt2.vocab_size, gpt2.eod, gpt2.bos, gpt2.pad) == (50257, 50256, 50256, -1)
    tik = build_tokenizer_with(TokenizerOptions("TikTokenizer", files["megatron_tiktoken"]))
    assert tik.encode("hi how are you?") == [8101, 2606, 1584, 1636, 1063]
    assert tik.encode("<unk>I</s><mask>") == [0, 1073, 2, 3]
    assert tik.decode([1073, 4525, 7771, 14899, 1046]) == "I'm fine thanks."
    assert (tik.vocab_size, tik.eod, tik.bos, tik.pad) == (131072, 2, 1, 4)
    llama = build_tokenizer_with(TokenizerOptions("Llama3Tokenizer", files["llama3_model"]))
    assert (llama.vocab_size, llama.bos, llama.eod, llama.pad) == (128256, 128000, 128001, -1)
    text = "hi how are you? <|eot_id|>"
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    # tiktoken's own reading of the file, with the pattern and specials of llama-models' own Tokenizer (read from the
    # wheel's source, not tricorn's constants): the ids after BOS are its ids.
    pattern, named = real.llama3_reference()
    assert (pattern, named) == (LLAMA3_PATTERN, LLAMA3_SPECIAL_TOKENS)
    specials = {t: 128000 + i for i, t in enumerate(named)}
    ref = tiktoken.Encoding(
        "ref", pat_str=pattern, mergeable_ranks=load_tiktoken_bpe(files["llama3_model"]), special_tokens=specials
    )
    assert (
        llama.encode(text)
        == [128000] + ref.encode(text, allowed_special="all")
        == [128000, 6151, 1268, 527, 499, 30, 220, 128009]
    )
    assert [llama.encode(t)[1:] for t in FIXTURE_TEXTS] == [ref.encode(t, allowed_special="all") for t in FIXTURE_TEXTS]


def test_bos_equal_to_eos_keeps_both(files):
    """A tokenizer whose BOS is its EOS (GPT-2's <|endoftext|>, added before each text): both stay (torchtitan #3279)."""
    tok = build_tokenizer_with(TokenizerOptions("HuggingFaceTokenizer", files["hf_gpt2_bos"]))
    assert tok.bos == tok.eod == 50256
    ids = tok.encode("hi how are you?")
    assert ids == [50256, 5303, 703, 389, 345, 30]
    plain = FIXTURE["cases"]["hf-gpt2-bos"]["eod"]  # Megatron's: each document BOS ... EOD
    first = _ids(plain)[: plain["lengths"][0]].tolist()
    assert first == [50256, 5303, 703, 389, 345, 30, 50256]


# ---------------------------------------------------------------- the replay of transformers, against transformers


def _variant(tmp_path: Path, base: Path, name: str, config: dict, extra: dict | None = None) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "tokenizer.json").symlink_to(base / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for fname, obj in (extra or {}).items():
        (folder / fname).write_text(json.dumps(obj))
    return folder


def test_huggingface_loading_rules_match_transformers(files, tmp_path):
    """Class hooks, legacy special_tokens_map.json, added tokens, split_special_tokens, add_prefix_space: same ids and size."""
    transformers = pytest.importorskip("transformers")
    gpt2 = Path(files["hf_gpt2_bos"])
    text = FIXTURE_TEXTS + ["<|im_start|>x<|im_end|> <new> Ġ"]
    eos_map = {"content": "<|endoftext|>", "lstrip": False, "normalized": True, "rstrip": False, "single_word": False}
    im_end = {
        "content": "<|im_end|>",
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "single_word": False,
        "special": True,
    }
    variants = {  # each exercises several rules at once: a transformers load costs a second on this box
        "llama-class": {
            "tokenizer_class": "LlamaTokenizerFast",
            "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "add_eos_token": True,
            "unk_token": None,
            "added_tokens_decoder": {"50257": im_end},
        },
        "neox-no-bos": {"tokenizer_class": "GPTNeoXTokenizerFast"},
        "gpt2-legacy-map": {
            "tokenizer_class": "GPT2TokenizerFast",
            "split_special_tokens": True,
            "add_prefix_space": True,
            "pad_token": "<new>",
        },
    }
    extra = {
        "gpt2-legacy-map": {"special_tokens_map.json": {"eos_token": eos_map, "additional_special_tokens": ["<|im_start|>"]}}
    }
    for name, config in variants.items():
        folder = _variant(tmp_path, gpt2, name, config, extra.get(name))
        theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
        ours = build_tokenizer_with(TokenizerOptions("HuggingFaceTokenizer", str(folder)))
        assert ours.vocab_size == len(theirs), name
        assert ours.eod == (theirs.eos_token_id if theirs.eos_token_id is not None else -1), name
        assert [ours.encode(t) for t in text] == [theirs(t).input_ids for t in text], name


# ---------------------------------------------------------------- bad input: one line naming the file and what to do


def _error(o: TokenizerOptions) -> str:
    with pytest.raises(DataError) as e:
        build_tokenizer_with(o)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_bad_tokenizer_files_are_one_line_errors(files, tmp_path):
    missing = str(tmp_path / "missing")
    assert "--vocab-file" in _error(TokenizerOptions("GPT2BPETokenizer", vocab_file=missing, merge_file=files["gpt2_merges"]))
    assert "--merge-file" in _error(TokenizerOptions("GPT2BPETokenizer", vocab_file=files["gpt2_vocab"]))
    swapped = _error(TokenizerOptions("GPT2BPETokenizer", vocab_file=files["gpt2_merges"], merge_file=files["gpt2_vocab"]))
    assert files["gpt2_merges"] in swapped and "merges file" in swapped
    no_json = tmp_path / "nojson"
    no_json.mkdir()
    assert "has no tokenizer.json" in _error(TokenizerOptions("HuggingFaceTokenizer", str(no_json)))
    assert "downloads nothing" in _error(TokenizerOptions("HuggingFaceTokenizer", "meta-llama/Llama-3.1-8B"))
    # A file of the wrong format says which type reads it.
    assert "Llama3Tokenizer reads it" in _error(TokenizerOptions("TikTokenizer", files["llama3_model"]))
    assert "TikTokenizer reads it" in _error(TokenizerOptions("Llama3Tokenizer", files["megatron_tiktoken"]))
    assert "HuggingFaceTokenizer" in _error(TokenizerOptions("Llama3Tokenizer", str(Path(files["hf_llama3"]) / "tokenizer.json")))
    assert "Llama3Tokenizer reads it" in _error(TokenizerOptions("SentencePieceTokenizer", files["llama3_model"]))
    assert "is a directory" in _error(TokenizerOptions("TikTokenizer", files["hf_llama3"]))
    with_code = _variant(
        tmp_path,
        Path(files["hf_gpt2_bos"]),
        "code",
        {"tokenizer_class": "MyTokenizer", "auto_map": {"AutoTokenizer": ["x.MyTokenizer", None]}},
    )
    refused = _error(TokenizerOptions("HuggingFaceTokenizer", str(with_code), trust_remote_code=True))
    assert "runs no code" in refused
    assert "MyTokenizer" in _error(TokenizerOptions("HuggingFaceTokenizer", str(with_code)))
    assert "not one of v1, v2" in _error(TokenizerOptions("TikTokenizer", files["megatron_tiktoken"], tiktoken_pattern="v3"))
    assert "lacks <mask> <pad> <cls> <sep>" in _error(
        TokenizerOptions("TikTokenizer", files["megatron_tiktoken"], special_tokens=("<unk>", "<s>", "</s>"))
    )


def test_preprocess_refuses_a_small_vocab_size_and_a_bad_pattern(files, tmp_path, capsys):
    base = ["--input", str(CORPORA["text"]), "--output-prefix", str(tmp_path / "o")]
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", files["gpt2_vocab"], "--merge-file", files["gpt2_merges"]]
    assert prep.main(base + gpt2 + ["--vocab-size", "50000"]) == 1
    err = capsys.readouterr().err.strip()
    assert "--vocab-size 50000 is smaller than the vocabulary of tokenizer" in err and "50257" in err and "\n" not in err
    with pytest.raises(SystemExit):  # argparse: invalid choice, one usage line
        prep.main(
            base
            + ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", files["megatron_tiktoken"], "--tiktoken-pattern", "v3"]
        )
    assert "invalid choice: 'v3'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


def test_checkpoint_vocabulary_against_the_tokenizer(files, tmp_path):
    """--load: the checkpoint's vocabulary must be the tokenizer's, or that padded as Megatron pads it (then taken)."""
    from tricorn.config_args import config_from_args
    from tricorn.data.loader import prepare_vocab

    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", files["gpt2_vocab"], "--merge-file", files["gpt2_merges"]]
    data = _run(tmp_path, "gpt2", "text", gpt2, True)

    def errors_with_checkpoint(vocab: int, *flags: str):
        save = tmp_path / f"ckpt{vocab}"
        (save / "iter_0000000").mkdir(parents=True)
        (save / "latest_checkpointed_iteration.txt").write_text("0")
        (save / "iter_0000000/config.yaml").write_text(f"model:\n  vocab_size: {vocab}\n")
        cfg = config_from_args(["--device", "cpu", "--data-path", str(data), "--load", str(save), *gpt2, *flags], world_size=1)
        return prepare_vocab(cfg), cfg.model.vocab_size

    assert errors_with_checkpoint(50257) == ([], 50257)
    assert errors_with_checkpoint(50304) == ([], 50304)  # a Megatron checkpoint: GPT-2's vocabulary padded to 128
    errors, _ = errors_with_checkpoint(32000)
    assert len(errors) == 1 and "has a vocabulary of 32000 but tokenizer" in errors[0] and "50257" in errors[0]
    errors, _ = errors_with_checkpoint(128256, "--vocab-size", "128256")  # a bigger --vocab-size does not hide it
    assert len(errors) == 1 and "has a vocabulary of 128256" in errors[0]


def test_tokenizer_libraries_are_imported_only_to_tokenize():
    """A process that never builds a BPE tokenizer (a preprocess worker of another type, like its parent) pays nothing;
    nor torch: a worker imports what tokenizing needs."""
    import subprocess
    import sys

    code = (
        "import sys, tricorn.data.preprocess\n"
        "from tricorn.data.tokenizer import TokenizerOptions, build_tokenizer_with\n"
        "build_tokenizer_with(TokenizerOptions('NullTokenizer', vocab_size=10))\n"
        "print(sorted(m for m in ('tokenizers', 'tiktoken', 'transformers', 'torch') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
