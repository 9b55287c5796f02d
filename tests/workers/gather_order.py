"""Worker: --overlap-param-gather issues the parameter all-gathers in forward-use order, and the first
forward (the embedding) waits only for its own bucket's gather (DP = WORLD_SIZE, distributed optimizer).
Every rank asserts; rank 0 prints the issue order and "ok"."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from harness import BASE_FLAGS  # noqa: E402

from tricorn.parallel.data_parallel import Bucket  # noqa: E402
from tricorn.parallel.state import init_parallel  # noqa: E402
from tricorn.training.logging import MetricsLogger  # noqa: E402
from tricorn.training.main import build_trainer, resolve_config  # noqa: E402

FLAGS = BASE_FLAGS + [
    "--use-distributed-optimizer",
    "--overlap-param-gather",
    "--overlap-grad-reduce",
    "--ddp-bucket-size",
    "20000",
]


def main() -> None:
    cfg = resolve_config(FLAGS + sys.argv[1:])
    state = init_parallel(cfg)
    trainer = build_trainer(cfg, state, MetricsLogger(cfg, rank=1), with_validation=False)
    dp = trainer.optimizer.data_parallel[0]
    assert len(dp.buckets) > 2, "the test needs several buckets"
    events: list[tuple[str, int]] = []
    start, finish = Bucket.start_param_gather, Bucket.finish_param_gather

    def recording_start(self):
        events.append(("start", self.index))
        start(self)

    def recording_finish(self):
        if self.gather_work is not None:
            events.append(("wait", self.index))
        finish(self)

    Bucket.start_param_gather, Bucket.finish_param_gather = recording_start, recording_finish
    embedding = trainer.chunks[0].tok_embeddings
    embedding_bucket = dp.slot_of[id(embedding.weight)][0].index
    seen_at_embedding: list[list[tuple[str, int]]] = []
    embedding.register_forward_pre_hook(lambda m, a: seen_at_embedding.append(list(events)))  # after the gather wait
    trainer.run_iteration()  # its step issues the gathers the next forward waits for
    issued = [i for kind, i in events if kind == "start"]
    trainer.run_iteration()
    where = f"rank {state.rank}"
    assert issued == list(reversed(range(len(dp.buckets)))), f"{where}: gathers issued in order {issued}"
    assert issued[0] == embedding_bucket, f"{where}: the embedding's bucket {embedding_bucket} is not gathered first"
    waited = [i for kind, i in seen_at_embedding[1][len(issued) :] if kind == "wait"]
    assert waited == [embedding_bucket], f"{where}: the first forward waited for buckets {waited}"
    trainer.optimizer.wait_all()
    if state.rank == 0:
        print(issued)
        print("ok")


if __name__ == "__main__":
    main()
