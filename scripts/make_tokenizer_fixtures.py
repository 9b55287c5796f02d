"""Write tests/fixtures/megatron_tokenizers.json: what Megatron-LM's tools/preprocess_data.py writes for each tokenizer type.

Megatron-LM (core_v0.19.0) with megatron-core 0.19.2 and transformers 4.57.6 / tokenizers 0.22.2 /
tiktoken 0.14.0 tokenizes tests/fixtures/tokenizer_corpus.jsonl (written here) with real tokenizer files
(tests/real_tokenizers.py fetches them by pinned version; none is committed) for every case below, with
and without --append-eod, at --workers 1 and 2. The two worker counts must agree; the fixture stores the
sha256 of each .bin and .idx, the token ids and document lengths (so a failing test can show the first
differing document), and the sha256 of every input file, so the test knows it gives tricorn the same
inputs. tests/test_tokenizers_megatron.py runs `tricorn preprocess` on the same and compares bytes.

Megatron is not a test dependency; run this once in its own environment:

    /tmp/mcore/bin/python -m pip install --target /tmp/extra-tok transformers==4.57.6 tokenizers==0.22.2 \\
        tiktoken==0.14.0 sentencepiece==0.2.1
    PYTHONPATH=/tmp/extra-tok /tmp/mcore/bin/python scripts/make_tokenizer_fixtures.py --megatron-lm /tmp/Megatron-LM

(not with the checkout on PYTHONPATH: megatron.core must be the installed megatron-core, and the tool
appends the checkout after site-packages itself).

megatron-core's GPT2BPETokenizer loads AutoTokenizer.from_pretrained("gpt2", vocab_file=..., merges_file=...):
offline, "gpt2" resolves to a directory of that name in the working directory, which this script makes
(config.json with model_type gpt2, and the same vocab.json and merges.txt).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import real_tokenizers  # noqa: E402

VERSIONS = {
    "megatron-core": "0.19.2",
    "Megatron-LM": "core_v0.19.0",
    "transformers": "4.57.6",
    "tokenizers": "0.22.2",
    "tiktoken": "0.14.0",
}

# The documents: prose, code, numbers, contractions in both cases, whitespace runs, CRLF, unicode that NFKC
# changes, emoji and combining marks, blank documents, and every type's special-token strings as plain text.
CORPUS = [
    "hi how are you?",
    "I'm fine thanks. It's what THEY'RE saying; we'll see, you'd think, I'VE been told.",
    "",
    " ",
    "\n",
    "   leading and trailing   ",
    "def f(x):\n    return  x\t# comment\n\n\nclass A:\n\tpass\r\n",
    "Numbers: 1 12 123 1234 12345 3.14159 -42 1,000,000 2024-06-30 0x1F",
    "naïve café — “quotes” ‘single’ «guillemets» …",
    "日本語のテキストと中文文本와 한국어",
    "emoji 🙂👍🏽 family 👨‍👩‍👧 flags 🇫🇷 keycap 1️⃣",
    "combining: e\u0301 a\u0308 ﬁ ﬂ Ａ１ ① ㍻ ½ ™ ℌ",
    "Hello <|endoftext|> world <|endoftext|>",
    "<|endoftext|>",
    "<|begin_of_text|>Llama <|end_of_text|> and <|eot_id|> <|start_header_id|>user<|end_header_id|>",
    "<|reserved_special_token_5|> <|python_tag|> <|finetune_right_pad_id|>",
    "<unk>I</s><mask> <s> <pad> <cls> <sep> <SPECIAL_42> <SPECIAL_999>",
    "<EOT> <META> <META_START> <META_END> <SOS> text",
    "<|im_start|>user\nhello<|im_end|>",
    "tabs\t\t\tand   spaces    and\n\n\n\nnewlines\r\n\r\nend",
    "a" * 300,
    " " * 200 + "x",
    "The quick brown fox jumps over the lazy dog. " * 20,
    "URL https://example.com/path?query=1&b=two#frag and email someone@example.org",
    'JSON {"key": [1, 2, {"nested": null}], "s": "\\u00e9"}',
    "Ελληνικά Русский текст עברית العربية हिन्दी ไทย",
    "zero\u200bwidth\u200djoiner\ufeffbom",
    "control \x01\x02\x1f chars and \u2028 line \u2029 separators",
    "MiXeD CaSe WoRdS and ALLCAPS and lowercase",
    "’s ’t 's 't 're 've 'm 'll 'd 'S 'T 'RE 'VE 'M 'LL 'D",
    "math: ∑ ∫ √ ≤ ≥ ≠ ∞ π ∂ x² x₁",
    "trailing newline\n",
    "    indented code block\n        more indent\n",
    "emoji only 🤖🤖🤖",
    "The end.",
]
# NullTokenizer's documents: ids separated by single spaces (megatron-core splits on ' '), none blank.
NULL_CORPUS = ["1 2 3", "999 0 5 5", "7", "10 20 30 40 50 60 70 80 90"]

# name -> (preprocess flags with {input} placeholders, corpus). The inputs are real_tokenizers functions.
CASES: dict[str, tuple[list[str], str]] = {
    "gpt2": (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{gpt2_vocab}", "--merge-file", "{gpt2_merges}"], "text"),
    "gpt2-special-slow": (
        ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{gpt2_vocab}", "--merge-file", "{gpt2_merges}"]
        + ["--tokenizer-special-tokens", "<|im_start|>", "<|im_end|>", "--tokenizer-hf-no-use-fast"],
        "text",
    ),
    "hf-gpt2-bos": (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "{hf_gpt2_bos}"], "text"),
    "hf-gpt2-bos-nospecial": (
        [
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            "{hf_gpt2_bos}",
            "--tokenizer-hf-no-include-special-tokens",
        ],
        "text",
    ),
    "hf-llama3": (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "{hf_llama3}"], "text"),
    "hf-llama3-nospecial": (
        [
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            "{hf_llama3}",
            "--tokenizer-hf-no-include-special-tokens",
        ],
        "text",
    ),
    "hf-anthropic": (
        [
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            "{hf_anthropic}",
            "--tokenizer-special-tokens",
            "<|im_start|>",
        ],
        "text",
    ),
    "tiktoken": (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "{megatron_tiktoken}"], "text"),
    "tiktoken-v1-small": (
        ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "{megatron_tiktoken}", "--tiktoken-pattern", "v1"]
        + ["--vocab-size", "50000", "--tiktoken-num-special-tokens", "100", "--tokenizer-special-tokens"]
        + ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>", "<|im_start|>"],
        "text",
    ),
    "null": (["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--null-tokenizer-eod-id", "5"], "null"),
}


def write_corpus(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")


def flags_with(flags: list[str], paths: dict[str, str]) -> list[str]:
    return [paths[f[1:-1]] if f.startswith("{") and f.endswith("}") else f for f in flags]


def read_output(prefix: Path) -> dict:
    """The .bin/.idx bytes' sha256 and, for diagnosis, the ids and lengths (parsed with megatron's reader)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix))
    ids = np.concatenate([np.asarray(ds[i], np.int64) for i in range(len(ds))] or [np.zeros(0, np.int64)])
    return {
        "bin_sha256": hashlib.sha256(Path(f"{prefix}.bin").read_bytes()).hexdigest(),
        "idx_sha256": hashlib.sha256(Path(f"{prefix}.idx").read_bytes()).hexdigest(),
        "dtype": ds.index.dtype.__name__,
        "lengths": [int(n) for n in ds.sequence_lengths],
        "document_indices": [int(i) for i in ds.document_indices],
        "tokens": int(ids.size),
        "ids_int32_zlib_base64": base64.b64encode(zlib.compress(ids.astype("<i4").tobytes(), 9)).decode(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", default="/tmp/Megatron-LM", help="Megatron-LM checkout (tools/preprocess_data.py)")
    parser.add_argument("--output", default=str(ROOT / "tests/fixtures/megatron_tokenizers.json"))
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    args = parser.parse_args()
    import megatron.core

    assert megatron.core.__version__ == VERSIONS["megatron-core"], megatron.core.__version__
    for name in ("transformers", "tokenizers", "tiktoken"):
        got = __import__(name).__version__
        assert got == VERSIONS[name], f"{name} {got}, want {VERSIONS[name]}"
    corpora = {
        "text": ROOT / "tests/fixtures/tokenizer_corpus.jsonl",
        "null": ROOT / "tests/fixtures/tokenizer_null_corpus.jsonl",
    }
    write_corpus(corpora["text"], CORPUS)
    write_corpus(corpora["null"], NULL_CORPUS)
    paths = {name: str(fn()) for name, fn in real_tokenizers.FIXTURE_INPUTS.items()}
    out = json.loads(Path(args.output).read_text()) if Path(args.output).is_file() else {"cases": {}}
    out.update(versions=VERSIONS, inputs={k: real_tokenizers.sha256(Path(p)) for k, p in paths.items()})
    out["corpora"] = {k: hashlib.sha256(p.read_bytes()).hexdigest() for k, p in corpora.items()}
    # Megatron's tool runs in this process, one call of its main() per run: its multiprocessing pool forks
    # from here, so megatron and transformers are imported once, not once per run. Its own sys.path edit
    # puts the checkout after site-packages: megatron.core is the installed 0.19.2 (checked above).
    sys.path.insert(0, f"{args.megatron_lm}/tools")
    import preprocess_data as tool  # an importable module: its pool pickles its Encoder's methods by reference

    assert megatron.core.__file__.startswith(sys.prefix), megatron.core.__file__
    os.environ["HF_HUB_OFFLINE"] = "1"
    with tempfile.TemporaryDirectory() as work:
        gpt2 = Path(work) / "gpt2"  # what AutoTokenizer.from_pretrained("gpt2") finds offline
        gpt2.mkdir()
        shutil.copy(paths["gpt2_vocab"], gpt2 / "vocab.json")
        shutil.copy(paths["gpt2_merges"], gpt2 / "merges.txt")
        (gpt2 / "config.json").write_text('{"model_type": "gpt2"}')
        os.chdir(work)
        for case in args.cases:
            flags, corpus = CASES[case]
            results = {}
            for eod in (False, True):
                seen = []
                for workers in (1, 2):
                    prefix = Path(work) / f"{case}-{eod}-{workers}"
                    argv = ["--input", str(corpora[corpus]), "--output-prefix", str(prefix), "--workers", str(workers)]
                    argv += ["--log-interval", "100000"] + flags_with(flags, paths) + (["--append-eod"] if eod else [])
                    sys.argv = ["preprocess_data.py", *argv]
                    tool.main()
                    seen.append(read_output(Path(f"{prefix}_text_document")))
                assert seen[0] == seen[1], f"{case} eod={eod}: megatron's --workers 1 and 2 differ"
                results["eod" if eod else "plain"] = seen[0]
                print(f"{case} eod={eod}: {seen[0]['tokens']} tokens, {seen[0]['dtype']}", flush=True)
            out["cases"][case] = {"flags": flags, "corpus": corpus, **results}
        os.chdir(ROOT)
    Path(args.output).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
