"""`tricorn preprocess`: jsonl(.gz) -> Megatron `<prefix>_<key>_document.bin/.idx`.

    tricorn preprocess --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod --workers 4

Each input line is one JSON object; every --json-keys field is tokenized into
its own output, one document per line, in input order whatever --workers is.
Bad lines (malformed JSON, not an object, missing key, non-string value,
untokenizable text) are counted and skipped; --strict makes the first one
fatal. Blank (empty or whitespace-only) documents are kept as Megatron's
tools/preprocess_data.py keeps them: their tokens, if the tokenizer gives any,
else a document with no sequence (and no eod); --drop-blank-documents skips
and counts them instead. A line goes to every key's output or to none, so the
outputs stay aligned.

Workers (--workers N > 1) are spawned processes that tokenize chunks of lines;
the main process reads, writes, and keeps at most 2N chunks in flight, so
memory stays bounded on any input size. Output is written to temporary names
and renamed at the end: an interrupted run leaves no .bin/.idx pair.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import dataclasses
import gzip
import json
import multiprocessing as mp
import os
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from tricorn.config import DataConfig
from tricorn.data.errors import DataError
from tricorn.data.indexed import IndexedDatasetBuilder, best_token_dtype, data_file_path, index_file_path
from tricorn.data.tokenizer import TOKENIZER_TYPES, Tokenizer, TokenizerOptions, build_tokenizer_with, check_vocab_size
from tricorn.flag_parser import add_field_flag

CHUNK_LINES = 256
CHUNK_BYTES = 1 << 18  # 256 KB: a few MB of input already keeps --workers busy
FIRST_REPORTED = 5
EMPTY = "empty document"


@dataclass
class Chunk:
    file_index: int
    first_line: int
    lines: list[bytes]


@dataclass
class ChunkResult:
    file_index: int
    tokens: dict[str, bytes]  # per key: the documents' tokens, concatenated, in the output dtype
    lengths: dict[str, bytes]  # per key: int64 document lengths
    documents: int
    issues: list[tuple[int, str, str]]  # (line number, kind, detail) of skipped lines, in order


@dataclass
class Report:
    documents: int = 0
    tokens: int = 0
    lines: int = 0
    bad: Counter = field(default_factory=Counter)  # kind -> lines
    bad_first: list[str] = field(default_factory=list)  # "file:line (kind)"
    empty: int = 0
    empty_first: list[str] = field(default_factory=list)
    first_problem: str = ""  # "file:line: kind (detail)" of the first skipped line, for the no-documents error
    outputs: list[str] = field(default_factory=list)  # output prefixes
    seconds: float = 0.0

    @property
    def bad_lines(self) -> int:
        return sum(self.bad.values())

    def summary(self) -> list[str]:
        rate = f"{self.documents / max(self.seconds, 1e-9):,.0f} docs/s, {self.tokens / max(self.seconds, 1e-9):,.0f} tokens/s"
        out = [
            f"wrote {self.documents} documents, {self.tokens} tokens per key to {', '.join(p + '.bin/.idx' for p in self.outputs)} "
            f"in {self.seconds:.1f}s ({rate})"
        ]
        if self.bad:
            kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(self.bad.items()))
            out.append(f"skipped {self.bad_lines} bad lines ({kinds}); first: {', '.join(self.bad_first)}")
        if self.empty:
            out.append(f"skipped {self.empty} empty documents; first: {', '.join(self.empty_first)}")
        return out

    def why_nothing(self) -> str:
        """Why no document was usable: what every line was skipped for, and the first example."""
        kinds = [f"{n} {kind}" for kind, n in sorted(self.bad.items())] + ([f"{self.empty} {EMPTY}"] if self.empty else [])
        blank = f"{self.documents} blank documents (no tokens)" if self.documents else ""
        if not kinds:
            return f"the input holds only {blank}" if blank else "the input holds no lines"
        skipped = "every line was skipped or blank" if blank else "every line was skipped"
        return f"{skipped} ({', '.join(kinds + ([blank] if blank else []))}; first: {self.first_problem})"


# ---------------------------------------------------------------- tokenizing (runs in workers)

_tokenizer: Optional[Tokenizer] = None
_settings: dict = {}


def _init_worker(
    options: TokenizerOptions, keys: list[str], append_eod: bool, drop_blank: bool = False, threads: Optional[int] = None
) -> None:
    global _tokenizer, _settings
    if threads == 1:  # a spawned worker is one CPU of --workers: no thread pool inside the tokenizer library
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _tokenizer = build_tokenizer_with(options)  # the parent has checked it (--append-eod with no eod refused there)
    typecode = "H" if best_token_dtype(_tokenizer.vocab_size) == np.uint16 else "i"
    _settings = dict(keys=keys, append_eod=append_eod, typecode=typecode, drop_blank=drop_blank)


def _document_texts(raw: bytes, keys: list[str]) -> tuple[Optional[list[str]], str, str]:
    """The texts of one line, or None with the kind of problem and its detail."""
    try:
        doc = json.loads(raw)
    except ValueError as e:  # also invalid UTF-8
        return None, "malformed JSON", str(e).splitlines()[0]
    if not isinstance(doc, dict):
        return None, "not a JSON object", f"got {type(doc).__name__}"
    texts = []
    for key in keys:
        if key not in doc:
            return None, f"missing key '{key}'", f"keys are {sorted(doc)[:8]}"
        if not isinstance(doc[key], str):
            return None, "not a string", f"'{key}' is {type(doc[key]).__name__}"
        texts.append(doc[key])
    return texts, "", ""


def _encode_texts(texts: list[str]) -> list:
    """Each text's ids, in one batch call where the tokenizer has a batch encoder; a text that fails gives its error."""
    assert _tokenizer is not None, "_init_worker was not called"
    try:
        return list(_tokenizer.encode_batch(texts))
    except Exception:  # noqa: BLE001 - each library raises its own errors (tokenizers: a bare Exception)
        pass
    out: list = []
    for text in texts:  # find the failing texts one by one
        try:
            out.append(_tokenizer.encode(text))
        except Exception as e:  # noqa: BLE001
            out.append(e)
    return out


def encode_chunk(chunk: Chunk) -> ChunkResult:
    assert _tokenizer is not None, "_init_worker was not called"
    keys, append_eod, typecode = _settings["keys"], _settings["append_eod"], _settings["typecode"]
    eod = _tokenizer.eod
    tokens = {k: array.array(typecode) for k in keys}
    lengths = {k: array.array("q") for k in keys}
    issues: list[tuple[int, str, str]] = []
    parsed: list[tuple[int, list[str]]] = []
    for line_no, raw in enumerate(chunk.lines, chunk.first_line):
        if not raw.strip():
            continue  # blank lines (a trailing newline) are not documents
        texts, kind, detail = _document_texts(raw, keys)
        if texts is None:
            issues.append((line_no, kind, detail))
        elif _settings["drop_blank"] and any(not t.strip() for t in texts):
            issues.append((line_no, EMPTY, ""))
        else:
            parsed.append((line_no, texts))
    encoded = [_encode_texts([texts[k] for _, texts in parsed]) for k in range(len(keys))]
    documents = 0
    for j, (line_no, _) in enumerate(parsed):
        failed = next((per_key[j] for per_key in encoded if isinstance(per_key[j], Exception)), None)
        if failed is not None:
            issues.append((line_no, "cannot tokenize", str(failed).splitlines()[0] if str(failed) else type(failed).__name__))
            continue
        for key, per_key in zip(keys, encoded):
            ids = per_key[j]
            tokens[key].extend(ids)
            if append_eod and ids:  # Megatron ends only a non-empty document with eod
                tokens[key].append(eod)
            lengths[key].append(len(ids) + (1 if append_eod and ids else 0))
        documents += 1
    issues.sort(key=lambda issue: issue[0])
    return ChunkResult(
        chunk.file_index,
        {k: v.tobytes() for k, v in tokens.items()},
        {k: v.tobytes() for k, v in lengths.items()},
        documents,
        issues,
    )


# ---------------------------------------------------------------- reading and writing (main process)


def read_chunks(paths: Sequence[str]) -> Iterator[Chunk]:
    for file_index, path in enumerate(paths):
        opener = gzip.open if path.endswith(".gz") else open
        lines: list[bytes] = []
        size, first = 0, 1
        try:
            with opener(path, "rb") as fh:
                for line_no, raw in enumerate(fh, 1):
                    if not lines:
                        first = line_no
                    lines.append(raw)
                    size += len(raw)
                    if len(lines) >= CHUNK_LINES or size >= CHUNK_BYTES:
                        yield Chunk(file_index, first, lines)
                        lines, size = [], 0
        except (EOFError, gzip.BadGzipFile, OSError) as e:
            raise DataError(f"{path}: cannot be read to the end ({e}); the file is truncated or not gzip") from None
        if lines:
            yield Chunk(file_index, first, lines)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """--workers 1 is one CPU: the tokenizers library's batch encoder runs without its thread pool meanwhile."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def _ordered_results(chunks: Iterator[Chunk], workers: int, init_args: tuple) -> Iterator[ChunkResult]:
    if workers <= 1:
        with _one_thread():
            _init_worker(*init_args)
            yield from map(encode_chunk, chunks)
        return
    # spawn: no fork of a process holding open output files; workers import numpy and their tokenizer library only.
    with mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=init_args + (1,)) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(encode_chunk, (chunk,)))
            if len(pending) >= 2 * workers:  # backpressure: never read far ahead of the writers
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


def preprocess(
    inputs: Sequence[str],
    output_prefix: str,
    tokenizer_type: str,
    tokenizer_model: Optional[str] = None,
    vocab_size: Optional[int] = None,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    strict: bool = False,
    log_interval: int = 10000,
    progress=sys.stderr,
    legacy_tokenizer: bool = False,
    drop_blank_documents: bool = False,
    **tokenizer_flags,
) -> Report:
    """Tokenize `inputs` into one .bin/.idx pair per key; raises DataError on unusable input (or any bad line with strict).

    tokenizer_flags: the other TokenizerOptions fields (vocab_file, merge_file, special_tokens, ...).
    """
    for path in inputs:
        if not os.path.isfile(path):
            raise DataError(f"--input {path} does not exist")
    keys = list(json_keys)
    options = TokenizerOptions(tokenizer_type, tokenizer_model, vocab_size, legacy_tokenizer, **tokenizer_flags)
    tokenizer = build_tokenizer_with(options)  # fail here, not in a worker
    check_vocab_size(tokenizer, options)
    if append_eod and tokenizer.eod < 0:
        raise DataError(f"--append-eod: tokenizer {options.source()} has no end-of-document (eos) token; drop --append-eod")
    dtype = best_token_dtype(tokenizer.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    report = Report(outputs=[output_prefix_for(output_prefix, k) for k in keys])
    builders = {k: IndexedDatasetBuilder(data_file_path(p), dtype) for k, p in zip(keys, report.outputs)}
    start = time.time()
    next_log = log_interval
    try:
        init_args = (options, keys, append_eod, drop_blank_documents)
        for result in _ordered_results(read_chunks(inputs), workers, init_args):
            _record_issues(report, result, inputs[result.file_index], strict)
            for key in keys:
                write_documents(
                    builders[key], np.frombuffer(result.tokens[key], dtype), np.frombuffer(result.lengths[key], np.int64)
                )
            report.documents += result.documents
            report.tokens += len(result.tokens[keys[0]]) // np.dtype(dtype).itemsize
            if progress is not None and log_interval > 0 and report.documents >= next_log:
                elapsed = max(time.time() - start, 1e-9)
                print(
                    f"processed {report.documents} documents ({report.documents / elapsed:,.0f} docs/s, "
                    f"{report.tokens / elapsed:,.0f} tokens/s)",
                    file=progress,
                    flush=True,
                )
                next_log = (report.documents // log_interval + 1) * log_interval
        if report.tokens == 0:  # nothing, or only blank documents: surely not what was meant
            raise DataError(
                f"no usable documents in {' '.join(inputs)} (json keys: {' '.join(keys)}): {report.why_nothing()}; nothing written"
            )
        for key, prefix in zip(keys, report.outputs):
            builders[key].finalize(index_file_path(prefix))
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    report.seconds = time.time() - start
    return report


def write_documents(builder: IndexedDatasetBuilder, tokens: np.ndarray, lengths: np.ndarray) -> None:
    """One-sequence documents, except that a blank (length 0) is a document with no sequence, as Megatron writes it."""
    doc, tok = 0, 0
    for blank in np.flatnonzero(lengths == 0).tolist():
        count = int(lengths[doc:blank].sum())
        builder.add_documents(tokens[tok : tok + count], lengths[doc:blank])
        builder.end_document()
        doc, tok = blank + 1, tok + count
    builder.add_documents(tokens[tok:], lengths[doc:])


def _record_issues(report: Report, result: ChunkResult, path: str, strict: bool) -> None:
    for line_no, kind, detail in result.issues:
        where = f"{path}:{line_no}"
        report.first_problem = report.first_problem or f"{where}: {kind}{f' ({detail})' if detail else ''}"
        if kind == EMPTY:
            report.empty += 1
            if len(report.empty_first) < FIRST_REPORTED:
                report.empty_first.append(where)
            continue
        if strict:
            raise DataError(f"{where}: {kind}{f' ({detail})' if detail else ''}; fix the line or drop --strict to skip bad lines")
        report.bad[kind] += 1
        if len(report.bad_first) < FIRST_REPORTED:
            report.bad_first.append(f"{where} ({kind})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tricorn preprocess", description="Tokenize jsonl into Megatron .bin/.idx files.")
    p.add_argument("--input", nargs="+", required=True, help="one or more .jsonl or .jsonl.gz files")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenize; each gets its own output")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_<key>_document.bin/.idx")
    p.add_argument("--tokenizer-type", required=True, choices=list(TOKENIZER_TYPES))
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="NullTokenizer's and TikTokenizer's vocabulary; for the other types at least the tokenizer's (no effect on the data)",
    )
    data_fields = {f.name: f for f in dataclasses.fields(DataConfig)}
    for name in TOKENIZER_FIELDS:
        add_field_flag(p, data_fields[name], default=data_fields[name].default)
    p.add_argument("--append-eod", action="store_true", help="end every document with the tokenizer's eod id")
    p.add_argument(
        "--legacy-tokenizer",
        action="store_true",
        help="legacy Megatron tokenizers: NullTokenizer eod is id V (vocab V+1); Llama2Tokenizer starts documents with BOS",
    )
    p.add_argument("--drop-blank-documents", action="store_true", help="skip (and count) empty or whitespace-only documents")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes (1: in this process)")
    p.add_argument("--strict", action="store_true", help="stop at the first bad line instead of skipping it")
    p.add_argument("--log-interval", type=int, default=10000, help="print progress every N documents (0: never)")
    p.add_argument("--dataset-impl", choices=["mmap"], default="mmap", help="accepted for Megatron scripts; always mmap")
    return p


# DataConfig's tokenizer fields, which `tricorn preprocess` takes with the same flags as pretrain_gpt.py.
TOKENIZER_FIELDS = (
    "tokenizer_model",
    "vocab_file",
    "merge_file",
    "tokenizer_special_tokens",
    "tiktoken_pattern",
    "tiktoken_num_special_tokens",
    "tokenizer_hf_no_include_special_tokens",
    "tokenizer_hf_no_use_fast",
    "trust_remote_code",
    "null_tokenizer_eod_id",
    "null_tokenizer_pad_id",
)


def tokenizer_flags(args: argparse.Namespace) -> dict:
    """The TokenizerOptions fields beyond preprocess()'s own parameters, from the parsed flags."""
    return dict(
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        special_tokens=tuple(args.tokenizer_special_tokens) if args.tokenizer_special_tokens else None,
        tiktoken_pattern=args.tiktoken_pattern,
        tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
        hf_include_special_tokens=not args.tokenizer_hf_no_include_special_tokens,
        hf_use_fast=not args.tokenizer_hf_no_use_fast,
        trust_remote_code=args.trust_remote_code,
        null_eod_id=args.null_tokenizer_eod_id,
        null_pad_id=args.null_tokenizer_pad_id,
    )


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1:
        print(f"tricorn preprocess: error: --workers must be at least 1, got {args.workers}", file=sys.stderr)
        return 2
    try:
        report = preprocess(
            args.input,
            args.output_prefix,
            args.tokenizer_type,
            args.tokenizer_model,
            args.vocab_size,
            args.json_keys,
            args.append_eod,
            args.workers,
            args.strict,
            args.log_interval,
            legacy_tokenizer=args.legacy_tokenizer,
            drop_blank_documents=args.drop_blank_documents,
            **tokenizer_flags(args),
        )
    except DataError as e:
        print(f"tricorn preprocess: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tricorn preprocess: interrupted; no output written", file=sys.stderr)
        return 130
    for line in report.summary():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
