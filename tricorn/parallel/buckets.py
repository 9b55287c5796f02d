"""The gradient-bucket plan, shared by the data-parallel buffers and the memory estimator.

Pure Python over any items with a size (parameters in parallel/data_parallel.py, parameter sizes in
planning/memory.py), so the estimator counts exactly the buckets the code builds. No collectives, no memory.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Optional, TypeVar

T = TypeVar("T")


def plan_buckets(
    items: Sequence[T],
    numel: Callable[[T], int],
    bucket_size: int,
    apart: Callable[[T, T], bool],
    group: Optional[Callable[[T], Hashable]] = None,
) -> list[list[T]]:
    """Buckets in backward order (``items`` reversed). A bucket closes once it holds ``bucket_size`` elements or
    more, or where ``apart(last, next)`` (a dtype change, a parameter that must sit alone). A parameter never
    spans two buckets (as in Megatron), so one larger than ``bucket_size`` - a vocabulary-sized embedding - is a
    bucket of its own size.

    ``group`` (a storage dtype: --fp8-param-gather's FP8 weights beside the 16-bit rest) plans each group's items
    apart, as Megatron keeps one buffer per dtype, so that the groups do not cut each other into small buckets;
    the buckets are then ordered by when their last item arrives in backward, the order their reductions start."""
    if group is not None:
        position = {id(it): i for i, it in enumerate(reversed(items))}
        keys = list(dict.fromkeys(group(it) for it in items))
        if len(keys) > 1:
            planned = [b for k in keys for b in plan_buckets([it for it in items if group(it) == k], numel, bucket_size, apart)]
            return sorted(planned, key=lambda b: max(position[id(it)] for it in b))
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
