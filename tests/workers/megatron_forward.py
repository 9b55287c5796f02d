"""Worker: imported Megatron checkpoints, loaded with --load at the launch's TP, give Megatron's logits.

Args: SPEC_JSON OUT_JSON. SPEC_JSON lists cases {name, ckpt, reference, flags}. The process groups come from
the first case's config (every case uses the same layout); for each case every rank builds its shard of the
model with the trainer's own build and Checkpointer.load (any saved layout), runs one forward on the
reference's token ids, and the real columns of the TP ranks' vocabulary shards are gathered; rank 0 writes,
per case, the largest difference from Megatron's logits (over Megatron's padded vocabulary) and the largest logit.
"""

import json
import sys

import numpy as np
import torch
import torch.distributed as dist

from tricorn.checkpoint.checkpointer import Checkpointer
from tricorn.parallel.state import destroy_parallel, init_parallel
from tricorn.training.logging import MetricsLogger
from tricorn.training.main import build_trainer, resolve_config

spec_path, out_path = sys.argv[1:]
cases = json.loads(open(spec_path).read())
common = ["--device", "cpu", "--mock-data", "--no-load-optim", "--no-load-rng"]
configs = [resolve_config([*c["flags"], *common, "--load", c["ckpt"]]) for c in cases]
state = init_parallel(configs[0])
results = {}
for case, cfg in zip(cases, configs):
    ref = np.load(case["reference"])
    trainer = build_trainer(cfg, state, MetricsLogger(cfg, state.rank, state.device), with_validation=False)
    Checkpointer(cfg, state, lambda _: None).load(trainer)
    model = trainer.chunks[0].eval()
    with torch.no_grad():
        local = model(torch.from_numpy(ref["tokens"]))  # [b, s, padded vocab / TP]
    # Each TP rank holds ceil(V / TP) rows of the vocabulary, real ones first, then its share of the padding.
    chunk = -(-cfg.model.vocab_size // state.tp_size)
    parts = [torch.empty_like(local) for _ in range(state.tp_size)]
    dist.all_gather(parts, local.contiguous(), group=state.tp_group)
    logits = torch.cat([p[..., :chunk] for p in parts], dim=-1)[..., : cfg.model.vocab_size]
    theirs = torch.from_numpy(ref["logits"])
    err = (logits[..., : theirs.shape[-1]] - theirs).abs().max().item()
    results[case["name"]] = {"err": err, "scale": theirs.abs().max().item(), "tp": state.tp_size}
    trainer.optimizer.close()
if state.rank == 0:
    with open(out_path, "w") as fh:
        json.dump(results, fh)
destroy_parallel(clean_exit=True)
