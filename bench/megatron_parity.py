"""Benchmark: how closely tricorn continues Megatron-LM's own training, case by case.

For every run of tests/fixtures/megatron_parity/ (Megatron-LM's pretrain_gpt.py, made by
scripts/make_megatron_parity.py) it imports the checkpoint, trains on in tricorn to Megatron's last iteration
(tests/megatron_parity.py: the cases and layouts of tests/test_megatron_parity.py), and prints per case the
largest relative loss difference over the run, the first iteration above 1e-6 (none: never), the largest
relative grad norm difference, whether every logged lr equals Megatron's, and where the case evaluates the
largest relative validation loss difference. Not a test: it measures.

    .venv/bin/python bench/megatron_parity.py [--cases llama_dp1 ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from megatron_parity import (  # noqa: E402
    FROM_ITERATION0,
    RESUMES,
    continue_in_tricorn,
    differences,
    first_above,
    megatron_run,
    validation_differences,
)

BOUND = 1e-6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", help="only these cases (default: all)")
    args = parser.parse_args()
    runs = [(c, n, f, "megatron") for c, n, f in RESUMES] + [(c, n, (), "iteration0") for c, n in FROM_ITERATION0]
    runs.append(("llama_dp1_eval", 1, (), "iteration0"))  # the validation losses (tests: test_validation_losses_...)
    print(
        f"{'case':26} {'from':10} {'ranks':>5} {'flags':44} {'max rel loss diff':>17} {'first > 1e-6':>12} {'max rel grad norm':>17} {'lr ==':>5} {'max rel valid diff':>18}"
    )
    with tempfile.TemporaryDirectory(prefix="megatron_parity_") as tmp:
        for case, nproc, flags, source in runs:
            if args.cases and case not in args.cases:
                continue
            run = continue_in_tricorn(case, Path(tmp), nproc, flags, source=source)
            diffs = differences(run.records, megatron_run(case))
            first = first_above(diffs, BOUND)
            valid = [d for _, _, d in validation_differences(run.records, megatron_run(case))]
            start = "iteration 0" if source == "iteration0" else f"iteration {megatron_run(case)['save_iteration']}"
            print(
                f"{case:26} {start:10} {nproc:>5} {' '.join(flags) or '-':44} {max(d.loss for d in diffs):>17.3g} "
                f"{first if first is not None else 'none':>12} {max(d.grad_norm for d in diffs):>17.3g} "
                f"{str(all(d.lr_equal for d in diffs)):>5} {f'{max(valid):.3g}' if valid else '-':>18}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
