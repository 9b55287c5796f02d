"""Worker: the prefetching loader's batches are those of 0 workers, in order, with a batch-size ramp and across a
resume, and with the document flags their positions and document bounds too. Run as its own process (tests/test_prefetch_loader.py): DataLoader workers are forks of the process that
starts them, and a pytest process may hold threads left by earlier in-process tests, which a fork can deadlock on.
Prints "ok"."""

import torch

from tricorn.data.base import GlobalBatchLoader, MockSamples
from tricorn.data.documents import DocumentFlags
from tricorn.data.prefetch import PrefetchingBatchLoader


def ramp(consumed: int) -> int:  # 4, 4, 8, 8, ...: the sampler must follow a changing global batch size
    return 4 if consumed < 8 else 8


def batches(loader, n):
    out = []
    for _ in range(n):
        b = loader.next(ramp(loader.consumed_samples))
        out.append((b.sample_ids, b.tokens, b.labels, b.loss_mask, b.position_ids, b.documents))
    return out


def equal(x, y) -> bool:
    return x is y is None or (x is not None and y is not None and torch.equal(x, y))


def same(a, b):
    return len(a) == len(b) and all(p[0] == q[0] and all(equal(x, y) for x, y in zip(p[1:], q[1:])) for p, q in zip(a, b))


source = MockSamples(500, 32, seed=7)
documents = DocumentFlags(int(source[0][5]), True, True, True)  # a token of the walk: several documents per sample
for dp_rank, docs in ((0, None), (1, None), (0, documents)):
    plain = batches(GlobalBatchLoader(source, dp_rank, 2, documents=docs), 6)
    assert docs is None or any(int((b[5][:, 1] < 32).sum()) for b in plain)  # some sample holds two documents
    prefetched = PrefetchingBatchLoader(GlobalBatchLoader(source, dp_rank, 2, documents=docs), 2, ramp)
    assert same(batches(prefetched, 3), plain[:3]), f"dp rank {dp_rank}: prefetched batches differ"
    prefetched.load_state_dict({"consumed_samples": 8})  # a resume: back to global batch 3
    assert same(batches(prefetched, 4), plain[2:]), f"dp rank {dp_rank}: batches after the resume differ"
    prefetched.close()
print("ok")
