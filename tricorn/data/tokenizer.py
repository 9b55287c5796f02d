"""Tokenizers (NullTokenizer, SentencePieceTokenizer) and `tricorn tokenizer train`.

Both share one small interface: encode, decode, vocab_size, eod, pad (pad -1:
none). Every Megatron --tokenizer-type is accepted, by preprocessing and by
training alike, with megatron-core (>= 0.18) semantics:

- NullTokenizer(V): text is whitespace-separated token ids; vocabulary V, eod
  V - 1, no pad. With --legacy-tokenizer, legacy Megatron's: eod is id V on
  top of the V text ids, vocabulary V + 1.
- SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer (model):
  vocab_size is the model's piece count, eod its </s> id, pad its <pad> id
  (none when it has none); no BOS. With --legacy-tokenizer, Llama2Tokenizer
  puts BOS before every document as legacy Megatron's did (legacy
  SentencePieceTokenizer, with its own added special tokens, is refused).
- loss_pad_id: the id whose labels are left out of the loss, -1 when the pad
  id is missing or shared with eod/BOS (megatron-core then masks nothing).

`tricorn tokenizer train` runs sentencepiece's own BPE trainer with settings
that suit source code as well as prose: identity normalisation and kept
whitespace (so decode(encode(x)) == x and indentation survives), byte fallback
(no <unk>, newlines become byte tokens), split digits.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, Optional, Protocol

from tricorn.data.errors import DataError


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eod: int
    pad: int  # -1: none
    bos: int  # -1: none

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class NullTokenizer:
    """Text is already token ids separated by whitespace; ids must lie in [0, vocab_size)."""

    name = "NullTokenizer"
    pad = -1  # megatron-core's NullTokenizer has none
    bos = -1

    def __init__(self, vocab_size: int, legacy: bool = False):
        if vocab_size < 2:
            raise DataError(f"NullTokenizer needs --vocab-size of at least 2, got {vocab_size}")
        # Legacy Megatron adds eod as id V after the V text ids; megatron-core makes eod the last of V ids.
        self.vocab_size = int(vocab_size) + (1 if legacy else 0)
        self.eod = self.vocab_size - 1
        self._text_ids = int(vocab_size)

    def encode(self, text: str) -> list[int]:
        ids = [int(x) for x in text.split()]
        for i in ids:
            if not 0 <= i < self._text_ids:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self._text_ids})")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class SentencePieceTokenizer:
    """A sentencepiece model file; eod is its </s> (eos) id, pad its <pad> id (-1 when none).

    add_bos: every encoded text starts with the model's <s> (legacy Megatron's Llama2Tokenizer).
    """

    name = "SentencePieceTokenizer"

    def __init__(self, model_path: str, add_bos: bool = False):
        import sentencepiece as spm

        if model_path and os.path.isdir(model_path):
            raise DataError(f"--tokenizer-model {model_path} is a directory; name the .model file inside it")
        if not model_path or not os.path.isfile(model_path):
            raise DataError(f"--tokenizer-model {model_path} does not exist; train one with `tricorn tokenizer train`")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_path)
        except (RuntimeError, OSError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"--tokenizer-model {model_path} is not a sentencepiece model ({first})") from None
        self.model_path = model_path
        self.vocab_size = int(self._sp.get_piece_size())
        eos, pad = self._sp.eos_id(), self._sp.pad_id()
        if eos < 0:
            raise DataError(
                f"--tokenizer-model {model_path} has no </s> piece to use as end-of-document; retrain with eos_id set"
            )
        self.eod = int(eos)
        self.pad = int(pad)
        self.bos = int(self._sp.bos_id())
        if add_bos and self.bos < 0:
            raise DataError(f"--tokenizer-model {model_path} has no <s> piece for the legacy Llama2Tokenizer's BOS")
        self._prefix = [self.bos] if add_bos else []
        # Bound methods, not the keyword-parsing wrappers: this is the preprocessing hot loop.
        self._encode = self._sp.EncodeAsIds
        self._decode = self._sp.DecodeIds

    def encode(self, text: str) -> list[int]:
        ids = self._encode(text)
        return self._prefix + ids if self._prefix else ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode([int(i) for i in ids])


# Every Megatron --tokenizer-type tricorn reads; the sentencepiece ones share one class (see the module docstring).
TOKENIZER_TYPES: dict[str, str] = {
    "NullTokenizer": "NullTokenizer",
    "SentencePieceTokenizer": "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer": "SentencePieceTokenizer",
    "Llama2Tokenizer": "SentencePieceTokenizer",
}


def build_tokenizer_from(
    tokenizer_type: str, tokenizer_model: Optional[str], vocab_size: Optional[int], legacy: bool = False
) -> Tokenizer:
    kind = TOKENIZER_TYPES.get(tokenizer_type)
    if kind is None:
        raise DataError(f"unknown --tokenizer-type {tokenizer_type}; use one of {', '.join(TOKENIZER_TYPES)}")
    if kind == "NullTokenizer":
        if vocab_size is None:
            raise DataError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size, legacy)
    if legacy and tokenizer_type == "SentencePieceTokenizer":
        raise DataError(
            "--legacy-tokenizer with SentencePieceTokenizer (legacy Megatron's, with its own added special tokens) "
            "is not supported; use GPTSentencePieceTokenizer or Llama2Tokenizer, or drop --legacy-tokenizer"
        )
    if not tokenizer_model:
        raise DataError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model FILE.model")
    return SentencePieceTokenizer(tokenizer_model, add_bos=legacy and tokenizer_type == "Llama2Tokenizer")


def loss_pad_id(tokenizer: Tokenizer) -> int:
    """The id whose labels leave the loss: pad, unless missing or shared with eod/BOS (megatron-core's rule)."""
    pad = int(tokenizer.pad)
    return pad if pad >= 0 and pad not in (tokenizer.eod, getattr(tokenizer, "bos", -1)) else -1


def build_tokenizer(cfg: Any) -> Tokenizer:
    """The tokenizer a Config names (cfg.data.tokenizer_type/tokenizer_model/legacy_tokenizer, cfg.model.vocab_size)."""
    d = cfg.data
    return build_tokenizer_from(d.tokenizer_type, d.tokenizer_model, cfg.model.vocab_size, d.legacy_tokenizer)


# ---------------------------------------------------------------- training


def _open_text(path: str):
    return (
        gzip.open(path, "rt", encoding="utf-8", errors="replace")
        if path.endswith(".gz")
        else open(path, encoding="utf-8", errors="replace")
    )


def iter_training_lines(paths: Sequence[str], json_keys: Sequence[str]) -> Iterator[str]:
    """Non-blank lines of the documents: jsonl files contribute their json_keys fields, other files their lines.

    sentencepiece trains on one sentence per line; lines of code and prose are
    natural units and keep every sentence under its max_sentence_length.
    """
    for path in paths:
        is_jsonl = path.endswith((".jsonl", ".jsonl.gz", ".json", ".json.gz"))
        with _open_text(path) as fh:
            for raw in fh:
                if not is_jsonl:
                    if raw.strip():
                        yield raw.rstrip("\n")
                    continue
                try:
                    doc = json.loads(raw)
                except ValueError:
                    continue  # preprocessing reports bad lines; training just skips them
                if not isinstance(doc, dict):
                    continue
                for key in json_keys:
                    text = doc.get(key)
                    if isinstance(text, str):
                        yield from (line for line in text.split("\n") if line.strip())


def train_sentencepiece(
    inputs: Sequence[str],
    vocab_size: int,
    model_prefix: str,
    json_keys: Sequence[str] = ("text",),
    model_type: str = "bpe",
    input_sentence_size: int = 2_000_000,
    character_coverage: float = 0.9995,
    num_threads: Optional[int] = None,
    seed: int = 0,
) -> str:
    """Train with sentencepiece's trainer; writes <prefix>.model/.vocab atomically and returns the .model path."""
    import sentencepiece as spm

    for path in inputs:
        if not os.path.isfile(path):
            raise DataError(f"tokenizer input {path} does not exist")
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    tmp_prefix = f"{model_prefix}.tmp-{os.getpid()}"
    options = dict(
        model_prefix=tmp_prefix,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        # Sample at most this many lines: training time and memory stay bounded on big corpora.
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        num_threads=num_threads or min(8, os.cpu_count() or 1),
        minloglevel=2,
    )
    # Sampling and shuffling of input lines use sentencepiece's global generator: seed it for reproducible models.
    spm.set_random_generator_seed(seed)
    seen = [0]

    def counted() -> Iterator[str]:
        for line in iter_training_lines(inputs, json_keys):
            seen[0] += 1
            yield line

    try:
        spm.SentencePieceTrainer.train(sentence_iterator=counted(), **options)
    except RuntimeError as e:
        for ext in (".model", ".vocab"):
            if os.path.exists(tmp_prefix + ext):
                os.remove(tmp_prefix + ext)
        if seen[0] == 0:
            raise DataError(f"no text to train on in {' '.join(inputs)} (jsonl keys: {' '.join(json_keys)})") from None
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"sentencepiece training failed on {seen[0]} lines: {reason}") from None
    for ext in (".vocab", ".model"):
        os.replace(tmp_prefix + ext, model_prefix + ext)
    return model_prefix + ".model"


def cli_main(argv: Optional[list[str]] = None) -> int:
    """`tricorn tokenizer train --input FILES --vocab-size N --model-prefix P`."""
    parser = argparse.ArgumentParser(prog="tricorn tokenizer", description="Tokenizer tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a sentencepiece BPE model on jsonl or text files")
    train.add_argument("--input", nargs="+", required=True, help="jsonl(.gz) files (their --json-keys) or plain text files")
    train.add_argument("--vocab-size", type=int, required=True, help="pieces in the model, including 256 byte pieces")
    train.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    train.add_argument("--json-keys", nargs="+", default=["text"], help="jsonl fields to train on")
    train.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    train.add_argument("--input-sentence-size", type=int, default=2_000_000, help="lines sampled for training (0: all)")
    train.add_argument("--character-coverage", type=float, default=0.9995, help="rarer characters fall back to bytes")
    train.add_argument("--num-threads", type=int, default=None, help="trainer threads (default: min(8, CPUs))")
    train.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.time()
    try:
        model = train_sentencepiece(
            args.input,
            args.vocab_size,
            args.model_prefix,
            args.json_keys,
            args.model_type,
            args.input_sentence_size,
            args.character_coverage,
            args.num_threads,
            args.seed,
        )
        tok = SentencePieceTokenizer(model)
    except DataError as e:
        print(f"tricorn tokenizer: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {model} ({tok.vocab_size} pieces, eod={tok.eod}) in {time.time() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
