"""The gradient-bucket plan, shared by the data-parallel buffers and the memory estimator.

Pure Python over any items with a size (parameters in parallel/data_parallel.py, parameter sizes in
planning/memory.py), so the estimator counts exactly the buckets the code builds. No collectives, no memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def plan_buckets(items: Sequence[T], numel: Callable[[T], int], bucket_size: int, apart: Callable[[T, T], bool]) -> list[list[T]]:
    """Buckets in backward order (``items`` reversed). A bucket closes once it holds ``bucket_size`` elements or
    more, or where ``apart(last, next)`` (a dtype change, a parameter that must sit alone). A parameter never
    spans two buckets (as in Megatron), so one larger than ``bucket_size`` - a vocabulary-sized embedding - is a
    bucket of its own size."""
    buckets: list[list[T]] = []
    current: list[T] = []
    size = 0
    for item in reversed(items):
        if current and (size >= bucket_size or apart(current[-1], item)):
            buckets.append(current)
            current, size = [], 0
        current.append(item)
        size += numel(item)
    if current:
        buckets.append(current)
    return buckets
