"""The docs cannot rot: README.md and docs/*.md are checked against the code.

- Every flag that `pretrain_gpt.py --help` lists appears on some page, and every `tricorn SUBCOMMAND` flag.
- Every shell block marked ```` ```bash run ```` is executed (at tiny size, in a scratch directory), and every
  block marked ```` ```bash parse ```` has each command parsed by the real argument parser: pretrain_gpt.py's
  (and its pre-launch validation, with the world size the launcher would give), torchrun's, or the `tricorn`
  subcommand's / script's own. Unmarked blocks are plain examples. docs/testing.md describes the convention.
- Every relative link between pages, and every repository path written in backticks (`tricorn/...`,
  `tests/...`), resolves; links into a page's headings (`page.md#anchor`) too.
- README.md stays a front page (at most 250 lines) that links to every page of docs/.

The helpers are in tests/docs_checks.py. Each check has a negative test below, on a fake page, so that a check
which can no longer fail is noticed.
"""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest
from docs_checks import (
    MARKS,
    README_MAX_LINES,
    ROOT,
    SHELL_LANGS,
    Block,
    broken_links,
    check_parse_block,
    doc_pages,
    fenced_blocks,
    help_flags,
    missing_flags,
    page_variables,
    parsers_of,
    run_blocks,
    shell_commands,
    unlinked_pages,
)


def _blocks(mark: str) -> list[Block]:
    return [b for page in doc_pages() for b in fenced_blocks(page) if b.lang in SHELL_LANGS and b.mark == mark]


# ---------------------------------------------------------------------------------------------------------
# The checks on the real pages


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md has {len(text.splitlines())} lines"
    for command in ("make demo", "make test"):
        assert command in text


def test_every_page_is_linked_from_the_readme():
    assert unlinked_pages(ROOT / "README.md", doc_pages()[1:]) == []


def test_every_help_flag_is_documented():
    from tricorn.config_args import build_parser

    flags = help_flags(build_parser())
    assert len(flags) > 100  # the parser really was read
    missing = missing_flags(flags, [p.read_text() for p in doc_pages()])
    assert not missing, f"flags in `pretrain_gpt.py --help` on no page of README.md or docs/: {missing}"


def test_every_subcommand_flag_is_documented():
    from tricorn.cli import SUBCOMMANDS

    texts = [p.read_text() for p in doc_pages()]
    missing = {}
    for name, (target, _) in SUBCOMMANDS.items():
        module, func = target.split(":")
        parsers = parsers_of(getattr(importlib.import_module(module), func), ["--not-a-flag"])
        assert parsers, f"tricorn {name}: no argument parser seen"
        flags = sorted({f for parser in parsers for f in help_flags(parser)})
        if missing_flags(flags, texts):
            missing[name] = missing_flags(flags, texts)
    assert not missing, f"`tricorn SUBCOMMAND --help` flags on no page of README.md or docs/: {missing}"


def test_shell_blocks_carry_known_marks():
    bad = [
        f"{b.where()}: ```{b.lang} {b.mark}"
        for page in doc_pages()
        for b in fenced_blocks(page)
        if b.lang in SHELL_LANGS and b.mark not in ("",) + MARKS
    ]
    assert not bad, f"unknown marks (use run or parse, see docs/testing.md): {bad}"


def test_links_resolve():
    problems = broken_links(doc_pages(), set())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("block", _blocks("parse"), ids=lambda b: b.where())
def test_parse_block(block):
    check_parse_block(block)


_RUN_PAGES = sorted({b.page for b in _blocks("run")})


@pytest.mark.parametrize("page", _RUN_PAGES, ids=lambda p: p.name)
def test_run_blocks(page, tmp_path):
    blocks = [b for b in _blocks("run") if b.page == page]
    result = run_blocks(blocks, tmp_path)
    tail = (result.stdout + result.stderr)[-4000:]
    assert result.returncode == 0, f"{page.name}: a run block failed (exit {result.returncode}):\n{tail}"


def test_there_are_blocks_of_both_kinds():
    assert len(_blocks("parse")) >= 10 and 2 <= len(_blocks("run")) <= 12


# ---------------------------------------------------------------------------------------------------------
# Each check can fail


def test_missing_flag_is_caught():
    parser = argparse.ArgumentParser()
    parser.add_argument("--documented-flag")
    parser.add_argument("--undocumented-flag")
    parser.add_argument("--hidden-alias", help=argparse.SUPPRESS)
    flags = help_flags(parser)
    assert flags == ["--documented-flag", "--undocumented-flag"]
    assert missing_flags(flags, ["use `--documented-flag X`; `--undocumented-flag-x` is another flag"]) == ["--undocumented-flag"]


def test_parsers_of_finds_every_parser():
    def main(argv):
        extra = argparse.ArgumentParser(add_help=False)
        extra.add_argument("--extra")
        _, rest = extra.parse_known_args(argv)
        top = argparse.ArgumentParser()
        sub = top.add_subparsers().add_parser("train")
        sub.add_argument("--inner", required=True)
        top.parse_args(rest)
        raise AssertionError("never reached")

    original = argparse.ArgumentParser.parse_args
    flags = sorted({f for p in parsers_of(main, ["--x"]) for f in help_flags(p)})
    assert flags == ["--extra", "--inner"]
    assert argparse.ArgumentParser.parse_args is original  # put back


def test_bad_links_are_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "tricorn").mkdir()
    (tmp_path / "tricorn" / "real.py").write_text("")
    good = tmp_path / "docs" / "good.md"
    good.write_text("# Good page\n\n## A `flag` section\n\ntext\n")
    bad = tmp_path / "docs" / "bad.md"
    bad.write_text(
        "# Bad\n\n[ok](good.md) [ok](good.md#a-flag-section) [ok](../tricorn/real.py) [web](https://x.org/y)\n"
        "[gone](nothere.md) [anchor](good.md#no-such-heading) [self](#bad) [self](#nope)\n"
        "`tricorn/real.py` `tricorn/missing.py` `tricorn/pending.py::test_x`\n"
        "```\n[inside a block](ignored.md)\n```\n"
    )
    problems = broken_links([good, bad], {"tricorn/pending.py"}, root=tmp_path)
    assert problems == [
        "bad.md: link to nothere.md: nothere.md does not exist",
        "bad.md: link to good.md#no-such-heading: no heading #no-such-heading in good.md",
        "bad.md: link to #nope: no heading #nope in bad.md",
        "bad.md: `tricorn/missing.py` does not exist",
    ]


def test_unlinked_page_is_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    pages = [tmp_path / "docs" / "a.md", tmp_path / "docs" / "b.md"]
    for p in pages:
        p.write_text("# page\n")
    (tmp_path / "README.md").write_text("[a](docs/a.md#page)\n\n```\n[b](docs/b.md)\n```\n")
    assert unlinked_pages(tmp_path / "README.md", pages) == ["b.md"]


def test_self_anchor_is_checked(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Title\n\n[a](#title) [b](#nope)\n")
    assert broken_links([page], set(), root=tmp_path) == ["p.md: link to #nope: no heading #nope in p.md"]


def test_bad_commands_are_caught():
    cases = {
        "python pretrain_gpt.py --mock-data --vocab-size 500 --no-such-flag": "no-such-flag",
        "python pretrain_gpt.py --mock-data --vocab-size 500 --hidden-dropout 1.5": "must be in [0, 1)",
        "torchrun --nproc-per-node 3 pretrain_gpt.py --mock-data --vocab-size 500 --tensor-model-parallel-size 2": (
            "world size 3"
        ),
        "srun --nodes 2 --ntasks-per-node 3 python pretrain_gpt.py --model-preset tiny --mock-data --vocab-size 500 "
        "--tensor-model-parallel-size 4": "world size 6",
        "tricorn schedule --pp 4 --no-such-option": "refused",
        "tricorn preprocess --input a.jsonl": "refused",  # --output-prefix is required
        "make everything": "no parser known",
        "torchrun --no-such-torchrun-option pretrain_gpt.py": "torchrun's parser refused it",
        "sbatch scripts/slurm/llama2-7b.sbatch": "needs DATA_PATH",
        'DATA_ARGS="--mock-data --tensor-model-parallel-size 3" sbatch scripts/slurm/llama2-7b.sbatch': (
            "not divisible by --tensor-model-parallel-size 3"
        ),
        "sbatch scripts/slurm/nope.sbatch": "no such script",
        "python scripts/no_such_script.py": "no such script",
        "python pretrain_gpt.py --mock-data --vocab-size 500 | tee log": "pipes",
    }
    for command, needle in cases.items():
        block = Block(Path("fake.md"), 1, "bash", "parse", command)
        with pytest.raises(AssertionError, match=re.escape(needle)):
            check_parse_block(block)
    good = Block(Path("fake.md"), 1, "bash", "parse", 'F="--mock-data --vocab-size 500"\npython pretrain_gpt.py $F')
    check_parse_block(good)


def test_variables_carry_over_between_blocks_of_a_page(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        '```bash run\nF="--mock-data --vocab-size 500"\n```\n\n```bash\nG="--not-seen"\n```\n\n'
        "```bash parse\npython pretrain_gpt.py $F $G\n```\n"
    )
    block = fenced_blocks(page)[2]
    assert page_variables(block) == {"F": "--mock-data --vocab-size 500"}  # unmarked blocks are not part of it
    assert shell_commands(block.body, page_variables(block)) == [
        ({}, ["python", "pretrain_gpt.py", "--mock-data", "--vocab-size", "500", "$G"])
    ]


def test_failing_run_block_is_caught(tmp_path):
    ok = Block(tmp_path / "fake.md", 1, "bash", "run", "echo hello > out.txt")
    bad = Block(tmp_path / "fake.md", 5, "bash", "run", "false\necho never")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert run_blocks([ok], tmp_path / "a").returncode == 0
    assert (tmp_path / "a" / "out.txt").read_text() == "hello\n"  # in the scratch dir, not the repo
    result = run_blocks([ok, bad], tmp_path / "b")
    assert result.returncode != 0 and "never" not in result.stdout and ">>> fake.md:5" in result.stdout


def test_unknown_mark_is_caught(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("```bash runn\necho hi\n```\n\n```bash run\necho hi\n```\n\n```python\nx = 1\n```\n")
    blocks = fenced_blocks(page)
    assert [(b.lang, b.mark) for b in blocks] == [("bash", "runn"), ("bash", "run"), ("python", "")]
    assert [b.mark in ("",) + MARKS for b in blocks] == [False, True, True]
