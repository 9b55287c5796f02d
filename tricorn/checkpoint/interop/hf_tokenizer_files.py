"""The tokenizer of a Hugging Face model: kept with an imported checkpoint, used by its run, written back on export.

`tricorn import-hf` copies the source directory's tokenizer files into SAVE/tokenizer/ and records in the
checkpoint's config.yaml the --tokenizer-type and --tokenizer-model that read them: HuggingFaceTokenizer
on the directory when it holds tokenizer.json (as Megatron reads a Hugging Face model), else
Llama3Tokenizer or Llama2Tokenizer on its tokenizer.model (tiktoken or SentencePiece). The command it
prints carries both flags. `tricorn export-hf` writes back, in this order: the files of --tokenizer DIR, else
SAVE/tokenizer/, else the files that the checkpoint's config.yaml names. No process group, no collectives.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from tricorn.checkpoint.interop.hf_mapping import ConvertError

TOKENIZER_DIR = "tokenizer"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
)


def tokenizer_type_of(directory: Path) -> Optional[tuple[str, str]]:
    """(--tokenizer-type, --tokenizer-model) that read the tokenizer in `directory`, or None when it holds none."""
    from tricorn.data.tokenizer import tokenizer_file_kind

    if (directory / "tokenizer.json").is_file():
        return "HuggingFaceTokenizer", str(directory)
    model = directory / "tokenizer.model"
    if model.is_file():
        kind = tokenizer_file_kind(str(model))
        if "Llama3Tokenizer" in kind:
            return "Llama3Tokenizer", str(model)
        if "SentencePiece" in kind:
            return "Llama2Tokenizer", str(model)
    return None


def keep_tokenizer(hf_dir: Path, save: Path, vocab_size: int, console: Callable[[str], None]) -> Optional[tuple[str, str]]:
    """Copy HF_DIR's tokenizer files into SAVE/tokenizer/ (atomically); returns the flags that read them, or None.

    The tokenizer is built once here, so that a directory tricorn cannot read, or one whose vocabulary is larger
    than the model's, is said at import time rather than at the first training run.
    """
    files = [hf_dir / n for n in TOKENIZER_FILES if (hf_dir / n).is_file()]
    if not files:
        console(
            f"{hf_dir} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}); pass --tokenizer-type/--tokenizer-model yourself"
        )
        return None
    found = tokenizer_type_of(hf_dir)
    if found is not None:
        from tricorn.data.errors import DataError
        from tricorn.data.tokenizer import TokenizerOptions, build_tokenizer_with

        try:
            tokenizer = build_tokenizer_with(TokenizerOptions(found[0], found[1]))
        except DataError as e:
            console(f"keeping {hf_dir}'s tokenizer files, but tricorn cannot read them: {e}")
            found = None
        else:
            if tokenizer.vocab_size > vocab_size:
                raise ConvertError(
                    f"{hf_dir}: the tokenizer has {tokenizer.vocab_size} tokens but config.json's vocab_size is {vocab_size}; "
                    f"the embedding has no row for the rest: check that the tokenizer belongs to this model"
                )
    dest = save / TOKENIZER_DIR
    tmp = save / f".{TOKENIZER_DIR}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in files:
        shutil.copyfile(f, tmp / f.name)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    if found is None:
        return None
    return found[0], str(dest / Path(found[1]).relative_to(hf_dir)) if Path(found[1]) != hf_dir else str(dest)


def tokenizer_flags(found: Optional[tuple[str, str]]) -> list[str]:
    """The tokenizer flags of the printed command (the path under SAVE as the user wrote SAVE)."""
    return ["--tokenizer-type", found[0], "--tokenizer-model", found[1]] if found else []


def export_tokenizer_files(load: Path, ckpt: Path, tokenizer: Optional[Path]) -> list[Path]:
    """The tokenizer files export-hf writes: --tokenizer DIR (or one file), else SAVE/tokenizer/, else those of
    the tokenizer the checkpoint's config.yaml names; [] when there are none."""
    if tokenizer is not None:
        if tokenizer.is_file():
            return [tokenizer]
        found = [tokenizer / n for n in TOKENIZER_FILES if (tokenizer / n).is_file()]
        if not found:
            raise ConvertError(f"--tokenizer {tokenizer} holds none of {', '.join(TOKENIZER_FILES)}")
        return found
    for kept in (load / TOKENIZER_DIR, ckpt.parent / TOKENIZER_DIR):  # --load SAVE or --load SAVE/iter_N
        if kept.is_dir():
            return [kept / n for n in TOKENIZER_FILES if (kept / n).is_file()]
    named = _config_tokenizer(ckpt)
    if named is None:
        return []
    if named.is_dir():
        return [named / n for n in TOKENIZER_FILES if (named / n).is_file()]
    return [named] if named.name == "tokenizer.model" and named.is_file() else []


def _config_tokenizer(ckpt: Path) -> Optional[Path]:
    import yaml

    from tricorn.checkpoint.io import CONFIG_FILE

    try:
        data = (yaml.safe_load((ckpt / CONFIG_FILE).read_text()) or {}).get("data") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    if data.get("tokenizer_type") in ("HuggingFaceTokenizer", "Llama3Tokenizer", "Llama2Tokenizer") and data.get(
        "tokenizer_model"
    ):
        return Path(data["tokenizer_model"])
    return None
