"""--skip-samples FILE: training samples left out of the data order, and the compact form that names samples.

A sample is named by its index in the training sample order (Batch.sample_ids: the index the train
dataset is read at, before any skipping). The file lists indices and inclusive ranges, separated by
whitespace or commas, with ``#`` comments::

    # iteration 1200 spiked
    4800-4803
    5017, 5020

A skipped sample is passed over where it falls; every other sample keeps its place in the order, so a
run with a skip list trains on the same sequence minus those samples. The loader's position is the
count of samples trained plus the count passed over (both checkpointed), so a resume continues at the
same raw position even when the list has grown since: only samples not yet reached are left out.
Pure Python, no torch: no collectives, no device memory (the list is a sorted array and a set).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
MAX_SAMPLES = 10**6  # a skip list is for a few bad batches; every rank holds it as a set (~80 MB at this size)


class SkipSamplesError(ValueError):
    pass


@dataclass(frozen=True)
class SkipList:
    """Sorted, distinct sample indices to leave out of the training order."""

    indices: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_set", frozenset(self.indices))

    def __len__(self) -> int:
        return len(self.indices)

    def __contains__(self, index: int) -> bool:
        return index in self._set  # type: ignore[attr-defined]

    def take(self, position: int, count: int) -> list[int]:
        """The next `count` sample indices from raw `position` on, the listed ones passed over."""
        out: list[int] = []
        k = bisect.bisect_left(self.indices, position)
        while len(out) < count:
            stop = self.indices[k] if k < len(self.indices) else position + count - len(out)
            run = min(stop - position, count - len(out))  # the samples up to the next listed one
            out.extend(range(position, position + run))
            position += run
            if k < len(self.indices) and position == self.indices[k]:
                position += 1
                k += 1
        return out


def parse_skip_samples(text: str, where: str) -> SkipList:
    """The indices of a --skip-samples file's text; SkipSamplesError names the first token that is not one."""
    found: set[int] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        for token in line.split("#", 1)[0].replace(",", " ").split():
            m = _RANGE.match(token)
            if m is None or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
                raise SkipSamplesError(
                    f"{where} line {number}: '{token}' is not a sample index or an inclusive range A-B with A <= B "
                    "(write indices and ranges separated by spaces or commas, # starts a comment)"
                )
            lo = int(m.group(1))
            hi = int(m.group(2)) if m.group(2) is not None else lo
            if len(found) + hi - lo + 1 > MAX_SAMPLES:  # checked before the range is expanded
                raise SkipSamplesError(
                    f"{where} line {number}: the list reaches more than {MAX_SAMPLES:,} samples at '{token}'; "
                    "a skip list is for a few bad batches (to drop a whole range of the data, change --split or the dataset)"
                )
            found.update(range(lo, hi + 1))
    return SkipList(tuple(sorted(found)))


def read_skip_samples(path: Optional[str]) -> Optional[SkipList]:
    """The file's list (None without --skip-samples, or for a file that lists nothing)."""
    if not path:
        return None
    with open(path) as fh:
        skip = parse_skip_samples(fh.read(), f"--skip-samples {path}")
    return skip if len(skip) else None


def skip_samples_errors(path: Optional[str], num_samples: int) -> list[str]:
    """Before launch: the file must be readable, parse, and name samples of the training order [0, num_samples)."""
    if not path:
        return []
    try:
        skip = read_skip_samples(path)
    except OSError as e:
        return [f"--skip-samples {path}: cannot read it ({e.strerror or e}); pass a text file of sample indices"]
    except UnicodeDecodeError:
        return [f"--skip-samples {path} is not a text file; list sample indices and ranges A-B, one or more a line"]
    except SkipSamplesError as e:
        return [str(e)]
    if skip is not None and skip.indices[-1] >= num_samples:
        outside = [i for i in skip.indices if i >= num_samples]
        return [
            f"--skip-samples {path} names {len(outside)} sample(s) outside the training data, e.g. {outside[0]}: "
            f"this run's sample order has {num_samples} samples (--train-iters x --global-batch-size), indices 0..{num_samples - 1}"
        ]
    return []


def format_samples(ids: Iterable[int]) -> str:
    """Sample indices in the file's syntax, consecutive ones as ranges: "44-47 52"."""
    parts: list[str] = []
    run: list[int] = []
    for i in sorted(ids):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            parts.append(_run_text(run))
        run = [i]
    if run:
        parts.append(_run_text(run))
    return " ".join(parts)


def _run_text(run: Sequence[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"
