"""Worker: the reference for --skip-samples, a run of pretrain_gpt.py on a training set with those samples removed.

argv[1] is a JSON list of sample indices, argv[2:] the trainer's flags (without --skip-samples). The training
source is replaced by a view of it that leaves the listed samples out, written independently of
tricorn/data/skip_samples.py: kept sample k is the k-th index not listed. tests/test_spikes.py compares
a --skip-samples run with this one, bitwise.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import tricorn.data.loader as data_loader  # noqa: E402
from tricorn.training.main import main  # noqa: E402


class WithoutSamples:
    def __init__(self, source, dropped: list[int]):
        self.source, self.dropped = source, sorted(dropped)

    def __len__(self) -> int:
        return len(self.source) - len(self.dropped)

    def __getitem__(self, k: int):
        index = k
        for d in self.dropped:  # ascending: each listed index at or below the candidate pushes it one further
            if d <= index:
                index += 1
        return self.source[index]


def run() -> int:
    dropped = json.loads(sys.argv[1])
    build = data_loader.build_loaders

    def build_without(*args, **kwargs):
        train, valid, test = build(*args, **kwargs)
        train.source = WithoutSamples(train.source, dropped)
        return train, valid, test

    data_loader.build_loaders = build_without
    return main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(run())
