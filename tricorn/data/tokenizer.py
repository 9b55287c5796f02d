"""Tokenizers: the interface, NullTokenizer, SentencePieceTokenizer, the type -> class table, and `tricorn tokenizer train`.

Every tokenizer has one small interface: encode, encode_batch, decode, vocab_size, eod, pad and bos (-1:
none). Every Megatron --tokenizer-type below is accepted, by preprocessing and by training alike, with
megatron-core (>= 0.18) semantics; TokenizerOptions holds Megatron's tokenizer flags:

- NullTokenizer(V): text is whitespace-separated token ids; vocabulary V, eod V - 1 (or
  --null-tokenizer-eod-id), pad --null-tokenizer-pad-id (-1: none). With --legacy-tokenizer, legacy
  Megatron's: eod is id V on top of the V text ids, vocabulary V + 1.
- SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer (model):
  vocab_size is the model's piece count, eod its </s> id, pad its <pad> id
  (none when it has none); no BOS. With --legacy-tokenizer, Llama2Tokenizer
  puts BOS before every document as legacy Megatron's did (legacy
  SentencePieceTokenizer, with its own added special tokens, is refused).
- GPT2BPETokenizer, HuggingFaceTokenizer: tricorn/data/hf_tokenizer.py (the `tokenizers` library).
- TikTokenizer, and tricorn's Llama3Tokenizer (Llama 3's tokenizer.model): tricorn/data/tiktoken_tokenizers.py
  (the `tiktoken` library). Those modules, and their libraries, are imported only when such a type is built.
- loss_pad_id: the id whose labels are left out of the loss, -1 when the pad
  id is missing or shared with eod/BOS (megatron-core then masks nothing).

`tricorn tokenizer train` runs sentencepiece's own BPE trainer with settings
that suit source code as well as prose: identity normalisation and kept
whitespace (so decode(encode(x)) == x and indentation survives), byte fallback
(no <unk>, newlines become byte tokens), split digits.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import importlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from tricorn.data.errors import DataError


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eod: int
    pad: int  # -1: none
    bos: int  # -1: none

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class NullTokenizer:
    """Text is already token ids separated by whitespace; ids must lie in [0, vocab_size)."""

    name = "NullTokenizer"
    bos = -1

    def __init__(self, vocab_size: int, legacy: bool = False, eod_id: Optional[int] = None, pad_id: int = -1):
        if vocab_size < 2:
            raise DataError(f"NullTokenizer needs --vocab-size of at least 2, got {vocab_size}")
        # Legacy Megatron adds eod as id V after the V text ids; megatron-core makes eod the last of V ids.
        self.vocab_size = int(vocab_size) + (1 if legacy else 0)
        self.eod = self.vocab_size - 1 if eod_id is None else int(eod_id)
        self.pad = int(pad_id)  # megatron-core's NullTokenizer: -1 (none) unless --null-tokenizer-pad-id
        for flag, value in (("--null-tokenizer-eod-id", self.eod), ("--null-tokenizer-pad-id", self.pad)):
            if value >= self.vocab_size or value < -1 or (value == -1 and flag.endswith("eod-id")):
                raise DataError(
                    f"{flag} {value} is outside the vocabulary [0, {self.vocab_size}); raise --vocab-size or lower it"
                )
        self._text_ids = int(vocab_size)

    def encode(self, text: str) -> list[int]:
        ids = [int(x) for x in text.split()]
        for i in ids:
            if not 0 <= i < self._text_ids:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self._text_ids})")
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

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
            other = tokenizer_file_kind(model_path)
            reader = f"; it looks like {other}" if other else ""
            raise DataError(f"--tokenizer-model {model_path} is not a sentencepiece model ({first}){reader}") from None
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

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode([int(i) for i in ids])


# Every Megatron --tokenizer-type tricorn reads, and the class (module:name) that reads it; the sentencepiece
# ones share one class (see the module docstring). Llama3Tokenizer is tricorn's own (Llama 3's tokenizer.model).
TOKENIZER_TYPES: dict[str, str] = {
    "NullTokenizer": "NullTokenizer",
    "SentencePieceTokenizer": "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer": "SentencePieceTokenizer",
    "Llama2Tokenizer": "SentencePieceTokenizer",
    "GPT2BPETokenizer": "tricorn.data.hf_tokenizer:GPT2BPETokenizer",
    "HuggingFaceTokenizer": "tricorn.data.hf_tokenizer:HuggingFaceTokenizer",
    "TikTokenizer": "tricorn.data.tiktoken_tokenizers:TikTokenizer",
    "Llama3Tokenizer": "tricorn.data.tiktoken_tokenizers:Llama3Tokenizer",
}


@dataclass(frozen=True)
class TokenizerOptions:
    """Everything that picks and configures a tokenizer: Megatron's tokenizer flags (picklable, for the workers).

    vocab_size is the model's --vocab-size: NullTokenizer's vocabulary, TikTokenizer's (default 131072),
    and for the other types only a floor checked against the tokenizer's own.
    """

    tokenizer_type: str
    tokenizer_model: Optional[str] = None
    vocab_size: Optional[int] = None
    legacy: bool = False
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    special_tokens: Optional[tuple[str, ...]] = None
    tiktoken_pattern: Optional[str] = None
    tiktoken_num_special_tokens: int = 1000
    hf_include_special_tokens: bool = True
    hf_use_fast: bool = True
    trust_remote_code: bool = False
    null_eod_id: Optional[int] = None
    null_pad_id: int = -1

    @classmethod
    def from_config(cls, cfg: Any) -> TokenizerOptions:
        d = cfg.data
        return cls(
            d.tokenizer_type,
            d.tokenizer_model,
            cfg.model.vocab_size,
            d.legacy_tokenizer,
            d.vocab_file,
            d.merge_file,
            tuple(d.tokenizer_special_tokens) if d.tokenizer_special_tokens else None,
            d.tiktoken_pattern,
            d.tiktoken_num_special_tokens,
            not d.tokenizer_hf_no_include_special_tokens,
            not d.tokenizer_hf_no_use_fast,
            d.trust_remote_code,
            d.null_tokenizer_eod_id,
            d.null_tokenizer_pad_id,
        )

    def source(self) -> str:
        """The file the tokenizer comes from, for messages."""
        return self.tokenizer_model or self.vocab_file or self.tokenizer_type


# Built tokenizers by (options, the files' sizes and times): a run builds its tokenizer before launch and again for
# the loaders, and a 128k-token BPE takes a second or two to load. A changed file is a new key.
_built: dict[tuple, Tokenizer] = {}
_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json", "added_tokens.json")


def _file_stamps(o: TokenizerOptions) -> tuple:
    stamps = []
    for path in (o.tokenizer_model, o.vocab_file, o.merge_file):
        for f in [os.path.join(path, n) for n in _HF_FILES] if path and os.path.isdir(path) else [path]:
            try:
                st = os.stat(f) if f else None
            except OSError:
                st = None
            stamps.append((f, st.st_size, st.st_mtime_ns) if st else (f, None, None))
    return tuple(stamps)


def build_tokenizer_with(o: TokenizerOptions) -> Tokenizer:
    """The tokenizer the options name (DataError, one line, when its files are missing or wrong); cached per process."""
    if o.tokenizer_type not in VOCAB_FROM_FLAG and o.vocab_size is not None:
        o = dataclasses.replace(o, vocab_size=None)  # only a floor for these types: the same tokenizer either way
    key = (o, _file_stamps(o))
    if key not in _built:
        if len(_built) >= 4:
            _built.clear()
        _built[key] = _build(o)
    return _built[key]


def _build(o: TokenizerOptions) -> Tokenizer:
    kind = TOKENIZER_TYPES.get(o.tokenizer_type)
    if kind is None:
        raise DataError(f"unknown --tokenizer-type {o.tokenizer_type}; use one of {', '.join(TOKENIZER_TYPES)}")
    if o.special_tokens and o.tokenizer_type not in ("GPT2BPETokenizer", "HuggingFaceTokenizer", "TikTokenizer"):
        raise DataError(
            f"--tokenizer-special-tokens applies to GPT2BPETokenizer, HuggingFaceTokenizer and TikTokenizer, not {o.tokenizer_type}"
        )
    if ":" in kind:
        module, name = kind.split(":")
        return getattr(importlib.import_module(module), name).from_options(o)
    if kind == "NullTokenizer":
        if o.vocab_size is None:
            raise DataError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(o.vocab_size, o.legacy, o.null_eod_id, o.null_pad_id)
    if o.legacy and o.tokenizer_type == "SentencePieceTokenizer":
        raise DataError(
            "--legacy-tokenizer with SentencePieceTokenizer (legacy Megatron's, with its own added special tokens) "
            "is not supported; use GPTSentencePieceTokenizer or Llama2Tokenizer, or drop --legacy-tokenizer"
        )
    if not o.tokenizer_model:
        raise DataError(f"--tokenizer-type {o.tokenizer_type} needs --tokenizer-model FILE.model")
    return SentencePieceTokenizer(o.tokenizer_model, add_bos=o.legacy and o.tokenizer_type == "Llama2Tokenizer")


# The types whose vocabulary is --vocab-size itself; every other type has its own, which --vocab-size may only exceed.
VOCAB_FROM_FLAG = ("NullTokenizer", "TikTokenizer")


def check_vocab_size(tokenizer: Tokenizer, o: TokenizerOptions) -> None:
    """A --vocab-size below the tokenizer's vocabulary is refused: its ids past it would have no embedding row."""
    if o.vocab_size is not None and o.tokenizer_type not in VOCAB_FROM_FLAG and o.vocab_size < tokenizer.vocab_size:
        raise DataError(
            f"--vocab-size {o.vocab_size} is smaller than the vocabulary of tokenizer {o.source()} ({tokenizer.vocab_size} "
            f"tokens); raise it to at least {tokenizer.vocab_size} or leave it out to use the tokenizer's"
        )


def tokenizer_file_kind(path: str) -> str:
    """What a tokenizer file looks like, naming the --tokenizer-type that reads it ("" when unrecognised).

    Read from its first bytes only, for the one-line error when a file is given to the wrong type.
    """
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            return "a Hugging Face directory (--tokenizer-type HuggingFaceTokenizer reads it)"
        return ""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        return ""
    text = head.lstrip()
    if text.startswith(b"["):
        return "a TikTokenizer JSON vocabulary (--tokenizer-type TikTokenizer reads it)"
    if text.startswith(b"{"):
        if b'"model"' in head or b'"added_tokens"' in head or b'"truncation"' in head:
            return "a Hugging Face tokenizer.json (--tokenizer-type HuggingFaceTokenizer reads its directory)"
        if b'"config"' in head and b'"vocab"' in head:
            return "a Tekken JSON vocabulary (--tokenizer-type TikTokenizer reads it)"
        return "a JSON vocabulary such as GPT-2's vocab.json (--tokenizer-type GPT2BPETokenizer reads it with --vocab-file)"
    if text.startswith(b"#version"):
        return "a BPE merges file (--tokenizer-type GPT2BPETokenizer reads it with --merge-file)"
    first = text.split(b"\n", 1)[0].split()
    if len(first) == 2 and first[1].isdigit() and _is_base64(first[0]):
        return "a tiktoken base64 file such as Llama 3's tokenizer.model (--tokenizer-type Llama3Tokenizer reads it)"
    if head[:1] == b"\n":  # a protobuf field 1 (pieces), as every sentencepiece model begins
        return "a SentencePiece model (--tokenizer-type SentencePieceTokenizer or Llama2Tokenizer reads it)"
    return ""


def _is_base64(token: bytes) -> bool:
    import binascii

    try:
        binascii.a2b_base64(token)
    except binascii.Error:
        return False
    return True


def wrong_kind(path: str, expected: str) -> str:
    """The tail of the one-line error for a file of the wrong format: what it seems to be, or what was expected."""
    kind = tokenizer_file_kind(path)
    return f"it looks like {kind}" if kind else f"expected {expected}"


def loss_pad_id(tokenizer: Tokenizer) -> int:
    """The id whose labels leave the loss: pad, unless missing or shared with eod/BOS (megatron-core's rule)."""
    pad = int(tokenizer.pad)
    return pad if pad >= 0 and pad not in (tokenizer.eod, getattr(tokenizer, "bos", -1)) else -1


def build_tokenizer(cfg: Any) -> Tokenizer:
    """The tokenizer a Config names (its data section's tokenizer flags and cfg.model.vocab_size)."""
    return build_tokenizer_with(TokenizerOptions.from_config(cfg))


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
