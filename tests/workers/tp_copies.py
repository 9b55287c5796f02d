"""Worker: the TP, SP and CP collectives copy nothing on sequence-first tensors.

A column -> row parallel pair (with and without sequence parallelism) runs forward and backward on
[s, b, h] inputs, and context-parallel attention forward on [b, heads, s, d] views of [s, b, heads, d]
tensors (as the decoder passes them), under a dispatch mode that records every aten copy_ and clone
outside the collectives themselves: there must be none. (Transposing the sequence to the front for a
collective, or cloning before an in-place all-reduce, would show up here; gloo's copies inside its
collectives are not ours.) Prints "ok" on rank 0.
"""

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tricorn.parallel.context import context_parallel_attention
from tricorn.parallel.tensor import ColumnParallelLinear, RowParallelLinear

COPIES = {torch.ops.aten.copy_.default, torch.ops.aten.clone.default}


class CopyCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.copies: list[str] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in COPIES and not self.paused:
            self.copies.append(f"{func} {[(tuple(a.shape), a.stride()) for a in args if isinstance(a, torch.Tensor)]}")
        return func(*args, **(kwargs or {}))


COUNTER = CopyCounter()


def _uncounted(fn):
    """`fn` with the counter paused; an asynchronous collective's work is paused in its wait() too."""

    def call(*args, **kwargs):
        COUNTER.paused = True
        try:
            out = fn(*args, **kwargs)
        finally:
            COUNTER.paused = False
        return _Work(out) if out is not None else None

    return call


class _Work:
    def __init__(self, work):
        self.work = work

    def wait(self):
        return _uncounted(self.work.wait)()


for name in ("all_gather_single", "reduce_scatter_single", "all_reduce", "all_to_all_single"):
    setattr(dist, name, _uncounted(getattr(dist, name)))


dist.init_process_group("gloo")
group = dist.group.WORLD
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(rank)
s, b, h, out = 8, 2, 16, 12

for sp in (False, True):
    col = ColumnParallelLinear(h, out, bias=True, group=group, sequence_parallel=sp)
    row = RowParallelLinear(out, h, bias=True, group=group, sequence_parallel=sp)
    for p in (*col.parameters(), *row.parameters()):
        torch.nn.init.normal_(p)
    x0 = torch.randn(s // world if sp else s, b, h, requires_grad=True)
    with COUNTER:
        y = row(col(x0 * 1.0))  # a non-leaf input, as in the model
        y.backward(torch.randn_like(y))
    assert COUNTER.copies == [], f"rank {rank} sp={sp}: {COUNTER.copies}"

heads, groups, d = 4, 2, 8
q, k, v = (torch.randn(s, b, n, d).permute(1, 2, 0, 3) for n in (heads, groups, groups))
with COUNTER:  # forward only: torch's CPU attention kernel writes the k and v gradients batch-major
    context_parallel_attention(group)(q, k, v, None)
# The ring (the default comm type) copies no q, k or v: per step it folds the block's [b, heads, s] log-sum-exp
# (its rows: all s, or the second chunk's s/2) into its fp32 accumulator (one copy_), and once casts the merged
# output into q's layout (one copy_).
lse = (f"aten.copy_.default [(({b}, {heads}, {s}),", f"aten.copy_.default [(({b}, {heads}, {s // 2}),")
output = f"aten.copy_.default [(({b}, {heads}, {s}, {d}), {q.stride()}),"
assert len(COUNTER.copies) == world + 1, f"rank {rank} cp: {COUNTER.copies}"
assert all(c.startswith(lse) for c in COUNTER.copies[:-1]) and COUNTER.copies[-1].startswith(output), COUNTER.copies
dist.barrier()  # exit together: a rank leaving mid-collective aborts gloo on its peers
dist.destroy_process_group()
if rank == 0:
    print("ok")
