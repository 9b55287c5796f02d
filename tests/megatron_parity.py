"""Megatron-LM's own training, continued in tricorn: the helper tests/test_megatron_parity.py and bench/megatron_parity.py share.

A case of tests/fixtures/megatron_parity/ (made by scripts/make_megatron_parity.py) is one run of Megatron-LM's
pretrain_gpt.py: `run.json` (its argv, and per iteration the lm loss, grad norm and lr it logged), its --save
directory `megatron/` holding iteration K, and for some cases the initial weights `iteration0/`.
`continue_in_tricorn` imports one of those checkpoints with `tricorn import-megatron` and trains on in tricorn to
Megatron's last iteration; `differences` sets each of tricorn's iterations beside Megatron's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from harness import RunResult, run_layout

from tricorn.checkpoint.interop.megatron import RUN_CONFIG, import_megatron

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_parity"
# The corpus and tokenizer every case trained on; Megatron's argv (and so megatron.yaml) names them relative.
SHARED = ("corpus_text_document.bin", "corpus_text_document.idx", "tokenizer.model")


# (case, tricorn ranks, flags): every optimizer format's checkpoint at iteration K, each resumed on its own layout
# or another (DP1 <-> DP2, PP2, TP2).
RESUMES: list[tuple[str, int, tuple[str, ...]]] = [
    ("llama_dp1", 1, ()),
    ("llama_dp1_distopt", 2, ("--use-distributed-optimizer",)),  # dp_reshardable saved at DP1, resumed at DP2
    ("llama_dp1_fully", 1, ()),
    ("llama_dp1_torch", 1, ()),
    ("llama_dp1_torch_distopt", 1, ("--use-distributed-optimizer",)),
    ("gpt_dp2", 2, ()),
    ("gpt_dp2_distopt_buckets", 1, ()),  # bucketed dp_reshardable saved at DP2, resumed at DP1
    ("gpt_dp2_torch_distopt", 2, ("--use-distributed-optimizer", "--overlap-grad-reduce")),
    ("gpt_pp2_distopt_buckets", 2, ("--pipeline-model-parallel-size", "2")),
    ("llama_tp2_pp2_distopt", 2, ("--tensor-model-parallel-size", "2")),
]
# (case, tricorn ranks): from Megatron's iteration-0 weights.
FROM_ITERATION0: list[tuple[str, int]] = [("llama_dp1", 1), ("gpt_dp2", 2)]


def cases() -> list[str]:
    return sorted(p.parent.name for p in FIXTURES.glob("*/run.json"))


def megatron_run(case: str) -> dict:
    return json.loads((FIXTURES / case / "run.json").read_text())


def workdir(path: Path) -> Path:
    """A run directory holding (links to) the corpus and the tokenizer, where Megatron's relative paths resolve."""
    path.mkdir(parents=True, exist_ok=True)
    for name in SHARED:
        if not (path / name).exists():
            os.symlink(FIXTURES / name, path / name)
    return path


def import_case(case: str, tmp: Path, source: str = "megatron", load_optim: bool = True, console=None) -> Path:
    """CASE's checkpoint (`megatron`: iteration K, or `iteration0`) through `tricorn import-megatron`; the output dir."""
    out = tmp / f"import-{case}-{source}-{'optim' if load_optim else 'no-optim'}"
    if not out.exists():
        import_megatron(FIXTURES / case / source, out, load_optim=load_optim, console=console or (lambda _: None))
    return out


def continue_in_tricorn(
    case: str,
    tmp: Path,
    nproc: int = 1,
    flags: tuple[str, ...] = (),
    source: str = "megatron",
    megatron_argv: bool = False,
) -> RunResult:
    """Import CASE's checkpoint and train on in tricorn to Megatron's last iteration on `nproc` ranks, with `flags`
    added: from the import's megatron.yaml, or (`megatron_argv`) with Megatron's own command line, unchanged."""
    imported = import_case(case, tmp, source)
    if megatron_argv:
        base = [*megatron_run(case)["argv"], "--load", str(imported)]
    else:
        base = ["--config", str(imported / RUN_CONFIG), "--load", str(imported), "--log-interval", "1"]
    work = workdir(tmp / f"run-{case}-{source}-{nproc}-{len(flags)}")
    return run_layout([*base, *flags], nproc, work)


@dataclass(frozen=True)
class Difference:
    """One iteration, tricorn against Megatron: relative differences of the loss and grad norm, and both lrs logged."""

    iteration: int
    loss: float
    grad_norm: float
    lr: float  # tricorn's
    megatron_lr: float  # Megatron's logged lr: after its scheduler step, the next iteration's

    @property
    def lr_equal(self) -> bool:
        return self.lr == self.megatron_lr


def differences(records: list[dict], run: dict) -> list[Difference]:
    theirs = {r["iteration"]: r for r in run["iterations"]}
    out = []
    for r in records:
        if "loss" not in r or r["iteration"] not in theirs:
            continue
        m = theirs[r["iteration"]]
        out.append(
            Difference(
                r["iteration"],
                abs(r["loss"] - m["loss"]) / abs(m["loss"]),
                abs(r["grad_norm"] - m["grad_norm"]) / abs(m["grad_norm"]),
                r["lr"],
                m["lr_logged"],
            )
        )
    return out


def validation_differences(records: list[dict], run: dict) -> list[tuple[int, int, float]]:
    """(our iteration, Megatron's, relative difference) per evaluation, in order. Megatron's list also holds its two
    evaluations after training (validation, then test split), which tricorn does not run: ours pair with its first."""
    ours = [(r["iteration"], r["valid_loss"]) for r in records if "valid_loss" in r]
    theirs = [(v["iteration"], v["loss"]) for v in run["validation"]]
    return [(i, j, abs(loss - m) / abs(m)) for (i, loss), (j, m) in zip(ours, theirs)]


def first_above(diffs: list[Difference], bound: float) -> Optional[int]:
    """The first iteration whose loss differs from Megatron's by more than `bound` (relative), or None."""
    return next((d.iteration for d in diffs if d.loss > bound), None)
