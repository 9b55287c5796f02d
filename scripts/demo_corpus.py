"""Build a real-text jsonl corpus from the running interpreter's standard library, no download.

Each line is {"text": <source of one .py file>}. Files are picked from
`sysconfig.get_paths()['stdlib']` (site-packages and caches excluded) in a
seeded, deterministic order until the size cap is reached, so the same
interpreter always yields the same corpus. The file is written atomically.

    python scripts/demo_corpus.py --output demo_out/corpus.jsonl [--max-bytes 4000000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

DEFAULT_MAX_BYTES = 4_000_000
# Huge generated files (pydoc topics, unicode tables) would crowd out ordinary code.
MAX_FILE_BYTES = 64_000
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class CorpusInfo:
    path: str
    documents: int
    bytes: int
    stdlib: str


def stdlib_sources(stdlib_dir: Optional[str] = None) -> list[Path]:
    """The stdlib's .py files in sorted order (relative path), without third-party packages."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        found += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def corpus_lines(stdlib_dir: Optional[str] = None, max_bytes: int = DEFAULT_MAX_BYTES, seed: int = 0) -> list[str]:
    """jsonl lines of a seeded sample of stdlib sources whose total size stays under max_bytes."""
    files = stdlib_sources(stdlib_dir)
    # A seeded shuffle mixes packages; alphabetical order would fill the cap with a..e only.
    random.Random(seed).shuffle(files)
    lines, total = [], 0
    for path in files:
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # a few test fixtures are deliberately not UTF-8
        if not text.strip():
            continue
        line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
        size = len(line.encode("utf-8"))
        if total + size > max_bytes:
            continue  # a smaller file further on may still fit
        lines.append(line)
        total += size
    return lines


def build_corpus(output: str, max_bytes: int = DEFAULT_MAX_BYTES, seed: int = 0, stdlib_dir: Optional[str] = None) -> CorpusInfo:
    """Write the corpus to `output` (temp file, then rename) and describe it."""
    lines = corpus_lines(stdlib_dir, max_bytes, seed)
    if not lines:
        raise SystemExit(f"demo_corpus: no readable .py files under {stdlib_dir or sysconfig.get_paths()['stdlib']}")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = f"{output}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.writelines(lines)
    os.replace(tmp, output)
    size = sum(len(line.encode("utf-8")) for line in lines)
    return CorpusInfo(output, len(lines), size, stdlib_dir or sysconfig.get_paths()["stdlib"])


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="jsonl file to write")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="size cap of the corpus")
    parser.add_argument("--seed", type=int, default=0, help="seed of the file order")
    args = parser.parse_args(argv)
    info = build_corpus(args.output, args.max_bytes, args.seed)
    print(f"wrote {info.documents} documents ({info.bytes / 1e6:.1f} MB) from {info.stdlib} to {info.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
