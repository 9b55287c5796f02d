"""TikTokenizer (Megatron's tiktoken JSON) and Llama3Tokenizer (Llama 3's tokenizer.model), through `tiktoken`.

- TikTokenizer reads megatron-core's format: a JSON list of {rank, token_bytes (base64), token_str}, which
  is the "vocab" list of Mistral's Tekken files (a Tekken file itself, a JSON object with that list under
  "vocab", is read too). As megatron-core 0.19: the first --tiktoken-num-special-tokens ids (1000) are
  special tokens, <unk> <s> </s> <mask> <pad> <cls> <sep> then <SPECIAL_7>... (or --tokenizer-special-tokens,
  which must hold those seven), and every rank is shifted up by that number; the vocabulary is --vocab-size
  (131072), so ranks past vocab size - specials are cut; the split pattern is --tiktoken-pattern v1 or v2
  (v2, Tekken's). eod = </s> (2), bos = <s> (1), pad = <pad> (4). Text is encoded with every special
  token allowed: a literal "</s>" in text is id 2. Nothing is added around a document.
- Llama3Tokenizer reads Llama 3's original tokenizer.model (tiktoken's base64 text: a token and its rank
  per line, 128,000 ranks) with Llama 3's split pattern and its 256 special tokens after the ranks
  (<|begin_of_text|> 128000, <|end_of_text|> 128001, ..., llama-models' list). It encodes as the Hugging
  Face Llama 3 tokenizer that Megatron users load through HuggingFaceTokenizer: <|begin_of_text|> before
  every document (--tokenizer-hf-no-include-special-tokens: none), special-token strings in text are those
  tokens, eod = <|end_of_text|>, no pad; the vocabulary is 128,256. The ids after BOS are tiktoken's own.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Sequence
from typing import Optional

from tricorn.data.errors import DataError
from tricorn.data.tokenizer import TokenizerOptions, wrong_kind

MEGATRON_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
DEFAULT_TIKTOKEN_VOCAB = 131072
# megatron-core's two split patterns (tiktoken_tokenizer.py); v2 is Tekken's.
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_NAMED = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
)
LLAMA3_SPECIAL_TOKENS = _LLAMA3_NAMED + tuple(f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(_LLAMA3_NAMED)))


class _TiktokenEncoder:
    """A tiktoken Encoding with every special token allowed in text, plus an optional BOS before each document."""

    def _finish(self, encoding, prefix: list[int]) -> None:
        self._enc = encoding
        self._prefix = prefix
        self._encode = encoding.encode

    def encode(self, text: str) -> list[int]:
        ids = self._encode(text, allowed_special="all")
        return self._prefix + ids if self._prefix else ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # One text at a time: tiktoken's encode_batch runs a thread pool, and --workers is the CPU budget.
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids])


def _check_file(path: Optional[str], tokenizer_type: str, what: str) -> str:
    if not path:
        raise DataError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model ({what})")
    if os.path.isdir(path):
        raise DataError(f"--tokenizer-model {path} is a directory; {tokenizer_type} reads one file ({what})")
    if not os.path.isfile(path):
        raise DataError(f"--tokenizer-model {path} does not exist; pass {what}")
    return path


class TikTokenizer(_TiktokenEncoder):
    name = "TikTokenizer"

    def __init__(
        self,
        path: str,
        vocab_size: Optional[int] = None,
        pattern: Optional[str] = None,
        num_special_tokens: int = 1000,
        special_tokens: Optional[Sequence[str]] = None,
    ):
        import tiktoken

        what = "a TikTokenizer JSON vocabulary such as Tekken's"
        _check_file(path, "TikTokenizer", what)
        vocab_size = DEFAULT_TIKTOKEN_VOCAB if vocab_size is None else int(vocab_size)
        pattern = pattern or "v2"
        if pattern not in TIKTOKEN_PATTERNS:
            raise DataError(f"--tiktoken-pattern {pattern} is not one of v1, v2 (megatron-core's TikTokenizer patterns)")
        specials = list(special_tokens) if special_tokens else list(MEGATRON_SPECIAL_TOKENS)
        missing = [t for t in MEGATRON_SPECIAL_TOKENS if t not in specials]
        if missing or len(set(specials)) != len(specials):
            why = f"lacks {' '.join(missing)}" if missing else "repeats a token"
            raise DataError(
                f"--tokenizer-special-tokens {why}; TikTokenizer's list must hold {' '.join(MEGATRON_SPECIAL_TOKENS)} once each"
            )
        if not len(specials) <= num_special_tokens < vocab_size:
            raise DataError(
                f"TikTokenizer needs {len(specials)} special tokens <= --tiktoken-num-special-tokens ({num_special_tokens}) "
                f"< --vocab-size ({vocab_size}); change one of them"
            )
        entries = self._entries(path)
        inner = vocab_size - num_special_tokens
        if len(entries) < inner:
            raise DataError(
                f"--vocab-size {vocab_size} with {num_special_tokens} special tokens needs {inner} ranks but {path} holds "
                f"{len(entries)}; use --vocab-size {len(entries) + num_special_tokens} or less"
            )
        ranks: dict[bytes, int] = {}
        for i, entry in enumerate(entries[:inner]):
            token = self._token(entry, i, path)
            if token in ranks:
                raise DataError(
                    f"{path}: rank {i} repeats the bytes of rank {ranks[token] - num_special_tokens}; the vocabulary is damaged"
                )
            ranks[token] = i + num_special_tokens
        names = specials + [f"<SPECIAL_{i}>" for i in range(len(specials), num_special_tokens)]
        encoding = tiktoken.Encoding(
            name=os.path.basename(os.path.dirname(os.path.abspath(path))),
            pat_str=TIKTOKEN_PATTERNS[pattern],
            mergeable_ranks=ranks,
            special_tokens={t: i for i, t in enumerate(names)},
        )
        self.vocab_size = vocab_size
        self.eod, self.bos, self.pad = names.index("</s>"), names.index("<s>"), names.index("<pad>")
        self.source = path
        self._finish(encoding, [])

    @staticmethod
    def _entries(path: str) -> list:
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"--tokenizer-model {path} cannot be read ({e}); check the path and its permissions") from None
        except ValueError:
            raise DataError(
                f"--tokenizer-model {path} is not a TikTokenizer JSON vocabulary; {wrong_kind(path, 'a JSON list of ranks')}"
            ) from None
        if isinstance(data, dict) and isinstance(data.get("vocab"), list) and "config" in data:
            data = data["vocab"]  # Mistral's Tekken file: megatron-core's list is its "vocab"
        if not isinstance(data, list):
            raise DataError(
                f"--tokenizer-model {path} holds a JSON object, not TikTokenizer's list of ranks; {wrong_kind(path, 'a JSON list')}"
            )
        return data

    @staticmethod
    def _token(entry: object, i: int, path: str) -> bytes:
        if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"} or entry["rank"] != i:
            raise DataError(
                f"{path}: entry {i} is not {{rank: {i}, token_bytes, token_str}}; this is not a TikTokenizer vocabulary"
            )
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise DataError(f"{path}: entry {i} has token_bytes that are not base64; the vocabulary is damaged") from None
        if i < 256 and token != bytes([i]):
            raise DataError(f"{path}: rank {i} must be the single byte {i}, as every TikTokenizer vocabulary begins")
        return token

    @classmethod
    def from_options(cls, o: TokenizerOptions) -> TikTokenizer:
        return cls(o.tokenizer_model or "", o.vocab_size, o.tiktoken_pattern, o.tiktoken_num_special_tokens, o.special_tokens)


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """A tiktoken base64 file (`TOKEN RANK` per line) -> ranks; DataError naming the file and line otherwise."""
    ranks: dict[bytes, int] = {}
    try:
        with open(path, "rb") as fh:
            for line_no, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                parts = line.split()
                try:
                    token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
                    if len(parts) != 2:
                        raise ValueError
                except (binascii.Error, ValueError, IndexError):
                    raise DataError(
                        f"{path} line {line_no} is not `BASE64 RANK`; it is not a tiktoken file: {wrong_kind(path, 'Llama 3 tokenizer.model')}"
                    ) from None
                ranks[token] = rank
    except OSError as e:
        raise DataError(
            f"--tokenizer-model {path} cannot be read ({e.strerror or e}); check the path and its permissions"
        ) from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError(f"{path}: the ranks are not 0..{len(ranks) - 1} each once; the file is damaged")
    return ranks


class Llama3Tokenizer(_TiktokenEncoder):
    name = "Llama3Tokenizer"

    def __init__(self, path: str, add_bos: bool = True):
        import tiktoken

        _check_file(path, "Llama3Tokenizer", "Llama 3's original tokenizer.model")
        ranks = read_tiktoken_ranks(path)
        n = len(ranks)
        specials = {t: n + i for i, t in enumerate(LLAMA3_SPECIAL_TOKENS)}
        encoding = tiktoken.Encoding(name="llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
        self.vocab_size = n + len(LLAMA3_SPECIAL_TOKENS)
        self.bos, self.eod = specials["<|begin_of_text|>"], specials["<|end_of_text|>"]
        self.pad = -1  # like the Hugging Face Llama 3 tokenizer (Meta's <|finetune_right_pad_id|> is for fine-tuning)
        self.source = path
        self._finish(encoding, [self.bos] if add_bos else [])

    @classmethod
    def from_options(cls, o: TokenizerOptions) -> Llama3Tokenizer:
        return cls(o.tokenizer_model or "", o.hf_include_special_tokens)
