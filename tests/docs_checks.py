"""Helpers of tests/test_docs.py: read the pages' fenced blocks, links and headings; parse a shell command with
the parser that would read it; run a page's `run` blocks in a scratch directory. docs/testing.md describes the
conventions they implement."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
SHELL_LANGS = ("bash", "sh", "shell", "console")
MARKS = ("run", "parse")
RUN_TIMEOUT_S = 240  # per page; the blocks themselves take seconds


def doc_pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md"] + sorted((root / "docs").glob("*.md"))


# ---------------------------------------------------------------------------------------------------------
# Markdown: fenced blocks, links, headings


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    mark: str  # "", "run", "parse", or whatever else followed the language (an error)
    body: str

    def where(self) -> str:
        return f"{self.page.name}:{self.line}"


_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")


def fenced_blocks(page: Path, text: Optional[str] = None) -> list[Block]:
    text = page.read_text() if text is None else text
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group(2), m.group(3).strip().split()
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1
        lang = info[0] if info else ""
        blocks.append(Block(page, start, lang, " ".join(info[1:]), "\n".join(body)))
    return blocks


def prose(text: str) -> str:
    """The text outside fenced blocks (links and headings live there)."""
    out, fence = [], None
    for line in text.split("\n"):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(2)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            out.append(line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    s = re.sub(r"[^\w\- ]", "", s.replace("`", ""))
    return s.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(text).split("\n"):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


_LINK = re.compile(r"(?<!\!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_REPO_PATH = re.compile(r"^(?:tricorn|tests|bench|scripts|docs)/[\w./-]*$")


def broken_links(pages: list[Path], pending: set[str], root: Path = ROOT) -> list[str]:
    """Every relative link, link anchor and backticked repository path on these pages that does not resolve."""
    problems = []
    texts = {p.resolve(): p.read_text() for p in pages}

    def exists(path: Path) -> bool:
        if path.exists():
            return True
        try:
            return path.resolve().relative_to(root.resolve()).as_posix() in pending
        except ValueError:
            return False

    for page, text in texts.items():
        body = prose(text)
        for line in body.split("\n"):
            no_code = _CODE_SPAN.sub("", line)
            for target in _LINK.findall(no_code):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                path_part, _, anchor = target.partition("#")
                dest = (page.parent / path_part) if path_part else page
                if not exists(dest):
                    problems.append(f"{page.name}: link to {target}: {path_part} does not exist")
                    continue
                if anchor and dest.suffix == ".md":
                    dest_text = texts.get(dest.resolve())
                    if dest_text is None and dest.exists():
                        dest_text = dest.read_text()
                    if dest_text is not None and anchor not in anchors(dest_text):
                        problems.append(f"{page.name}: link to {target}: no heading #{anchor} in {dest.name}")
            for _, span in _CODE_SPAN.findall(line):
                span = span.strip().split("::")[0]
                if _REPO_PATH.match(span) and not exists(root / span):
                    problems.append(f"{page.name}: `{span}` does not exist")
    return problems


def unlinked_pages(readme: Path, pages: list[Path]) -> list[str]:
    """Pages the front page does not link to (a page nobody can find is a page that rots)."""
    targets = {
        (readme.parent / target.partition("#")[0]).resolve()
        for target in _LINK.findall(_CODE_SPAN.sub("", prose(readme.read_text())))
    }
    return [p.name for p in pages if p.resolve() not in targets]


# ---------------------------------------------------------------------------------------------------------
# Flags


def help_flags(parser: argparse.ArgumentParser) -> list[str]:
    """The long flags `--help` lists (suppressed aliases left out)."""
    return sorted(
        {
            opt
            for action in parser._actions
            if action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)
            for opt in action.option_strings
            if opt.startswith("--")
        }
    )


def parsers_of(main, argv: list[str]) -> list[argparse.ArgumentParser]:
    """The argument parsers a main(argv) builds, caught as it asks them to parse (nothing runs after that)."""
    seen: list[argparse.ArgumentParser] = []
    known, parse = argparse.ArgumentParser.parse_known_args, argparse.ArgumentParser.parse_args

    def record_known(self, args=None, namespace=None):
        seen.append(self)
        return known(self, args, namespace)

    def record_and_stop(self, args=None, namespace=None):
        seen.append(self)
        raise _Parsed(None)

    argparse.ArgumentParser.parse_known_args = record_known  # type: ignore[method-assign]
    argparse.ArgumentParser.parse_args = record_and_stop  # type: ignore[method-assign]
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(_Parsed, SystemExit):
            main(argv)
    finally:
        argparse.ArgumentParser.parse_known_args = known  # type: ignore[method-assign]
        argparse.ArgumentParser.parse_args = parse  # type: ignore[method-assign]
    out, stack = [], list(seen)
    while stack:  # subcommands (tricorn tokenizer train) are parsers of their own
        parser = stack.pop()
        out.append(parser)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack += list(action.choices.values())
    return out


def missing_flags(flags: list[str], texts: list[str]) -> list[str]:
    joined = "\n".join(texts)
    return [f for f in flags if not re.search(r"(?<![\w-])" + re.escape(f) + r"(?![\w-])", joined)]


# ---------------------------------------------------------------------------------------------------------
# Shell: the commands of a block, and parsing them with the real parsers


def shell_commands(body: str, variables: Optional[dict[str, str]] = None) -> list[tuple[dict[str, str], list[str]]]:
    """(environment prefix, argv) of each command: continuations joined, comments dropped, and
    NAME=value lines expanded where $NAME or ${NAME} appears later (word-split like an unquoted expansion).
    `variables` holds the assignments of the page's earlier blocks, and gains this block's."""
    variables = {} if variables is None else variables
    commands = []
    logical, current = [], ""
    for line in body.split("\n"):
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    if current:
        logical.append(current)
    for line in logical:
        for name, value in variables.items():
            line = re.sub(r"\$\{" + name + r"\}|\$" + name + r"(?!\w)", lambda _m, v=value: v, line)
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if any(w in ("|", "||", "&&", ";", ">", "<") for w in words):
            raise AssertionError(f"pipes, lists and redirections are not parsed: {line.strip()}")
        env: dict[str, str] = {}
        while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        if not words:
            variables.update(env)
            continue
        commands.append((env, words))
    return commands


class _Parsed(BaseException):
    """Raised once a command's argument parser has accepted its arguments: nothing runs after it."""


@contextlib.contextmanager
def _stop_after_parse() -> Iterator[None]:
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    argparse.ArgumentParser.parse_args = parse_then_stop  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]


def _parse_with_main(where: str, call) -> None:
    """Run a main(argv) until its argument parser accepts (pass) or refuses (fail) its arguments."""
    with _stop_after_parse():
        try:
            result = call()
        except _Parsed:
            return
        except SystemExit as e:
            raise AssertionError(f"{where}: the argument parser refused it (exit {e.code})") from None
    raise AssertionError(f"{where}: returned {result!r} before its arguments were parsed")


def check_pretrain_args(args: list[str], world_size: int, where: str = "") -> None:
    """pretrain_gpt.py's own parse and pre-launch validation, at the launcher's world size."""
    from tricorn.config import ConfigError
    from tricorn.config_args import config_from_args
    from tricorn.parallel.te import ON_THIS_NODE
    from tricorn.validation import validate

    try:
        cfg = config_from_args(args, world_size=world_size)
    except ConfigError as e:
        raise AssertionError(f"{where}: {e}") from None
    # What this node has installed (Transformer Engine, the GPU type) is not the command's: it runs on a GPU node.
    errors = [e for e in validate(cfg) if ON_THIS_NODE not in e]
    if errors:
        raise AssertionError(f"{where}: " + "; ".join(errors))


def _torchrun(args: list[str], where: str) -> tuple[list[str], int]:
    from torch.distributed.run import get_args_parser

    try:
        ns = get_args_parser().parse_args(args)
    except SystemExit as e:
        raise AssertionError(f"{where}: torchrun's parser refused it (exit {e.code})") from None
    nnodes = int(str(ns.nnodes).split(":")[-1])
    return [ns.training_script] + list(ns.training_script_args), int(ns.nproc_per_node) * nnodes


_SRUN_VALUE_OPTS = {"-N", "--nodes", "-n", "--ntasks", "--ntasks-per-node", "--gpus-per-node", "-p", "--partition"}
_SRUN_VALUE_OPTS |= {"-A", "--account", "-t", "--time", "-c", "--cpus-per-task", "--export", "--gres", "-J"}


def _srun(args: list[str], where: str) -> tuple[list[str], int]:
    opts: dict[str, str] = {}
    i = 0
    while i < len(args) and args[i].startswith("-"):
        key, eq, value = args[i].partition("=")
        if not eq and key in _SRUN_VALUE_OPTS:
            i += 1
            value = args[i]
        opts[key] = value
        i += 1
    nodes = int(opts.get("--nodes", opts.get("-N", "1")))
    tasks = opts.get("--ntasks", opts.get("-n"))
    world = int(tasks) if tasks else nodes * int(opts.get("--ntasks-per-node", "1"))
    assert i < len(args), f"{where}: srun with no program"
    return args[i:], world


def _sbatch_args(script: Path, env: dict[str, str], where: str) -> tuple[list[str], int]:
    """The trainer's flags and world size of one of scripts/slurm/*.sbatch, data from the environment given."""
    text = script.read_text()
    sbatch = dict(re.findall(r"^#SBATCH\s+(--[\w-]+)=(\S+)", text, re.M))
    world = int(sbatch.get("--nodes", "1")) * int(sbatch.get("--ntasks-per-node", "1"))
    m = re.search(r"^ARGS=\((.*?)^\)", text, re.M | re.S)
    assert m, f"{where}: no ARGS=( ... ) array in {script}"
    args = [re.sub(r"\$\{?\w+\}?", "/tmp/run", w) for w in shlex.split(m.group(1), comments=True)]
    if "DATA_ARGS" in env:
        data = shlex.split(env["DATA_ARGS"])
    elif "DATA_PATH" in env and "TOKENIZER_MODEL" in env:
        data = ["--data-path", env["DATA_PATH"], "--tokenizer-type", "SentencePieceTokenizer"]
        data += ["--tokenizer-model", env["TOKENIZER_MODEL"]]
    else:
        raise AssertionError(f"{where}: the script needs DATA_PATH and TOKENIZER_MODEL, or DATA_ARGS")
    return args + data + shlex.split(env.get("EXTRA_ARGS", "")), world


def _script_path(word: str) -> Path:
    return ROOT / word.replace("$TRICORN_DIR/", "")


def check_command(env: dict[str, str], argv: list[str], where: str) -> None:
    """Parse one command of a `parse` block with the parser that would read it."""
    prog, args = os.path.basename(argv[0]), argv[1:]
    world = 1
    if prog == "torchrun":
        argv, world = _torchrun(args, where)
        prog, args = "", argv
    elif prog == "srun":
        argv, world = _srun(args, where)
        prog, args = os.path.basename(argv[0]), argv[1:]
    elif prog == "sbatch":
        script = ROOT / args[-1]
        assert script.is_file(), f"{where}: no such script {args[-1]}"
        flags, world = _sbatch_args(script, env, where)
        return check_pretrain_args(flags, world, where)
    if prog in ("python", "python3"):
        prog, args = "", args
    if prog == "" and args and args[0] == "-m":
        module, args = args[1], args[2:]
        if module == "tricorn.cli":
            prog = "tricorn"
        else:
            mod = __import__(module, fromlist=["main"])
            return _parse_with_main(where, lambda: mod.main(args))
    elif prog == "":
        script, args = args[0], args[1:]
        if os.path.basename(script) == "pretrain_gpt.py":
            return check_pretrain_args(args, world, where)
        path = _script_path(script)
        assert path.is_file(), f"{where}: no such script {script}"
        return _parse_with_main(where, lambda: _run_script(path, args))
    if prog == "tricorn":
        from tricorn.cli import SUBCOMMANDS

        sub, args = args[0], args[1:]
        assert sub in SUBCOMMANDS, f"{where}: unknown subcommand tricorn {sub}"
        if sub == "train":
            return check_pretrain_args(args, world, where)
        module_name, func = SUBCOMMANDS[sub][0].split(":")
        main = getattr(__import__(module_name, fromlist=[func]), func)
        return _parse_with_main(where, lambda: main(args))
    raise AssertionError(f"{where}: no parser known for `{' '.join(argv)}`; mark the block ```bash (an example)")


def _run_script(path: Path, args: list[str]) -> None:
    saved = sys.argv
    sys.argv = [str(path)] + args
    try:
        runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = saved


def page_variables(block: Block) -> dict[str, str]:
    """The shell variables the page's earlier run and parse blocks set: a page reads as one shell session."""
    variables: dict[str, str] = {}
    if block.page.is_file():
        for earlier in fenced_blocks(block.page):
            if earlier.line >= block.line:
                break
            if earlier.lang in SHELL_LANGS and earlier.mark in MARKS:
                shell_commands(earlier.body, variables)
    return variables


def check_parse_block(block: Block) -> None:
    commands = shell_commands(block.body, page_variables(block))
    assert commands, f"{block.where()}: a parse block with no command"
    for env, argv in commands:
        check_command(env, argv, f"{block.where()} `{' '.join(argv)[:80]}`")


# ---------------------------------------------------------------------------------------------------------
# Running `run` blocks


def _shims(bin_dir: Path) -> None:
    """python, tricorn and torchrun as the user has them, but on this checkout's code."""
    bin_dir.mkdir()
    shims = {
        "python": f'exec "{sys.executable}" "$@"',
        "python3": f'exec "{sys.executable}" "$@"',
        "tricorn": f'exec "{sys.executable}" -m tricorn.cli "$@"',
        "torchrun": f'exec "{sys.executable}" -m torch.distributed.run "$@"',
    }
    for name, line in shims.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{line}\n")
        (bin_dir / name).chmod(0o755)


def run_blocks(blocks: list[Block], workdir: Path, root: Path = ROOT) -> subprocess.CompletedProcess:
    """Run a page's `run` blocks in order, as one bash script, in `workdir` (a scratch copy of the checkout's
    entry points: pretrain_gpt.py, scripts/ and bench/ are linked, everything written lands in workdir)."""
    for name in ("pretrain_gpt.py", "scripts", "bench"):
        if (root / name).exists() and not (workdir / name).exists():
            (workdir / name).symlink_to(root / name)
    _shims(workdir / ".bin")
    script = ["set -euo pipefail"]
    for b in blocks:
        script += [f"echo '>>> {b.where()}'", b.body]
    env = dict(os.environ)
    env.update(
        PATH=f"{workdir / '.bin'}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(root),
        OMP_NUM_THREADS="1",
        MPLBACKEND="Agg",
    )
    return subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
