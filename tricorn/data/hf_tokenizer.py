"""GPT2BPETokenizer and HuggingFaceTokenizer: byte-level BPEs read with the `tokenizers` library, as Megatron reads them.

megatron-core (0.19) loads both through transformers' AutoTokenizer (`tokenizer(text).input_ids`), and
transformers rewrites the `tokenizers.Tokenizer` it loads before it encodes anything: it turns truncation
and padding off, adds every special token named in tokenizer_config.json / special_tokens_map.json that is
not an added token yet, may reset the pre-tokenizer's add_prefix_space, and for some classes rebuilds the
post-processor from add_bos_token / add_eos_token. Megatron's wrapper then adds sep (= eos) and cls (= bos)
and --tokenizer-special-tokens. tricorn makes the same calls on the same library in the same order
(transformers 4.57's, `_load_like_transformers` below) without importing transformers, so the ids, the
vocabulary (len(tokenizer): added tokens included) and eod/bos/pad are Megatron's. A literal special-token
string inside text is that special token, as in transformers. tests/test_tokenizers_megatron.py checks
this against .bin/.idx files Megatron itself wrote, and against transformers directly.

- GPT2BPETokenizer: --vocab-file vocab.json and --merge-file merges.txt, built as transformers builds
  GPT-2 from those two files (merges read as its slow tokenizer reads them: the first line is skipped).
  eod, bos and unk are <|endoftext|>; no pad; nothing added around a document.
- HuggingFaceTokenizer: --tokenizer-model DIR holding tokenizer.json (and usually tokenizer_config.json).
  eod is the eos token (sep when there is none); bos is added where the tokenizer's post-processor adds it
  (Llama 3, Mistral), unless --tokenizer-hf-no-include-special-tokens.

No code from a tokenizer directory ever runs: a directory whose tokenizer_config.json names code
(`auto_map`) is read as transformers reads it without --trust-remote-code when its tokenizer_class is one
of CLASSES, and refused otherwise.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from tricorn.data.errors import DataError
from tricorn.data.tokenizer import TokenizerOptions, wrong_kind

EOT = "<|endoftext|>"
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class ClassRules:
    """What a transformers tokenizer class does beyond loading tokenizer.json (transformers 4.57)."""

    defaults: dict = field(default_factory=dict)  # the special tokens its __init__ defaults to
    bos_eos_template: Optional[tuple[bool, bool]] = None  # rebuilds the post-processor; default (add_bos, add_eos)
    add_prefix_space: Optional[bool] = False  # what its __init__ hands PreTrainedTokenizerFast by default
    slow_files: tuple[str, ...] = ()  # files its slow (use_fast=False) class reads


_GPT2 = {"unk_token": EOT, "bos_token": EOT, "eos_token": EOT}
_LLAMA = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
# tokenizer_class (without "Fast") -> rules. Other classes are refused: their code may change the encoding.
CLASSES: dict[str, ClassRules] = {
    "PreTrainedTokenizer": ClassRules(),
    "GPT2Tokenizer": ClassRules(_GPT2, slow_files=("vocab.json", "merges.txt")),
    "Qwen2Tokenizer": ClassRules({**_GPT2, "bos_token": None, "pad_token": EOT}, slow_files=("vocab.json", "merges.txt")),
    "GPTNeoXTokenizer": ClassRules(_GPT2, bos_eos_template=(False, False)),
    "LlamaTokenizer": ClassRules(_LLAMA, bos_eos_template=(True, False), add_prefix_space=None, slow_files=("tokenizer.model",)),
    "GemmaTokenizer": ClassRules(
        {"unk_token": "<unk>", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
        bos_eos_template=(True, False),
        slow_files=("tokenizer.model",),
    ),
}
# config.json's model_type -> tokenizer class, where tokenizer_config.json names none (transformers' mapping).
MODEL_TYPE_CLASSES = {
    "gpt2": "GPT2Tokenizer",
    "llama": "LlamaTokenizer",
    "mistral": "LlamaTokenizer",
    "mixtral": "LlamaTokenizer",
    "qwen2": "Qwen2Tokenizer",
    "qwen2_moe": "Qwen2Tokenizer",
    "gemma": "GemmaTokenizer",
    "gpt_neox": "GPTNeoXTokenizer",
    "olmo": "GPTNeoXTokenizer",
}


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as e:
        raise DataError(f"{what} {path} cannot be read ({e.strerror or e}); check the path and its permissions") from None
    except ValueError as e:
        raise DataError(
            f"{what} {path} is not valid JSON ({str(e).splitlines()[0]}); {wrong_kind(path, 'a JSON file')}"
        ) from None


def _added_token(value: Any, special: Optional[bool] = None):
    """A tokenizer_config.json / special_tokens_map.json value (str, AddedToken dict, None) as transformers holds it."""
    from tokenizers import AddedToken

    if isinstance(value, dict):
        attrs = {k: v for k, v in value.items() if k != "__type"}
        if special is not None:
            attrs["special"] = special
        return AddedToken(**attrs)
    return value


class _Encoder:
    """The part both types share: a `tokenizers.Tokenizer` plus the special ids, encoded in batches."""

    name = "HuggingFaceTokenizer"

    def _finish(self, backend, tokens: dict[str, Any], add_special: bool, source: str) -> None:
        self._tok = backend
        self._add_special = add_special
        self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))

        def token_id(key: str) -> int:
            token = tokens.get(key)
            if token is None:
                return -1
            tid = backend.token_to_id(str(token))
            if tid is None:  # transformers' convert_tokens_to_ids: the unk id, else None
                unk = tokens.get("unk_token")
                tid = backend.token_to_id(str(unk)) if unk is not None else None
            return -1 if tid is None else int(tid)

        self.eod, self.bos, self.pad = token_id("eos_token"), token_id("bos_token"), token_id("pad_token")
        self.source = source
        # The library's batch encoder without offsets, where this tokenizers version has it.
        self._batch = getattr(backend, "encode_batch_fast", backend.encode_batch)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=self._add_special).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._batch(list(texts), add_special_tokens=self._add_special)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _megatron_wrapper_tokens(backend, tokens: dict[str, Any], extra: Sequence[str]) -> None:
    """megatron-core's HuggingFaceTokenizer.__init__: sep from eos (or eos from sep), cls from bos (or bos from cls),
    then --tokenizer-special-tokens, all through transformers' add_special_tokens (normalized=False, special)."""
    from tokenizers import AddedToken

    def text(key: str) -> Optional[str]:
        return None if tokens.get(key) is None else str(tokens[key])

    wanted: dict[str, Any] = {}
    if text("sep_token") is None and text("eos_token"):
        wanted["sep_token"] = text("eos_token")
    elif text("eos_token") is None and text("sep_token"):
        wanted["eos_token"] = text("sep_token")
    if text("bos_token") is None and text("cls_token"):
        wanted["bos_token"] = text("cls_token")
    elif text("cls_token") is None and text("bos_token"):
        wanted["cls_token"] = text("bos_token")
    added: list = []
    for key, value in wanted.items():
        token = AddedToken(value, rstrip=False, lstrip=False, normalized=False, special=True)
        tokens[key] = token
        if token not in added:
            added.append(token)
    added += [AddedToken(t, rstrip=False, lstrip=False, normalized=False, special=True) for t in extra]
    if added:
        backend.add_special_tokens(added)


def _special_tokens_extended(tokens: dict[str, Any]) -> list:
    """transformers' all_special_tokens_extended: the set special tokens in attribute order, unique by text."""
    out, seen = [], set()
    for key in (*SPECIAL_KEYS, "additional_special_tokens"):
        value = tokens.get(key)
        if value is None:
            continue
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if str(token) not in seen:
                seen.add(str(token))
                out.append(token)
    return out


def _load_like_transformers(backend, rules: ClassRules, config: dict, special_map: Optional[dict]) -> dict[str, Any]:
    """Replay what AutoTokenizer.from_pretrained does to the backend (transformers 4.57, fast tokenizers);
    returns the special tokens (attribute -> str or AddedToken) it ends with."""
    from tokenizers import AddedToken, pre_tokenizers, processors

    backend.no_truncation()  # tokenizer(text) with no truncation/padding arguments turns both off
    backend.no_padding()
    tokens: dict[str, Any] = dict(rules.defaults)
    for key in (*SPECIAL_KEYS, "additional_special_tokens"):
        if key in config:
            value = config[key]
            tokens[key] = [_added_token(v) for v in value] if isinstance(value, list) else _added_token(value)
    decoder = {int(i): _added_token(t) for i, t in (config.get("added_tokens_decoder") or {}).items()}
    if "added_tokens_decoder" not in config and special_map:  # the legacy special_tokens_map.json
        for key, value in special_map.items():
            if key == "additional_special_tokens" and isinstance(value, list):
                merged = list(tokens.get(key) or [])
                merged += [t for t in (_added_token(v, True) for v in value) if t not in merged]
                tokens[key] = merged
            elif key in SPECIAL_KEYS:
                tokens[key] = _added_token(value, True)
    by_text = {str(t): t for t in decoder.values()}
    for key in SPECIAL_KEYS:
        if by_text and tokens.get(key) is not None:
            tokens[key] = by_text.get(str(tokens[key]), tokens[key])
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
    # PreTrainedTokenizerFast.__init__: added tokens not in the backend yet, then special tokens by text.
    known = {hash(repr(t)) for t in backend.get_added_tokens_decoder().values()}
    to_add = [t for _, t in sorted(decoder.items()) if hash(repr(t)) not in known]
    encoder = [t.content for t in backend.get_added_tokens_decoder().values()] + [str(t) for t in to_add]
    to_add += [t for t in _special_tokens_extended(tokens) if t not in encoder and t not in to_add]
    special_texts = {str(t) for t in _special_tokens_extended(tokens)}
    ready = []
    for token in to_add:
        if isinstance(token, str):
            ready.append(AddedToken(token, special=token in special_texts))
        else:
            token.special = token.special or str(token) in special_texts
            ready.append(token)
    if ready:
        backend.add_tokens(ready)
    prefix_space = config.get("add_prefix_space", rules.add_prefix_space)
    if isinstance(prefix_space, bool) and backend.pre_tokenizer is not None:
        state = json.loads(backend.pre_tokenizer.__getstate__())
        if state.get("add_prefix_space", prefix_space) != prefix_space:
            kind = getattr(pre_tokenizers, state.pop("type"))
            state["add_prefix_space"] = prefix_space
            backend.pre_tokenizer = kind(**state)
    if rules.bos_eos_template is not None:  # LlamaTokenizerFast.update_post_processor and its copies
        add_bos = bool(config.get("add_bos_token", rules.bos_eos_template[0]))
        add_eos = bool(config.get("add_eos_token", rules.bos_eos_template[1]))
        bos, eos = (None if tokens.get(k) is None else str(tokens[k]) for k in ("bos_token", "eos_token"))
        if (add_bos and bos is None) or (add_eos and eos is None):
            raise DataError("tokenizer_config.json asks for add_bos_token/add_eos_token but names no bos/eos token")
        single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
        pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
        ids = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)
    return tokens


class HuggingFaceTokenizer(_Encoder):
    """A Hugging Face tokenizer directory (tokenizer.json), read as Megatron's HuggingFaceTokenizer reads it."""

    name = "HuggingFaceTokenizer"

    def __init__(self, directory: str, options: Optional[TokenizerOptions] = None):
        from tokenizers import Tokenizer

        o = options or TokenizerOptions("HuggingFaceTokenizer", directory)
        if not directory:
            raise DataError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR (a directory with tokenizer.json)")
        if os.path.isfile(directory):
            hint = wrong_kind(directory, "a directory")
            raise DataError(
                f"--tokenizer-model {directory} is a file; HuggingFaceTokenizer reads a directory with tokenizer.json ({hint})"
            )
        if not os.path.isdir(directory):
            raise DataError(
                f"--tokenizer-model {directory} is not a directory; tricorn downloads nothing: fetch the tokenizer first "
                f"(e.g. `huggingface-cli download NAME --local-dir DIR`) and pass that directory"
            )
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            model = os.path.join(directory, "tokenizer.model")
            kind = wrong_kind(model, "") if os.path.isfile(model) else ""
            hint = f"; its tokenizer.model is {kind.removeprefix('it looks like ')}" if kind else ""
            raise DataError(f"{directory} has no tokenizer.json, which HuggingFaceTokenizer reads{hint}")
        config = self._config(directory, o)
        rules = CLASSES[self._class_name(directory, config)]
        if not o.hf_use_fast:
            slow = [f for f in rules.slow_files if os.path.isfile(os.path.join(directory, f))]
            if slow:
                raise DataError(
                    f"--tokenizer-hf-no-use-fast: {directory} holds {', '.join(slow)}, from which transformers' slow "
                    f"tokenizer could encode differently than tokenizer.json; tricorn reads tokenizer.json only: drop the flag"
                )
        if rules.add_prefix_space is None and config.get("add_prefix_space") is not None:
            raise DataError(
                f"{directory}/tokenizer_config.json sets add_prefix_space, which makes transformers rebuild the tokenizer "
                f"from tokenizer.model; tricorn reads tokenizer.json only: remove the key"
            )
        try:
            backend = Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception subclass for unreadable files
            raise DataError(
                f"{path} cannot be read by the tokenizers library ({str(e).splitlines()[0]}); {wrong_kind(path, 'a tokenizer.json')}"
            ) from None
        special_map_path = os.path.join(directory, "special_tokens_map.json")
        special_map = _read_json(special_map_path, "special tokens") if os.path.isfile(special_map_path) else None
        tokens = _load_like_transformers(backend, rules, config, special_map)
        _megatron_wrapper_tokens(backend, tokens, o.special_tokens or ())
        self._finish(backend, tokens, o.hf_include_special_tokens, directory)

    @staticmethod
    def _config(directory: str, o: TokenizerOptions) -> dict:
        path = os.path.join(directory, "tokenizer_config.json")
        config = _read_json(path, "tokenizer config") if os.path.isfile(path) else {}
        if not isinstance(config, dict):
            raise DataError(f"{path} holds {type(config).__name__}, not a JSON object; restore the file")
        if os.path.isfile(os.path.join(directory, "added_tokens.json")) and "added_tokens_decoder" not in config:
            raise DataError(
                f"{directory} has a legacy added_tokens.json, which tricorn does not read; "
                f"re-save the tokenizer with a current transformers (save_pretrained writes tokenizer.json with them)"
            )
        if config.get("auto_map") and o.trust_remote_code:
            raise DataError(
                f"--trust-remote-code: {directory} names tokenizer code (auto_map in tokenizer_config.json) and tricorn "
                f"runs no code from a tokenizer directory; drop the flag to read it as transformers does without remote code"
            )
        return config

    @staticmethod
    def _class_name(directory: str, config: dict) -> str:
        name = config.get("tokenizer_class")
        if not name:
            model_config = os.path.join(directory, "config.json")
            model_type = _read_json(model_config, "model config").get("model_type") if os.path.isfile(model_config) else None
            name = MODEL_TYPE_CLASSES.get(str(model_type), "PreTrainedTokenizer")
        base = str(name).removesuffix("Fast")
        if base not in CLASSES:
            needs_code = " and names tokenizer code (auto_map)" if config.get("auto_map") else ""
            raise DataError(
                f"{directory}/tokenizer_config.json names tokenizer_class {name}{needs_code}; tricorn reads "
                f"{', '.join(c + 'Fast' for c in CLASSES)} exactly as transformers does, and runs no tokenizer code: "
                f"set tokenizer_class to PreTrainedTokenizerFast if its tokenizer.json is complete"
            )
        return base

    @classmethod
    def from_options(cls, o: TokenizerOptions) -> HuggingFaceTokenizer:
        if o.vocab_file or o.merge_file:
            raise DataError(
                "--vocab-file/--merge-file with HuggingFaceTokenizer: tricorn reads the directory's tokenizer.json; "
                "use --tokenizer-type GPT2BPETokenizer for a vocab.json + merges.txt pair"
            )
        return cls(o.tokenizer_model or "", o)


class GPT2BPETokenizer(_Encoder):
    """GPT-2's vocab.json + merges.txt, built as transformers builds GPT2TokenizerFast from them."""

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str, special_tokens: Sequence[str] = ()):
        from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
        from tokenizers.models import BPE

        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path:
                raise DataError(
                    f"GPT2BPETokenizer needs {flag} (GPT-2's {'vocab.json' if flag == '--vocab-file' else 'merges.txt'}); tricorn downloads nothing"
                )
            if not os.path.isfile(path):
                raise DataError(
                    f"{flag} {path} does not exist; pass GPT-2's {'vocab.json' if flag == '--vocab-file' else 'merges.txt'}"
                )
        vocab = _read_json(vocab_file, "--vocab-file")
        if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
            raise DataError(
                f"--vocab-file {vocab_file} is not a token -> id JSON object like GPT-2's vocab.json; {wrong_kind(vocab_file, 'vocab.json')}"
            )
        try:
            with open(merge_file, encoding="utf-8") as fh:
                lines = fh.read().split("\n")[1:-1]  # GPT2Tokenizer's reading: a #version line first, a newline last
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"--merge-file {merge_file} cannot be read as text ({e}); pass GPT-2's merges.txt") from None
        merges = [tuple(line.split()) for line in lines]
        bad = next((i for i, m in enumerate(merges) if len(m) != 2 or m[0] + m[1] not in vocab), None)
        if bad is not None:
            raise DataError(
                f"--merge-file {merge_file} line {bad + 2} ({lines[bad][:40]!r}) is not a merge of two tokens of --vocab-file "
                f"{vocab_file}; {wrong_kind(merge_file, 'merges.txt')}"
            )
        backend = Tokenizer(
            BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
        )
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
        tokens: dict[str, Any] = dict(_GPT2)
        backend.add_tokens([AddedToken(EOT, special=True)])  # GPT2TokenizerFast: its special tokens as added tokens
        _megatron_wrapper_tokens(backend, tokens, special_tokens)
        self._finish(backend, tokens, True, vocab_file)

    @classmethod
    def from_options(cls, o: TokenizerOptions) -> GPT2BPETokenizer:
        if o.tokenizer_model:
            raise DataError(
                f"GPT2BPETokenizer reads --vocab-file and --merge-file, not --tokenizer-model {o.tokenizer_model}; "
                f"use HuggingFaceTokenizer for a directory with tokenizer.json"
            )
        return cls(o.vocab_file or "", o.merge_file or "", o.special_tokens or ())
