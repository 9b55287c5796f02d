"""Worker: the prefetching loader's batches are those of 0 workers, in order, with a batch-size ramp and across a
resume. Run as its own process (tests/test_prefetch_loader.py): DataLoader workers are forks of the process that
starts them, and a pytest process may hold threads left by earlier in-process tests, which a fork can deadlock on.
Prints "ok"."""

import torch

from tricorn.data.base import GlobalBatchLoader, MockSamples
from tricorn.data.prefetch import PrefetchingBatchLoader


def ramp(consumed: int) -> int:  # 4, 4, 8, 8, ...: the sampler must follow a changing global batch size
    return 4 if consumed < 8 else 8


def batches(loader, n):
    out = []
    for _ in range(n):
        b = loader.next(ramp(loader.consumed_samples))
        out.append((b.tokens, b.labels, b.loss_mask, b.sample_ids))
    return out


def same(a, b):
    return len(a) == len(b) and all(all(torch.equal(x, y) for x, y in zip(p[:3], q[:3])) and p[3] == q[3] for p, q in zip(a, b))


source = MockSamples(500, 32, seed=7)
for dp_rank in (0, 1):
    plain = batches(GlobalBatchLoader(source, dp_rank, 2), 6)
    prefetched = PrefetchingBatchLoader(GlobalBatchLoader(source, dp_rank, 2), 2, ramp)
    assert same(batches(prefetched, 3), plain[:3]), f"dp rank {dp_rank}: prefetched batches differ"
    prefetched.load_state_dict({"consumed_samples": 8})  # a resume: back to global batch 3
    assert same(batches(prefetched, 4), plain[2:]), f"dp rank {dp_rank}: batches after the resume differ"
    prefetched.close()
print("ok")
